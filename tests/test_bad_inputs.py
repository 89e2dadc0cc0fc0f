"""Bad inputs, one table: the API, the spec parser, files on disk, sweeps and the CLI.

Each row is an input a user could give (or a state a crash could leave) and the outcome it must
have: a specific error type with a fragment of its message (:class:`Raises`), or a specific
correct result (:class:`Gives`, which says it in words). Rows that need a real model (the CLI
checks against SmolLM2) load it once. The rows about a copied cache and a failure in the middle
of a forward hold the compressed cache's layers to their invariants: a copy refuses updates, and
a failed step is rolled back.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rqlib.base import files
from rqlib.base.paths import CHECKOUT, cache_dir
from rqlib.book import results as results_module
from rqlib.book.provenance import provenance
from rqlib.book.results import (
    ResultFileWarning,
    StaleResultsError,
    collect,
    common_provenance,
    save_result,
)
from rqlib.book.sweep import plan_sweep
from rqlib.cli import main
from rqlib.core import codebooks
from rqlib.hf import compress, models
from rqlib.hf.weights import weight_signature
from rqlib.spec.config import CompressionConfig
from rqlib.study import allocation

VOCAB = 101


# ---- the table's vocabulary --------------------------------------------------------------------
@dataclass(frozen=True)
class Raises:
    """The row must raise ``error`` with a message matching ``pattern`` (a regex)."""

    error: type[BaseException]
    pattern: str


@dataclass(frozen=True)
class Gives:
    """The row must return a value for which ``check`` is true: ``what`` says it in words."""

    what: str
    check: Callable[[Any], bool]


@dataclass
class Context:
    tmp: Path
    rng: torch.Generator
    monkeypatch: pytest.MonkeyPatch
    capsys: pytest.CaptureFixture

    def seed(self) -> int:
        return int(torch.randint(0, 2**31 - 1, (1,), generator=self.rng))

    def tiny(self, layers: int = 3) -> LlamaForCausalLM:
        """A small random Llama (GQA 4:2), fresh weights every call."""
        torch.manual_seed(self.seed())
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=128,
        )
        return LlamaForCausalLM(config).eval()

    def ids(self, length: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (1, length), generator=self.rng)


def spec_error(spec: str) -> Callable[[Context], Any]:
    return lambda ctx: CompressionConfig.parse(spec)


# ---- the compress() block and the cache ---------------------------------------------------------
SPEC = "turboquant-mse:k4:v4"


def _decode_reference(model, prefix, step):
    with torch.no_grad(), compress(model, SPEC) as cache:
        model(prefix, cache=cache)
        return model(step, cache=cache).logits


def out_of_order_exit(ctx: Context):
    """Two models share one config; the first block ends while the second is still open."""
    a = ctx.tiny()
    b = LlamaForCausalLM(a.config).eval()  # the same config object, other weights
    assert b.config is a.config
    prefix, step = ctx.ids(12), ctx.ids(1)
    reference = _decode_reference(b, prefix, step)
    block_a, block_b = compress(a, SPEC), compress(b, SPEC)
    with torch.no_grad():
        block_a.__enter__()
        cache_b = block_b.__enter__()
        b(prefix, cache=cache_b)
        block_a.__exit__(None, None, None)  # a leaves first
        during = a.config._attn_implementation
        logits = b(step, cache=cache_b).logits  # b still decodes with its context
        block_b.__exit__(None, None, None)
    # same operations on the same inputs: only float reordering could differ
    same = torch.allclose(logits, reference, atol=1e-5, rtol=0)
    return same, during, a.config._attn_implementation


def exception_in_block(ctx: Context):
    model = ctx.tiny()
    try:
        with compress(model, SPEC):
            raise KeyError("raised inside the block")
    except KeyError:
        pass
    return model.config._attn_implementation


def nested_block(ctx: Context):
    model = ctx.tiny()
    with compress(model, SPEC), compress(model, SPEC):
        pass


def cache_after_its_block(ctx: Context):
    model = ctx.tiny()
    with torch.no_grad():
        with compress(model, SPEC) as cache:
            model(ctx.ids(8), cache=cache)
        model(ctx.ids(1), cache=cache)


def _copied_after_block(ctx: Context, make_copy):
    model = ctx.tiny()
    with torch.no_grad():
        with compress(model, SPEC) as cache:
            model(ctx.ids(8), cache=cache)
            copied = make_copy(cache)
        # outside any block: the model's own attention would read the new token only
        model(ctx.ids(1), cache=copied)


def deep_copied_cache(ctx: Context):
    _copied_after_block(ctx, copy.deepcopy)


def pickled_cache(ctx: Context):
    _copied_after_block(ctx, lambda cache: pickle.loads(pickle.dumps(cache)))


def failure_mid_forward(ctx: Context):
    """A layer raises in the middle of a decode step; the cache must stay consistent."""
    model = ctx.tiny()
    prefix, step = ctx.ids(10), ctx.ids(1)
    reference = _decode_reference(model, prefix, step)

    def fail(module, args, kwargs):
        raise FloatingPointError("a non-finite value in layer 1")

    with torch.no_grad(), compress(model, SPEC) as cache:
        model(prefix, cache=cache)
        hook = model.model.layers[1].self_attn.register_forward_pre_hook(fail, with_kwargs=True)
        try:
            model(step, cache=cache)
        except FloatingPointError:
            pass
        finally:
            hook.remove()
        # what the model and generate() read: every layer's length through the cache
        lengths = {cache.get_seq_length(i) for i in range(len(cache.layers))}
        try:
            logits = model(step, cache=cache).logits
        except RuntimeError as error:  # marked unusable: the message must say why
            return {"lengths": lengths, "error": str(error)}
    return {"lengths": lengths, "same": torch.allclose(logits, reference, atol=1e-5, rtol=0)}


def _consistent_after_failure(outcome: dict) -> bool:
    if "error" in outcome:
        return bool(re.search(r"unusable|failed|rolled back", outcome["error"]))
    return len(outcome["lengths"]) == 1 and outcome["same"]


# ---- allocation tables and fingerprints ---------------------------------------------------------
def _fake_measure(calls: list):
    """A stand-in for measure_sensitivity: a table of random KLs, instantly."""

    def measure(model, tokenizer, config, **kwargs):
        calls.append(config.spec())
        n_layers = model.config.num_hidden_layers
        generator = torch.Generator().manual_seed(len(calls))
        kl = {
            (kind, layer, bits): float(torch.rand(1, generator=generator)) * 4.0**-bits
            for layer in range(n_layers)
            for kind, options in (("key", allocation.KEY_BITS), ("value", allocation.VALUE_BITS))
            for bits in options
        }
        base = allocation._base_of(config).spec()
        return allocation.Sensitivity(base, weight_signature(model), n_layers, {}, 16, 0, kl)

    return measure


def _isolated_tables(ctx: Context) -> list:
    ctx.monkeypatch.setenv("RQLIB_CACHE", str(ctx.tmp / "cache"))
    ctx.monkeypatch.setattr(allocation, "SHIPPED", ctx.tmp / "shipped")
    calls: list = []
    ctx.monkeypatch.setattr(allocation, "measure_sensitivity", _fake_measure(calls))
    return calls


ALLOC = "turboquant-mse:sink1:alloc=3"


def truncated_cached_table(ctx: Context):
    calls = _isolated_tables(ctx)
    model = ctx.tiny()
    first = allocation.resolve(ALLOC, model, None, progress=False)
    (path,) = (ctx.tmp / "cache" / "allocations").glob("sensitivity-*.json")
    path.write_text(path.read_text()[:100])  # a crash half-way through an old-style write
    ctx.capsys.readouterr()
    second = allocation.resolve(ALLOC, model, None, progress=False)
    message = ctx.capsys.readouterr().err
    json.loads(path.read_text())  # rewritten whole
    named = str(path) in message and "corrupt" in message
    return len(calls), named, second.layer_key_bits != () and first.layer_key_bits != ()


def truncated_shipped_table(ctx: Context):
    _isolated_tables(ctx)
    shipped = ctx.tmp / "shipped"
    shipped.mkdir()
    (shipped / "model.json").write_text('{"base": "turboquant-mse:k3:v3", "rows": [')
    allocation.find_sensitivity(ctx.tiny(), CompressionConfig.parse(ALLOC))


def impossible_budget(ctx: Context):
    calls = _isolated_tables(ctx)
    try:
        allocation.resolve("turboquant-mse:alloc=1", ctx.tiny(), None, progress=False)
    finally:
        assert calls == [], "measured before refusing the budget"


def concurrent_resolves(ctx: Context):
    calls = _isolated_tables(ctx)
    measure = allocation.measure_sensitivity

    def slow(*args, **kwargs):
        time.sleep(0.5)  # long enough for the other thread to reach the lock
        return measure(*args, **kwargs)

    ctx.monkeypatch.setattr(allocation, "measure_sensitivity", slow)
    model = ctx.tiny()
    weight_signature(model)  # computed once before the threads start
    resolved = []
    threads = [
        threading.Thread(target=lambda: resolved.append(allocation.resolve(ALLOC, model, None)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(calls), len(resolved), resolved[0] == resolved[1]


def _shipped_table_for(ctx: Context, model) -> None:
    _isolated_tables(ctx)
    table = _fake_measure([])(model, None, CompressionConfig.parse(ALLOC))
    shipped = ctx.tmp / "shipped"
    shipped.mkdir(exist_ok=True)
    (shipped / "tiny.json").write_text(json.dumps(table.to_dict()))


def table_found_in(dtype):
    def run(ctx: Context):
        model = ctx.tiny()
        _shipped_table_for(ctx, model)  # measured in fp32
        return allocation.find_sensitivity(model.to(dtype), CompressionConfig.parse(ALLOC))

    return run


def packaged_table_in(dtype):
    """The shipped SmolLM2 tables were measured in fp32; the model loaded in ``dtype``."""

    def run(ctx: Context):
        model, _ = models.load_model("smollm2-135m", dtype=dtype)
        table = allocation.find_sensitivity(model, CompressionConfig.parse("preset:rq-3.5"))
        shipped = json.loads((allocation.SHIPPED / "smollm2-135m.json").read_text())
        return table is not None and table.kl == allocation.Sensitivity.from_dict(shipped).kl

    return run


def table_after_changed_weights(change):
    def run(ctx: Context):
        model = ctx.tiny()
        _shipped_table_for(ctx, model)
        with torch.no_grad():
            change(model.model.layers[1].self_attn.k_proj.weight)
        return allocation.find_sensitivity(model, CompressionConfig.parse(ALLOC))

    return run


# ---- files ---------------------------------------------------------------------------------------
def failed_write_keeps_the_old_file(ctx: Context):
    path = ctx.tmp / "table.json"
    path.write_text("old")
    try:
        with files.atomic_output(path) as temporary:
            temporary.write_text("half of the new")
            raise OSError("disk full")
    except OSError:
        pass
    return path.read_text(), sorted(p.name for p in ctx.tmp.iterdir())


def no_clobber(ctx: Context):
    path = ctx.tmp / "out.json"
    path.write_text("a user's file")
    files.atomic_write_text(path, "new", overwrite=False)


def appears_while_writing(ctx: Context):
    """Another process creates the file while ours is being written: theirs must survive."""
    path = ctx.tmp / "out.json"
    try:
        with files.atomic_output(path, overwrite=False) as temporary:
            temporary.write_text("ours")
            path.write_text("theirs")
    except FileExistsError as error:
        return path.read_text(), str(path) in str(error)
    return path.read_text(), False


def env_paths_expand_tilde(ctx: Context):
    ctx.monkeypatch.setenv("HOME", str(ctx.tmp))
    ctx.monkeypatch.setenv("RQLIB_CACHE", "~/c")
    ctx.monkeypatch.setenv("RQLIB_RESULTS_DIR", "~/r")
    model = ctx.tiny()
    signature = weight_signature(model)
    table = allocation._cached_path(signature, allocation._base_of(CompressionConfig()))
    return [
        cache_dir(),
        results_module.results_dir(),
        table.parent,
        (Path(models.cache_dir()) / "x").parent,
    ]


def corrupt_codebook(ctx: Context):
    ctx.monkeypatch.setenv("RQLIB_CACHE", str(ctx.tmp))
    first = codebooks._load_or_solve(8, 2, "beta")
    (path,) = (ctx.tmp / "codebooks").glob("*.json")
    path.write_text(path.read_text()[:30])
    ctx.capsys.readouterr()
    second = codebooks._load_or_solve(8, 2, "beta")
    return (
        str(path) in ctx.capsys.readouterr().err,
        bool((first.centroids == second.centroids).all()),
        json.loads(path.read_text())["bits"],
    )


def _tiny_packaged(ctx: Context) -> list:
    """A packaged model whose 'GGUF' is a tiny random Llama with a word-level tokenizer."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import PreTrainedTokenizerFast

    ctx.monkeypatch.setenv("RQLIB_CACHE", str(ctx.tmp))
    entry = models.PackagedModel("tiny-test", "a tiny Llama", lambda workdir: workdir, "tiny")
    ctx.monkeypatch.setitem(models.PACKAGED_MODELS, "tiny-test", entry)
    conversions = []

    def load_gguf(model, workdir):
        conversions.append(model.name)
        words = Tokenizer(tokenizer_models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
        return ctx.tiny(layers=2), tokenizer

    ctx.monkeypatch.setattr(models, "_load_gguf", load_gguf)
    return conversions


def corrupt_converted_model(damage):
    def run(ctx: Context):
        conversions = _tiny_packaged(ctx)
        models.load_model("tiny-test")
        weights = ctx.tmp / "tiny-test" / "model.safetensors"
        damage(weights)
        ctx.capsys.readouterr()
        model, _ = models.load_model("tiny-test")
        message = ctx.capsys.readouterr().err
        return len(conversions), str(ctx.tmp / "tiny-test") in message, type(model).__name__

    return run


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1000])


def _scramble_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = b"#" * 32  # the JSON header of the safetensors file, same size
    path.write_bytes(bytes(data))


# ---- results and sweeps --------------------------------------------------------------------------
PROV = {
    "model": "m",
    "weights": "w",
    "corpus": "c",
    "corpus_sha256": "0" * 64,
    "tokens": 8,
    "device": "cpu",
    "commit": "abc",
    "code": "x",
}


def other_run_same_id(ctx: Context):
    save_result(
        "ch", "r", parameters={"bits": 3}, metrics={"v": 1}, provenance=PROV, directory=ctx.tmp
    )
    save_result(
        "ch", "r", parameters={"bits": 4}, metrics={"v": 2}, provenance=PROV, directory=ctx.tmp
    )


def dirty_run_kept_out_of_commits(ctx: Context):
    dirty = {**PROV, "commit": "abc-dirty"}
    path = save_result(
        "04_perplexity", "r", parameters={}, metrics={"v": 1}, provenance=dirty, directory=ctx.tmp
    )
    relative = f"results/04_perplexity/{path.name}"
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "--no-index", relative], cwd=CHECKOUT, check=False
    ).returncode
    frame = collect("04_perplexity", directory=ctx.tmp)
    return path.name, ignored, bool(frame["prov_dirty"].all()), bool(frame["current"].any())


def truncated_result(ctx: Context):
    good = save_result(
        "ch", "a", parameters={}, metrics={"v": 1}, provenance=PROV, directory=ctx.tmp
    )
    (ctx.tmp / "ch" / "b.json").write_text(good.read_text()[:50])
    with pytest.warns(ResultFileWarning, match=re.escape(str(ctx.tmp / "ch" / "b.json"))):
        frame = collect("ch", directory=ctx.tmp)
    return list(frame["run_id"])


def stale_result(ctx: Context):
    save_result("ch", "a", parameters={}, metrics={"v": 1}, provenance=PROV, directory=ctx.tmp)
    collect("ch", directory=ctx.tmp, current_code_only=True)


def colliding_grid(ctx: Context):
    notebook = _sweep_notebook(ctx.tmp)
    runs = plan_sweep(notebook, {"method": ["a/b", "a_b", "a b"]}, {}, ctx.tmp / "out")
    return [run.run_id for run in runs]


def rerun_with_another_parameters_file(ctx: Context):
    notebook = _sweep_notebook(ctx.tmp)
    first = plan_sweep(notebook, {"method": ["a"]}, {"bits": 2})
    second = plan_sweep(notebook, {"method": ["a"]}, {"bits": 5})
    return first[0].run_id, second[0].run_id


def absolute_corpus_path(ctx: Context):
    provenance(model="m", corpus="/work/shared/data/wiki.test.raw", tokens=1)


def same_text_two_sources(ctx: Context):
    for run, source in (("a", "data/wikitext-2/wiki.test.raw"), ("b", "$RQLIB_WIKITEXT2 (x)")):
        prov = {**PROV, "corpus": source}
        save_result("ch", run, parameters={}, metrics={"v": 1}, provenance=prov, directory=ctx.tmp)
    return common_provenance(collect("ch", directory=ctx.tmp))


def two_texts(ctx: Context):
    for run, digest in (("a", "0" * 64), ("b", "1" * 64)):
        prov = {**PROV, "corpus_sha256": digest}
        save_result("ch", run, parameters={}, metrics={"v": 1}, provenance=prov, directory=ctx.tmp)
    common_provenance(collect("ch", directory=ctx.tmp))


SWEEP_CHAPTER = """
from rqlib.base.corpora import load_corpus
from rqlib.book.provenance import provenance
from rqlib.book.results import save_result
if run_id:
    corpus = load_corpus('wikitext-2')
    prov = provenance(model='none (a test)', corpus=corpus.source,
                      corpus_sha256=corpus.sha256, tokens=len(corpus.text))
    save_result('tiny', run_id, parameters={'bits': bits, 'method': method},
                metrics={'score': bits}, provenance=prov)
"""


def _sweep_notebook(folder: Path) -> Path:
    notebook = nbformat.v4.new_notebook()
    parameters = "# Bits.\nbits = 3\n# Method.\nmethod = 'a'\n# Run id.\nrun_id = ''"
    notebook.cells.append(nbformat.v4.new_code_cell(parameters, metadata={"tags": ["parameters"]}))
    notebook.cells.append(nbformat.v4.new_code_cell(SWEEP_CHAPTER))
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    path = folder / "tiny.ipynb"
    nbformat.write(notebook, path)
    return path


def _clone(tmp: Path) -> Path:
    """A clone of this repository's committed state, in a folder with no ../shared beside it."""
    target = tmp / "elsewhere" / "rqbook"
    subprocess.run(
        ["git", "clone", "--quiet", str(CHECKOUT), str(target)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert not (target.parent / "shared").exists()
    return target


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RQLIB_")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **extra)
    return env


def sweep_from_another_checkout(ctx: Context):
    """A sweep run in another checkout (wikitext from its shipped copy) and one run here
    (wikitext from $RQLIB_WIKITEXT2), then what chapter 5 does with them."""
    clone = _clone(ctx.tmp)
    notebook = _sweep_notebook(ctx.tmp)
    results = ctx.tmp / "results"
    command = [
        sys.executable,
        "-m",
        "rqlib",
        "sweep",
        str(notebook),
        "--output-dir",
        str(ctx.tmp / "executed"),
    ]
    there = _clean_env(PYTHONPATH=str(clone), RQLIB_RESULTS_DIR=str(results))
    subprocess.run(
        [*command, "-p", "bits", "2"],
        cwd=clone,
        env=there,
        check=True,
        capture_output=True,
        timeout=600,
    )
    copy_of_text = ctx.tmp / "wiki.test.raw"
    shutil.copy(clone / "data" / "wikitext-2" / "wiki.test.raw", copy_of_text)
    here = _clean_env(
        PYTHONPATH=str(CHECKOUT), RQLIB_RESULTS_DIR=str(results), RQLIB_WIKITEXT2=str(copy_of_text)
    )
    subprocess.run(
        [*command, "-p", "bits", "3"],
        cwd=CHECKOUT,
        env=here,
        check=True,
        capture_output=True,
        timeout=600,
    )
    frame = collect("tiny", directory=results)
    shared = common_provenance(frame)
    return len(frame), sorted(set(frame["prov_corpus"])), shared["corpus_sha256"]


# ---- the command line ----------------------------------------------------------------------------
_MODELS: dict = {}


def _memo_models(ctx: Context) -> None:
    """The CLI rows load SmolLM2 once (the converted folder is read-only to them)."""
    real = models.load_model

    def load(name, **kwargs):
        key = (name, tuple(sorted(kwargs.items())))
        if key not in _MODELS:
            _MODELS[key] = real(name, **kwargs)
        return _MODELS[key]

    ctx.monkeypatch.setattr(models, "load_model", load)


def cli(*argv: str, needs_model: bool = False, forbid: tuple[str, ...] = ()):
    """Run ``python -m rqlib ARGV`` in-process; ``forbid`` names library functions that must
    not be reached (the long work a check must come before)."""

    def run(ctx: Context):
        if needs_model:
            _memo_models(ctx)
        for dotted in forbid:
            module, name = dotted.rsplit(".", 1)

            def reached(*args, _name=dotted, **kwargs):
                raise AssertionError(f"{_name} ran before the input was checked")

            ctx.monkeypatch.setattr(importlib.import_module(module), name, reached)
        ctx.capsys.readouterr()
        arguments = [a.replace("{tmp}", str(ctx.tmp)) for a in argv]
        try:
            code = main(arguments)
        except SystemExit as exit_:  # argparse's own errors
            code = exit_.code
        return code, ctx.capsys.readouterr().err

    return run


def one_line_error(pattern: str) -> Gives:
    """Exit status 2 and a single error line on stderr matching ``pattern``, no traceback."""

    def check(outcome) -> bool:
        code, err = outcome
        lines = [line for line in err.splitlines() if "error:" in line]
        return (
            code == 2
            and len(lines) == 1
            and re.search(pattern, lines[0]) is not None
            and "Traceback" not in err
        )

    return Gives(f"exit status 2, one line on stderr matching {pattern!r}", check)


def _yaml_file(ctx: Context) -> None:
    (ctx.tmp / "bad.yaml").write_text("model_name: [smollm2\n")
    _sweep_notebook(ctx.tmp)


def cli_after(prepare, runner):
    def run(ctx: Context):
        prepare(ctx)
        return runner(ctx)

    return run


def forced_json(ctx: Context):
    path = ctx.tmp / "out.json"
    path.write_text("an older output")
    code, _ = cli(
        "eval",
        "--tokens",
        "64",
        "--window",
        "32",
        "--json",
        str(path),
        "--force",
        "--no-progress",
        needs_model=True,
    )(ctx)
    payload = json.loads(path.read_text())
    return code, payload["tokens"], payload["corpus"]["source"].startswith("/")


def a_bug_keeps_its_traceback(ctx: Context):
    from rqlib.study import eval as evaluation

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug deep inside")

    ctx.monkeypatch.setattr(evaluation, "evaluate", broken)
    return cli("eval", "--tokens", "64", "--window", "32", needs_model=True)(ctx)


NO_GPU = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


# ---- the table -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    name: str
    run: Callable[[Context], Any]
    expect: Raises | Gives
    marks: tuple = ()


ROWS = [
    # the spec parser: specs mean what they say
    Row(
        "budget with per-layer bits",
        spec_error("turboquant-mse:b3:alloc=3.5:k0=8"),
        Raises(ValueError, r"token 'k0=8'.*cannot honour per-layer bits"),
    ),
    Row(
        "preset with uniform bits",
        spec_error("preset:rq-3.5:k4"),
        Raises(ValueError, r"token 'k4'.*uniform key_bits 4 would be ignored"),
    ),
    Row(
        "budget with exact layers",
        spec_error("turboquant-mse:alloc=3:exact=0"),
        Raises(ValueError, r"token 'exact=0'.*exact layers"),
    ),
    Row(
        "repeated token",
        spec_error("turboquant-mse:k3:k4"),
        Raises(ValueError, r"'k4'.*sets key_bits again \(already set by 'k3'\)"),
    ),
    Row(
        "contradictory tokens",
        spec_error("turboquant-mse:b3:k4"),
        Raises(ValueError, r"already set by 'b3'"),
    ),
    Row(
        "repeated flag",
        spec_error("turboquant-mse:ctr:ctr"),
        Raises(ValueError, r"sets center_keys again"),
    ),
    Row(
        "overlapping layer ranges",
        spec_error("turboquant-mse:k0-3=4:k2=5"),
        Raises(ValueError, r"'k2=5'.*layer 2 again \(already set by 'k0-3=4'\)"),
    ),
    Row(
        "v=fp then v3",
        spec_error("turboquant-mse:v=fp:v3"),
        Raises(ValueError, r"sets value_bits again"),
    ),
    Row(
        "bits out of range",
        spec_error("turboquant-mse:k99"),
        Raises(ValueError, r"token 'k99'.*key_bits must be an int in 1\.\.8"),
    ),
    Row(
        "huge sink",
        spec_error("turboquant-mse:sink99999999999999999999"),
        Raises(ValueError, r"token 'sink9+'.*n_sink must be an int in 0\.\.1048576"),
    ),
    Row(
        "draw beyond 64 bits",
        spec_error("turboquant-mse:draw=18446744073709551616"),
        Raises(ValueError, r"token 'draw=1844.*draw must be an int in 0\.\.4294967295"),
    ),
    Row(
        "huge layer range",
        spec_error("turboquant-mse:k0-99999999=4"),
        Raises(ValueError, r"'k0-99999999=4'.*out of range"),
    ),
    Row(
        "budget nan",
        spec_error("turboquant-mse:alloc=nan"),
        Raises(ValueError, r"'alloc=nan'.*budget must be in \(0, 16\)"),
    ),
    Row(
        "budget overflow",
        spec_error("turboquant-mse:alloc=1e400"),
        Raises(ValueError, r"'alloc=1e400'.*got inf"),
    ),
    Row("empty token", spec_error("turboquant-mse::k3"), Raises(ValueError, r"empty token")),
    Row(
        "huge sketch",
        spec_error("turboquant-prod:k3:m=99999999"),
        Raises(ValueError, r"token 'm=99999999'.*qjl_dim must be an int in 0\.\.65536"),
    ),
    Row(
        "exact layer twice",
        spec_error("turboquant-mse:exact=0,0"),
        Raises(ValueError, r"exact_layers lists a layer twice"),
    ),
    Row(
        "calibration on the evaluation text",
        spec_error("turboquant-mse:ctr:calib=wikitext-2"),
        Raises(ValueError, r"'calib=wikitext-2'.*must not use the evaluation corpus"),
    ),
    Row(
        "a changed config keeps no stale label",
        lambda ctx: CompressionConfig.parse("turboquant-mse:k3").replace(key_bits=4).label,
        Gives("the label of the config that runs", lambda label: label == "turboquant-mse:k4:v=fp"),
    ),
    # the compress() block
    Row(
        "shared config, blocks left out of order",
        out_of_order_exit,
        Gives(
            "the open block decodes with its context; sdpa restored after both",
            lambda r: r == (True, "rqlib", "sdpa"),
        ),
    ),
    Row(
        "exception inside the block",
        exception_in_block,
        Gives("the attention setting restored", lambda impl: impl == "sdpa"),
    ),
    Row(
        "nested block on one model",
        nested_block,
        Raises(RuntimeError, r"already inside a rqlib\.hf\.compress"),
    ),
    Row("cache used after its block", cache_after_its_block, Raises(RuntimeError, r"outside")),
    Row(
        "deep-copied cache used after its block",
        deep_copied_cache,
        Raises(RuntimeError, r"cop(y|ied)|compress"),
    ),
    Row(
        "pickled cache used after its block",
        pickled_cache,
        Raises(RuntimeError, r"cop(y|ied)|compress"),
    ),
    Row(
        "failure in the middle of a forward",
        failure_mid_forward,
        Gives(
            "all layers at one length and the next step exact, or a clear error",
            _consistent_after_failure,
        ),
    ),
    # allocation tables and fingerprints
    Row(
        "truncated cached table",
        truncated_cached_table,
        Gives("named on stderr, measured again, rewritten whole", lambda r: r == (2, True, True)),
    ),
    Row(
        "truncated shipped table",
        truncated_shipped_table,
        Raises(files.CorruptFileError, r"model\.json is corrupt or truncated \(invalid JSON"),
    ),
    Row(
        "impossible budget",
        impossible_budget,
        Raises(ValueError, r"budget 1 bits is below the cheapest allocation"),
    ),
    Row(
        "two processes resolve at once",
        concurrent_resolves,
        Gives("the table measured once, both get the same config", lambda r: r == (1, 2, True)),
    ),
    Row(
        "table measured in fp32, model in bf16",
        table_found_in(torch.bfloat16),
        Gives("the table is found", lambda table: table is not None),
    ),
    Row(
        "table measured in fp32, model in fp16",
        table_found_in(torch.float16),
        Gives("the table is found", lambda table: table is not None),
    ),
    Row(
        "packaged SmolLM2 loaded in bf16",
        packaged_table_in(torch.bfloat16),
        Gives("its shipped table is found", lambda found: found is True),
    ),
    Row(
        "packaged SmolLM2 loaded in fp16",
        packaged_table_in(torch.float16),
        Gives("its shipped table is found", lambda found: found is True),
    ),
    Row(
        "attention weights scaled by 1.001",
        table_after_changed_weights(lambda w: w.mul_(1.001)),
        Gives("the stale table is not used", lambda table: table is None),
    ),
    Row(
        "attention weight rows permuted",
        table_after_changed_weights(lambda w: w.copy_(w.flip(0))),
        Gives("the stale table is not used", lambda table: table is None),
    ),
    # files
    Row(
        "a write that fails half-way",
        failed_write_keeps_the_old_file,
        Gives("the old file intact, no temporary left", lambda r: r == ("old", ["table.json"])),
    ),
    Row(
        "writing over a user's file",
        no_clobber,
        Raises(FileExistsError, r"out\.json exists; refusing to overwrite"),
    ),
    Row(
        "a file appears while writing without overwrite",
        appears_while_writing,
        Gives("the other file kept, FileExistsError naming it", lambda r: r == ("theirs", True)),
    ),
    Row(
        "~ in RQLIB_CACHE and RQLIB_RESULTS_DIR",
        env_paths_expand_tilde,
        Gives(
            "every consumer expands ~ the same way",
            lambda paths: all("~" not in str(p) for p in paths),
        ),
    ),
    Row(
        "truncated codebook cache",
        corrupt_codebook,
        Gives("named on stderr, solved again, rewritten", lambda r: r == (True, True, 2)),
    ),
    Row(
        "truncated converted model",
        corrupt_converted_model(_truncate),
        Gives("named on stderr and converted again", lambda r: r == (2, True, "LlamaForCausalLM")),
    ),
    Row(
        "converted model with a damaged header",
        corrupt_converted_model(_scramble_header),
        Gives("named on stderr and converted again", lambda r: r == (2, True, "LlamaForCausalLM")),
    ),
    # results and sweeps
    Row(
        "another run under an existing run id",
        other_run_same_id,
        Raises(FileExistsError, r"ch/r\.json holds another run.*\['bits'\]"),
    ),
    Row(
        "a run from a dirty tree",
        dirty_run_kept_out_of_commits,
        Gives(
            "saved as r.dirty.json, ignored by git, never current",
            lambda r: r == ("r.dirty.json", 0, True, False),
        ),
    ),
    Row(
        "a truncated results file",
        truncated_result,
        Gives("skipped with a warning naming it", lambda ids: ids == ["a"]),
    ),
    Row(
        "a run of other code where only current code counts",
        stale_result,
        Raises(StaleResultsError, r"(?s)1 of 1 runs were not made at the current code.*/a\.json"),
    ),
    Row(
        "colliding sweep grid",
        colliding_grid,
        Gives("three runs, three ids", lambda ids: len(set(ids)) == 3),
    ),
    Row(
        "a rerun with another parameters file",
        rerun_with_another_parameters_file,
        Gives("another run id (nothing replaced)", lambda ids: ids[0] != ids[1]),
    ),
    Row(
        "an absolute path as the corpus",
        absolute_corpus_path,
        Raises(ValueError, r"must not be an absolute machine path"),
    ),
    Row(
        "one text read from two sources",
        same_text_two_sources,
        Gives(
            "one corpus (compared by sha256)", lambda shared: shared["corpus_sha256"] == "0" * 64
        ),
    ),
    Row(
        "two texts in one chapter",
        two_texts,
        Raises(ValueError, r"the runs mix models, weights or texts"),
    ),
    Row(
        "a sweep from another checkout, then chapter 5",
        sweep_from_another_checkout,
        Gives(
            "two runs, two sources, one corpus by content",
            lambda r: r[0] == 2 and len(r[1]) == 2 and len(r[2]) == 64,
        ),
    ),
    # the command line: one line, exit status 2, before any long work
    Row(
        "eval: --tokens beyond the corpus",
        cli(
            "eval", "--tokens", "99999999", needs_model=True, forbid=("rqlib.study.eval.evaluate",)
        ),
        one_line_error(r"--tokens \(wikitext-2\): the corpus has \d+ tokens"),
    ),
    Row(
        "eval: stride 0",
        cli("eval", "--stride", "0", forbid=("rqlib.hf.models.load_model",)),
        one_line_error(r"stride must be an int in 1\.\.window"),
    ),
    Row(
        "eval: stride beyond the window",
        cli("eval", "--stride", "5000", "--window", "512"),
        one_line_error(r"stride must be an int in 1\.\.window=512"),
    ),
    Row(
        "eval: a device that is not here",
        cli("eval", "--device", NO_GPU, forbid=("rqlib.hf.models.load_model",)),
        one_line_error(r"--device cuda"),
    ),
    Row(
        "eval: not a device",
        cli("eval", "--device", "banana"),
        one_line_error(r"--device banana: not a torch device"),
    ),
    Row(
        "eval: a bad exact= list",
        cli("eval", "--method", "turboquant-mse:k3:exact=a,b"),
        one_line_error(r"'exact=a,b'.*needs an integer"),
    ),
    Row(
        "eval: exact= beyond the model",
        cli(
            "eval",
            "--method",
            "turboquant-mse:k3:exact=0,99",
            needs_model=True,
            forbid=("rqlib.study.eval.evaluate",),
        ),
        one_line_error(r"exact layer 99 is out of range for 30 layers"),
    ),
    Row(
        "eval: an impossible budget",
        cli(
            "eval",
            "--method",
            "turboquant-mse:alloc=0.5",
            needs_model=True,
            forbid=("rqlib.study.allocation.measure_sensitivity",),
        ),
        one_line_error(r"below the cheapest allocation"),
    ),
    Row(
        "eval: --json over an existing file",
        cli_after(
            lambda ctx: (ctx.tmp / "out.json").write_text("mine"),
            cli("eval", "--json", "{tmp}/out.json", forbid=("rqlib.hf.models.load_model",)),
        ),
        one_line_error(r"out\.json exists; refusing to overwrite it \(use --force\)"),
    ),
    Row(
        "eval: --json under a file",
        cli_after(
            lambda ctx: (ctx.tmp / "file").write_text("x"),
            cli("eval", "--json", "{tmp}/file/out.json", forbid=("rqlib.hf.models.load_model",)),
        ),
        one_line_error(r"file is a file, not a folder"),
    ),
    Row(
        "eval: --json is a folder",
        cli("eval", "--json", "{tmp}", forbid=("rqlib.hf.models.load_model",)),
        one_line_error(r"is a folder; give a file name"),
    ),
    Row(
        "eval: a model that does not exist",
        cli("eval", "--model", "{tmp}/no-model"),
        one_line_error(r"cannot load model"),
    ),
    Row(
        "eval: --tokens not a number",
        cli("eval", "--tokens", "x"),
        one_line_error(r"argument --tokens: invalid int value"),
    ),
    Row(
        "sweep: malformed YAML",
        cli_after(_yaml_file, cli("sweep", "{tmp}/tiny.ipynb", "-f", "{tmp}/bad.yaml")),
        one_line_error(r"bad\.yaml is not valid YAML"),
    ),
    Row(
        "sweep: a repeated value",
        cli_after(
            lambda ctx: _sweep_notebook(ctx.tmp),
            cli("sweep", "{tmp}/tiny.ipynb", "-p", "bits", "1", "1"),
        ),
        one_line_error(r"repeats a value"),
    ),
    Row(
        "sweep: no such chapter",
        cli("sweep", "{tmp}/none.ipynb", "-p", "bits", "1"),
        one_line_error(r"none\.ipynb does not exist"),
    ),
    Row(
        "allocate: an impossible budget",
        cli(
            "allocate",
            "--json",
            "{tmp}/t.json",
            "--budget",
            "0.3",
            needs_model=True,
            forbid=("rqlib.study.allocation.measure_sensitivity",),
        ),
        one_line_error(r"budget 0\.3 bits is below the cheapest allocation"),
    ),
    Row(
        "experiment: an unknown preset",
        cli("experiment", "--json", "{tmp}/e.json", "--presets", "rq-9"),
        one_line_error(r"unknown preset 'rq-9'"),
    ),
    Row(
        "bench decode-cpu: an unknown preset",
        cli("bench", "decode-cpu", "--presets", "rq-9", forbid=("rqlib.study.bench.decode_cpu",)),
        one_line_error(r"--presets: unknown preset 'rq-9'"),
    ),
    Row(
        "bench decode-cpu: a preset with a token no spec has",
        cli(
            "bench",
            "decode-cpu",
            "--presets",
            "rq-3:tcq:bogus",
            forbid=("rqlib.study.bench.decode_cpu",),
        ),
        one_line_error(r"--presets: .*'bogus'"),
    ),
    Row(
        "bench gpu: an unknown preset, refused before the missing GPU",
        cli("bench", "gpu", "--presets", "rq-9", forbid=("rqlib.study.gpu_bench.run",)),
        one_line_error(r"--presets: unknown preset 'rq-9'"),
    ),
    Row(
        "bench decode-cpu: batch 0",
        cli("bench", "decode-cpu", "--batch", "0", forbid=("rqlib.study.bench.decode_cpu",)),
        one_line_error(r"--batch must be >= 1"),
    ),
    Row(
        "bench: head_dim 0",
        cli("bench", "kernels", "--head-dim", "0"),
        one_line_error(r"--head-dim must be >= 2"),
    ),
    Row(
        "bench: a bad list of lengths",
        cli("bench", "kernels", "--kv-lens", "1,x"),
        one_line_error(r"invalid comma-separated int list value"),
    ),
    Row(
        "eval: --json over an existing file with --force",
        forced_json,
        Gives("exit 0, the file replaced, no machine path in it", lambda r: r == (0, 64, False)),
    ),
    Row(
        "a bug keeps its traceback",
        a_bug_keeps_its_traceback,
        Raises(ZeroDivisionError, r"a bug deep inside"),
    ),
]


@pytest.fixture
def ctx(tmp_path, rng, monkeypatch, capsys) -> Context:
    return Context(tmp_path, rng, monkeypatch, capsys)


@pytest.mark.parametrize("row", [pytest.param(row, marks=row.marks, id=row.name) for row in ROWS])
def test_bad_input(row: Row, ctx: Context):
    if isinstance(row.expect, Raises):
        with pytest.raises(row.expect.error, match=row.expect.pattern):
            row.run(ctx)
    else:
        outcome = row.run(ctx)
        assert row.expect.check(outcome), f"expected: {row.expect.what}; got {outcome!r}"


def test_the_table_is_large_enough():
    assert len(ROWS) >= 40 and len({row.name for row in ROWS}) == len(ROWS)


def test_a_fresh_clone_loads_the_corpus_offline(tmp_path):
    """A clone alone, with no ../shared beside it, no network and no RQLIB_* variables, loads
    wikitext-2 from its shipped copy with the documented sha256."""
    clone = _clone(tmp_path)
    script = textwrap.dedent(
        """
        import sys
        sys.modules["datasets"] = None  # the hub is not used: importing it would fail
        from rqlib.base.corpora import WIKITEXT2_SHA256, load_corpus
        import rqlib
        corpus = load_corpus("wikitext-2")
        print(rqlib.__file__, corpus.source, corpus.sha256 == WIKITEXT2_SHA256, sep="|")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=clone,
        env=_clean_env(PYTHONPATH=str(clone)),
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout.strip()
    module, source, checked = out.split("|")
    assert Path(module).is_relative_to(clone)
    assert source == "data/wikitext-2/wiki.test.raw (shipped with rqbook)" and checked == "True"
