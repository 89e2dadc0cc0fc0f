"""A sweep never touches the committed results, and chapter 5 draws either them or a sweep's.

The end-to-end test runs the README's sweep command on the smallest grid chapter 4 accepts
(one bit width, the README's two methods, 64 tokens in one window) into a folder of its own,
then executes chapter 5 from that folder (``pytest --nbmake notebooks``, run by ``make test``,
executes it from the committed results). Chapter 5 plots only runs made at the current code
from a clean tree, so, like ``pytest --nbmake notebooks``, this test passes on a clean checkout
whose committed sweep is current (what CI runs), and fails in a tree with uncommitted library
or chapter changes.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import papermill
import pytest
from test_book_commands import printed_commands

from rqlib.book.bookcache import CHAPTER_INPUTS, inputs_digest
from rqlib.book.sweep import (
    RunBusyError,
    _run_lock,
    execute_and_record,
    plan_sweep,
    records_dir,
    sweep_results_dir,
)

ROOT = Path(__file__).resolve().parent.parent
#: The README's cluster sweep status table and the committed file the run wrote.
STATUS_FILE = ROOT / "results" / "cluster-sweep" / "after-resume.txt"


def readme_sweep() -> list[str]:
    """The words of the README's sweep command (the first ``python -m rqlib sweep``)."""
    for command in printed_commands(ROOT / "README.md"):
        words = shlex.split(command)
        if words[1:4] == ["-m", "rqlib", "sweep"] and words[4].endswith(".ipynb"):
            return words
    raise AssertionError("the README prints no sweep of a chapter")


def committed_files() -> dict[str, float]:
    """Every file under results/ with its modification time."""
    return {
        str(path.relative_to(ROOT)): path.stat().st_mtime
        for path in (ROOT / "results").rglob("*")
        if path.is_file()
    }


def test_the_readme_sweep_writes_elsewhere_and_chapter_5_draws_either(tmp_path, monkeypatch):
    monkeypatch.delenv("RQLIB_RESULTS_DIR", raising=False)
    words = readme_sweep()
    grid_start = words.index("-p")
    tiny = [*words[1:grid_start], "-p", "key_bits", "2"]  # the README's file, one bit width
    after = words[words.index("method") + 1 :]
    methods = after[: next((i for i, w in enumerate(after) if w.startswith("-")), len(after))]
    tiny += ["-p", "method", *methods, "-p", "tokens", "64", "-p", "window", "64"]
    sweep = tmp_path / "sweep"
    before = committed_files()
    done = subprocess.run(
        [sys.executable, *tiny, "--results-dir", str(sweep)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert committed_files() == before  # nothing under results/ written or touched
    written = sorted(sweep.glob("04_perplexity/*.json"))
    assert len(written) == len(methods)
    out = tmp_path / "05-sweep.ipynb"
    papermill.execute_notebook(
        str(ROOT / "notebooks" / "05_sweeps.ipynb"),
        str(out),
        parameters={"results_dir": str(sweep)},
        cwd=str(ROOT / "notebooks"),
        progress_bar=False,
    )
    # the page drawn from the sweep counted its runs, not the committed ones
    glued = json.loads(out.read_text())
    texts = [
        "".join(text)
        for cell in glued["cells"]
        for o in cell.get("outputs", [])
        if o.get("metadata", {}).get("scrapbook", {}).get("name") == "n_runs"
        for key, text in o["data"].items()
        if key.endswith("text/plain")
    ]
    assert texts == [str(len(methods))]


def test_a_sweep_writes_into_results_only_when_asked(monkeypatch, tmp_path):
    monkeypatch.delenv("RQLIB_RESULTS_DIR", raising=False)
    assert sweep_results_dir() == ROOT / "sweeps"
    assert sweep_results_dir(tmp_path) == tmp_path
    assert sweep_results_dir(into_committed=True) == ROOT / "results"
    with pytest.raises(ValueError, match="only with --into-committed-results"):
        sweep_results_dir(ROOT / "results")
    monkeypatch.setenv("RQLIB_RESULTS_DIR", str(ROOT / "results"))
    with pytest.raises(ValueError, match="only with --into-committed-results"):
        sweep_results_dir()
    monkeypatch.setenv("RQLIB_RESULTS_DIR", str(tmp_path))
    assert sweep_results_dir() == tmp_path
    with pytest.raises(ValueError, match="name one folder"):
        sweep_results_dir(into_committed=True)
    assert "sweeps/" in (ROOT / ".gitignore").read_text().splitlines()


def test_results_a_sweep_writes_rerun_only_the_chapters_that_read_them(tmp_path):
    """Chapters 1-3 read no results: their cache key ignores what a sweep writes."""
    results = tmp_path / "results"
    (results / "04_perplexity").mkdir(parents=True)
    chapters = ("01_derivation", "02_depth", "03_kernels", "04_perplexity", "05_sweeps")
    before = {name: inputs_digest(CHAPTER_INPUTS.get(name, ()), results) for name in chapters}
    (results / "04_perplexity" / "run.json").write_text("{}")
    after = {name: inputs_digest(CHAPTER_INPUTS.get(name, ()), results) for name in chapters}
    changed = {name for name in chapters if before[name] != after[name]}
    assert "05_sweeps" in changed  # it plots the sweep (chapter 4 quotes its draws too)
    assert not changed & {"01_derivation", "02_depth", "03_kernels"}


def test_a_run_never_executes_twice_at_once(tmp_path):
    """A second execution of a run that holds its lock is refused before it starts."""
    notebook = ROOT / "notebooks" / "04_perplexity.ipynb"
    (run,) = plan_sweep(notebook, {"key_bits": [2]}, {}, None, tmp_path)
    records = records_dir(tmp_path, "04_perplexity")
    with _run_lock(records, run.run_id), pytest.raises(RunBusyError, match=r"\.lock is locked"):
        execute_and_record(notebook, run, tmp_path)
    assert not (tmp_path / "04_perplexity").exists()


def test_the_readme_shows_the_status_table_the_cluster_run_wrote():
    readme = (ROOT / "README.md").read_text()
    table = STATUS_FILE.read_text().strip()
    assert table in readme, f"README's --status table differs from {STATUS_FILE.name}"
    assert " done " in table and "job" in table.splitlines()[0]
