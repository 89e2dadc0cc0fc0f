"""One rule for the number of evaluated tokens (``eval --tokens`` and chapter 4's ``tokens``),
and ``--no-progress`` reaching every step of ``eval``."""

from __future__ import annotations

from pathlib import Path

import papermill
import pytest
import torch

from rqlib.cli import main
from rqlib.study import allocation
from rqlib.study import eval as evaluation
from rqlib.study.eval import MIN_SCORED_TOKENS, check_scored_tokens, evaluation_tokens

ROOT = Path(__file__).resolve().parent.parent


def test_too_few_scored_tokens_are_refused_naming_the_minimum(rng):
    window = int(torch.randint(MIN_SCORED_TOKENS + 1, 4096, (1,), generator=rng))
    # one window scores all its tokens but the first: MIN + 1 tokens is the least accepted
    assert check_scored_tokens(MIN_SCORED_TOKENS + 1, window) == MIN_SCORED_TOKENS
    for too_few in (MIN_SCORED_TOKENS, 2, 1):
        with pytest.raises(ValueError, match=f"at least {MIN_SCORED_TOKENS} must be scored"):
            check_scored_tokens(too_few, window)
    with pytest.raises(ValueError, match="0: the whole corpus"):
        check_scored_tokens(-1, window)


def test_zero_tokens_is_the_whole_corpus_from_the_offset(rng):
    ids = torch.randint(0, 1000, (300,), generator=rng)
    taken = MIN_SCORED_TOKENS + 4  # a count that scores enough tokens
    # every offset that leaves the corpus at least `taken` tokens, so both calls are valid
    offset = int(torch.randint(0, len(ids) - taken + 1, (1,), generator=rng))
    assert evaluation_tokens(ids, offset, 0, 64).tolist() == ids[offset:].tolist()
    selected = evaluation_tokens(ids, offset, taken, 64)
    assert selected.tolist() == ids[offset : offset + taken].tolist()
    with pytest.raises(ValueError, match="at least"):
        evaluation_tokens(ids, 300 - 4, 0, 64)


def test_the_command_and_chapter_4_state_the_same_rule(capsys):
    assert main(["eval", "--tokens", "2", "--model", "smollm2-135m"]) == 2
    error = capsys.readouterr().err
    assert "--tokens" in error and f"at least {MIN_SCORED_TOKENS} must be scored" in error
    assert error.count("\n") == 1
    described = papermill.inspect_notebook(str(ROOT / "notebooks" / "04_perplexity.ipynb"))
    assert "0: the whole corpus" in described["tokens"]["help"]
    assert f"at least {MIN_SCORED_TOKENS} scored" in described["tokens"]["help"]
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    helped = capsys.readouterr().out
    assert "0: the whole corpus" in " ".join(helped.split())


def test_no_progress_reaches_the_budget_and_the_evaluation(monkeypatch):
    """``eval --no-progress`` with a preset: resolving its budget (which may measure the
    model, with a progress bar) and the evaluation both run without one."""
    from rqlib import cli
    from rqlib.spec.config import CompressionConfig

    seen = []

    class Stop(Exception):
        pass

    def prepared(args):
        ids = torch.arange(64)
        return [CompressionConfig.parse("preset:rq-3.5")], None, None, None, ids

    def resolve(config, model, tokenizer, *, context, progress=True):
        seen.append(("resolve", progress))
        return config

    def evaluate(*args, progress=True, **kwargs):
        seen.append(("evaluate", progress))
        raise Stop

    monkeypatch.setattr(cli, "_prepare_eval", prepared)
    monkeypatch.setattr(allocation, "resolve", resolve)
    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    with pytest.raises(Stop):
        main(["eval", "--no-progress", "--method", "preset:rq-3.5"])
    assert seen == [("resolve", False), ("evaluate", False)]
