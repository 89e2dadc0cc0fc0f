"""What a user reads or types names the random choice of rotations and sketches a *draw* (the
glossary's word), never a seed: the command line's help, the spec language, the config's
fields, and the committed results (file names, keys, recorded commands). The book's pages are
held to the same words by ``test_notebooks.test_no_history_words_in_the_book``."""

import contextlib
import dataclasses
import io
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from test_notebooks import HISTORY

from rqlib import cli
from rqlib.spec.config import SPEC_TOKENS, CompressionConfig

ROOT = Path(__file__).resolve().parent.parent


def command_helps() -> dict[str, str]:
    """What ``python -m rqlib --help`` and every ``python -m rqlib COMMAND --help`` print."""
    helps = {}
    for argv in (["--help"], *([name, "--help"] for name in cli.COMMANDS)):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 0, argv
        helps["python -m rqlib " + " ".join(argv)] = printed.getvalue()
    return helps


def spec_language() -> dict[str, str]:
    """Every spec token's name, forms and description, and the config's field names."""
    texts = {
        f"spec token {name!r}": " ".join([name, *entry]) for name, entry in SPEC_TOKENS.items()
    }
    fields = " ".join(
        field.name.replace("_", " ") for field in dataclasses.fields(CompressionConfig)
    )
    return texts | {"CompressionConfig's fields": fields}


def committed_results() -> dict[str, str]:
    """The committed results' file names, the text of every text file among them, and the
    column names of every table."""
    names = subprocess.run(
        ["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    texts = {
        "the results' file names": " ".join(n.replace("+", " ").replace("=", " ") for n in names)
    }
    for name in names:
        path = ROOT / name
        if path.suffix in (".json", ".txt", ".md"):
            texts[name] = path.read_text().replace("_", " ")
        elif path.suffix == ".parquet":
            texts[name] = " ".join(str(c).replace("_", " ") for c in pd.read_parquet(path).columns)
    return texts


@pytest.mark.parametrize("surface", [command_helps, spec_language, committed_results])
def test_what_a_user_reads_or_types_says_draw(surface):
    for where, text in surface().items():
        found = HISTORY.findall(text)
        assert not found, f"{where} shows history words {sorted(set(found))}"


def test_the_check_catches_the_word_where_a_user_would_meet_it():
    """The pattern finds the word as a spec token, a parameter, a file name and in prose, and
    leaves torch's ``manual_seed`` (an API name, not ours) alone."""
    for text in ("turboquant-mse:k3:seed=2", "-p seed 0 1 2", "key bits 2 seed 0", "three seeds"):
        assert HISTORY.search(text), text
    assert not HISTORY.search("torch.Generator().manual_seed(draw)")
