"""The legend of the spec language and of the ablation levers comes from the code's own
definitions, covers every token the parser reads, and is shown by ``eval --help`` and
chapter 4."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from rqlib.book.legend import legend_text, lever_table, spec_table
from rqlib.cli import main
from rqlib.spec import config
from rqlib.spec.config import SPEC_TOKENS, CompressionConfig
from rqlib.study.experiments import LEVERS

ROOT = Path(__file__).resolve().parent.parent


def test_every_token_the_parser_reads_has_a_description():
    short = set(re.findall(r"\w+", config._SHORT.pattern.split("(")[1]))
    read = set(config._FLAGS) | set(config._KEYED) | short
    read |= {"exact", "alloc", "layer bits", "group bits"}
    assert read - {"d"} == set(SPEC_TOKENS), sorted(read ^ set(SPEC_TOKENS))
    for name, (forms, meaning) in SPEC_TOKENS.items():
        assert forms.strip() and len(meaning.split()) >= 3, name


@pytest.mark.parametrize("name", sorted(SPEC_TOKENS))
def test_every_form_of_the_legend_parses(name):
    """Each example of the legend is a token the parser accepts (``a|b`` forms one by one)."""
    forms, _ = SPEC_TOKENS[name]
    for form in (f.strip() for f in forms.split("|")):
        if name in ("rot", "qjl", "law") and "=" not in form:
            form = f"{name}={form}"
        base = {"k": "turboquant-mse", "b": "turboquant-mse", "v": "turboquant-mse:k3"}.get(
            name, "turboquant-prod:b3" if name in ("qjl", "m") else "turboquant-mse:b3"
        )
        if name in ("wb", "once", "twice"):  # a band's precision or storage needs a band
            base += ":win64"
        if name == "group bits":  # the widths of the groups of the transforms
            base += ":kxf:vxf"
        if name == "tb":  # a reading of the trellis needs the trellis
            base += ":tcq"
        CompressionConfig.parse(f"{base}:{form}")


def test_the_legend_shows_every_token_lever_and_preset(capsys):
    text = legend_text()
    for forms, meaning in SPEC_TOKENS.values():
        assert forms in text and meaning.split()[0] in text
    for name, lever in LEVERS.items():
        assert f"{name} ({lever.change})" in text
    assert len(spec_table()) == len(SPEC_TOKENS) and len(lever_table()) == len(LEVERS)
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    helped = capsys.readouterr().out
    assert text in helped
    chapter = nbformat.read(ROOT / "notebooks" / "04_perplexity.ipynb", as_version=4)
    code = "\n".join(c.source for c in chapter.cells if c.cell_type == "code")
    assert "legend.spec_table()" in code and "legend.lever_table()" in code
