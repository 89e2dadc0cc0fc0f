"""What is committed under results/ (and the shipped allocation tables) says nothing about the
machine it was made on, every run of rqlib's caches is what its label resolves to today (so a
changed preset or token cannot leave old numbers under its name), the chapter sweeps hold no
run from a dirty tree, and chapter 5's sweep draws every setting more than once."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from rqlib.base.paths import CHECKOUT
from rqlib.book.draws import repeated_draws
from rqlib.book.labels import READ_BY_SPEC, label_mismatches
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


def test_every_committed_run_is_what_its_label_says_today():
    chapter_sweep = re.compile(r"\d\d_")  # results/<chapter>/: a sweep's runs, no labels
    paths = [
        p
        for p in tracked("results/*.json")
        if not chapter_sweep.match(p.parent.name) and p.name not in READ_BY_SPEC
    ]
    assert paths, "no committed results found"
    problems = [line for path in paths for line in label_mismatches(path)]
    assert not problems, "committed runs whose label now gives another config (rerun them):\n" + (
        "\n".join(problems)
    )


def test_the_files_left_out_of_the_label_check_are_read_by_config_only():
    """The check above leaves out READ_BY_SPEC. That is safe only while the one cell that reads
    them is chapter 6's pairing of the first CPU's runs with the second's by the config each
    recorded: no other cell of any chapter may name them."""
    for name in READ_BY_SPEC:
        naming = [
            (path.name, "first_cpu_files = {" in source)
            for path in tracked("notebooks/*.ipynb")
            for cell in json.loads(path.read_text())["cells"]
            for source in ["".join(cell["source"])]
            if name in source
        ]
        assert naming == [("06_bound.ipynb", True)], f"cells naming {name}: {naming}"


def test_a_run_its_label_no_longer_gives_is_named(monkeypatch, tmp_path):
    """The check above can fail: with rq-3 storing its band the other way (once where it
    stores it twice, twice where once), the committed run of ``preset:rq-3`` is named, and so
    is a run whose recorded per-layer bits are not the allocation of its budget."""
    from rqlib.spec import presets

    path = CHECKOUT / "results" / "headline" / "smollm2-prefill-w1024.json"
    assert label_mismatches(path) == []
    tokens = presets.PRESETS["rq-3"].split(":")
    once = "once" in tokens
    other_way = [t for t in tokens if t != "once"] if once else [*tokens, "once"]
    with monkeypatch.context() as patched:
        patched.setitem(presets.PRESETS, "rq-3", ":".join(other_way))
        (line,) = label_mismatches(path)
    assert line.startswith(f"{path.name}: preset:rq-3: ")
    assert f"band_once is {once}, the label gives {not once}" in line

    payload = json.loads(path.read_text())
    (run,) = [r for r in payload["results"] if r["label"] == "preset:rq-3.5"]
    layer, bits = run["config"]["layer_key_bits"][0]
    run["config"]["layer_key_bits"][0] = [layer, bits + 1]
    changed = tmp_path / path.name
    changed.write_text(json.dumps(payload))
    (line,) = label_mismatches(changed)
    assert line.startswith(f"{path.name}: preset:rq-3.5: layer_key_bits is ")


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
