"""What is committed under results/ (and the shipped allocation tables) says nothing about the
machine it was made on, the chapter sweeps hold no run from a dirty tree, and chapter 5's sweep
draws every setting more than once."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from rqlib.base.paths import CHECKOUT
from rqlib.book.draws import repeated_draws
from rqlib.book.results import collect

MACHINE_PATH = re.compile(r'"(/(?:work|home|root|tmp|Users|mnt|var)/[^"]*)"')


def tracked(*patterns: str) -> list[Path]:
    listing = subprocess.run(
        ["git", "ls-files", "--", *patterns],
        cwd=CHECKOUT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return [CHECKOUT / name for name in listing]


def test_committed_results_name_no_machine_path():
    paths = tracked("results/*.json", "results/**/*.json", "rqlib/study/allocations/*.json")
    assert paths, "no committed results found"
    found = {
        str(path.relative_to(CHECKOUT)): match.group(1)
        for path in paths
        for match in [MACHINE_PATH.search(path.read_text())]
        if match
    }
    assert not found, f"absolute machine paths in committed results: {found}"


def test_committed_sweeps_hold_no_run_from_a_dirty_tree():
    runs = tracked("results/[0-9][0-9]_*/*.json")  # chapter sweeps: results/<chapter>/
    assert runs, "no committed sweep runs found"
    dirty = [
        str(path.relative_to(CHECKOUT))
        for path in runs
        if str(json.loads(path.read_text())["provenance"].get("commit", "")).endswith("-dirty")
        or path.name.endswith(".dirty.json")
    ]
    assert not dirty, f"runs from a dirty tree are committed: {dirty}"


def test_the_committed_sweep_draws_every_setting_more_than_once():
    """Chapter 5 shows the range of each setting's draws (its noise floor), so the committed
    sweep runs every setting with several seeds, the same number each."""
    runs = collect("04_perplexity")
    keys = ["key_bits", "method", "exact_window"]
    summary = repeated_draws(runs, "delta_ppl_pct", keys, "draw")
    assert summary["n_draws"].min() >= 2, "a setting of the committed sweep was drawn once"
