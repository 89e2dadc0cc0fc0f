"""rqlib.book.bookcache: new results re-execute the chapters that read them.

A tiny Sphinx project with myst-nb in cache mode (as the book builds) and one chapter that
prints a number read from a results file: without the extension, a changed results file
leaves the old number on the page (the defect); with it, the chapter runs again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from rqlib.book import bookcache

ROOT = Path(__file__).resolve().parent.parent

CHAPTER = (
    "import json, os, pathlib\n"
    "path = pathlib.Path(os.environ['RQLIB_RESULTS_DIR']) / 'ch' / 'run.json'\n"
    "print('VAL' + 'UE', json.loads(path.read_text())['value'])"
)


def _project(tmp_path, with_extension: bool):
    source = tmp_path / "src"
    source.mkdir(exist_ok=True)
    extensions = ["myst_nb"] + (["rqlib.book.bookcache"] if with_extension else [])
    (source / "conf.py").write_text(
        f"extensions = {extensions!r}\n"
        "nb_execution_mode = 'cache'\n"
        f"nb_execution_cache_path = {str(tmp_path / 'jcache')!r}\n"
        "rqlib_chapter_inputs = {'ch': ('ch/*.json',)}\n"
        "exclude_patterns = ['_build']\n"
    )
    (source / "index.md").write_text("# Book\n\n```{toctree}\nch\n```\n")
    notebook = nbformat.v4.new_notebook()
    notebook.cells.append(nbformat.v4.new_markdown_cell("# Chapter"))
    notebook.cells.append(nbformat.v4.new_code_cell(CHAPTER))
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(notebook, source / "ch.ipynb")
    return source


def _build(tmp_path, source, value: int) -> str:
    results = tmp_path / "results" / "ch"
    results.mkdir(parents=True, exist_ok=True)
    (results / "run.json").write_text(json.dumps({"value": value}))
    env = {**os.environ, "RQLIB_RESULTS_DIR": str(tmp_path / "results")}
    out = tmp_path / "html"
    subprocess.run(
        [sys.executable, "-m", "sphinx", "-b", "html", "-q", str(source), str(out)],
        check=True,
        env=env,
        capture_output=True,
        timeout=600,
    )
    html = (out / "ch.html").read_text()
    return next(line for line in html.splitlines() if "VALUE " in line)  # the output


@pytest.mark.parametrize("with_extension", [False, True])
def test_new_results_re_execute_the_chapter_that_reads_them(tmp_path, with_extension):
    source = _project(tmp_path, with_extension)
    assert "VALUE 1" in _build(tmp_path, source, 1)
    shown = _build(tmp_path, source, 2)  # same chapter code, new results
    if with_extension:
        assert "VALUE 2" in shown
    else:  # the defect this extension fixes: the cache keys on the code cells only
        assert "VALUE 1" in shown


def test_invalidate_names_the_chapters_whose_inputs_changed(tmp_path, monkeypatch):
    results = tmp_path / "results"
    (results / "a").mkdir(parents=True)
    (results / "a" / "x.json").write_text("1")
    chapters = {"reads-a": ("a/*.json",), "reads-nothing": ()}
    cache = tmp_path / "cache"
    assert bookcache.invalidate(cache, chapters, results) == ["reads-a", "reads-nothing"]
    assert bookcache.invalidate(cache, chapters, results) == []  # nothing changed
    (results / "a" / "y.json").write_text("2")  # a new results file
    assert bookcache.invalidate(cache, chapters, results) == ["reads-a"]
    (results / "a" / "x.json").write_text("3")  # a changed one
    assert bookcache.invalidate(cache, chapters, results) == ["reads-a"]
    # a change of the library's code re-executes every chapter
    monkeypatch.setattr(bookcache, "code_fingerprint", lambda: "another code state")
    assert bookcache.invalidate(cache, chapters, results) == ["reads-a", "reads-nothing"]


def test_every_committed_file_is_an_input_of_chapter_4():
    """A committed file chapter 4 reads (rqlib.book.loaders.COMMITTED) that its input globs
    miss would leave the chapter showing its previous numbers after the file changes."""
    from fnmatch import fnmatch

    from rqlib.book.bookcache import CHAPTER_INPUTS
    from rqlib.book.loaders import COMMITTED

    patterns = CHAPTER_INPUTS["04_perplexity"]
    # a glob's "*" does not cross "/" in Path.glob: compare folder by folder
    missed = [
        name
        for name in COMMITTED
        if not any(fnmatch(name, p) and name.count("/") == p.count("/") for p in patterns)
    ]
    assert not missed, missed


def test_every_results_glob_of_a_chapter_is_one_of_its_inputs():
    """A chapter that globs results files its inputs miss (``eval-band-once-*`` once was) would
    keep showing its previous numbers after such a file changes. Every ``glob("...")`` in a
    chapter's code must fall under one of its input patterns (a pattern matches a glob when it
    matches the glob's text as a name: ``eval-trellis-*.json`` covers ``eval-trellis-window-*``).
    """
    import re
    from fnmatch import fnmatch

    from rqlib.book.bookcache import CHAPTER_INPUTS

    missed = []
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = nbformat.read(notebook, as_version=4).cells
        code = "\n".join(c.source for c in cells if c.cell_type == "code")
        for pattern in re.findall(r"\.glob\(\"([^\"]+)\"\)", code):
            inputs = CHAPTER_INPUTS.get(notebook.stem, ())
            if not any(fnmatch(pattern, p) for p in inputs):
                missed.append(f"{notebook.name}: {pattern}")
    assert not missed, missed
