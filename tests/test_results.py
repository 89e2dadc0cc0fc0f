"""rqlib.book.results: one JSON per run written by save_result, gathered back by collect.

Random values (``rng``) are written and read back exactly: no test here fails by chance.
"""

import json
import math

import pandas as pd
import pytest
import torch

from rqlib.book.results import (
    PROVENANCE_COLUMNS,
    ResultFileWarning,
    StaleResultsError,
    _Text,
    collect,
    save_result,
)

PROVENANCE = {
    "model": "m",
    "corpus": "c",
    "corpus_sha256": "0" * 64,
    "tokens": 12,
    "device": "cpu",
    "commit": "abc",
}


def test_save_and_collect_round_trip(tmp_path, rng):
    runs = {}
    for i in range(3):
        bits = int(torch.randint(1, 9, (1,), generator=rng))
        value = torch.rand((), generator=rng)  # a 0-d tensor: stored as a Python float
        path = save_result(
            "ch",
            f"run{i}",
            parameters={"bits": bits, "method": f"m{i}", "grid": [1, 2]},
            metrics={"kl": value, "label": "x"},
            provenance=PROVENANCE,
            directory=tmp_path,
        )
        assert path == tmp_path / "ch" / f"run{i}.json"
        runs[f"run{i}"] = (bits, value.item())
    frame = collect("ch", directory=tmp_path)
    assert sorted(frame["run_id"]) == sorted(runs)
    for _, row in frame.iterrows():
        bits, value = runs[row["run_id"]]
        assert row["bits"] == bits
        # float32 -> Python float -> JSON text -> float: exact, since repr round-trips
        assert row["kl"] == value
    for key in PROVENANCE_COLUMNS:
        assert f"prov_{key}" in frame.columns
    assert set(frame["prov_commit"]) == {"abc"}


def test_collect_all_chapters_and_tables(tmp_path, rng):
    table = pd.DataFrame({"layer": range(4), "kl": torch.rand(4, generator=rng).numpy()})
    save_result(
        "a", "r", parameters={}, metrics={"v": 1}, provenance=PROVENANCE, directory=tmp_path
    )
    save_result(
        "b",
        "r",
        parameters={},
        metrics={"v": 2},
        provenance=PROVENANCE,
        tables={"per_layer": table},
        directory=tmp_path,
    )
    frame = collect(directory=tmp_path)
    assert sorted(frame["chapter"]) == ["a", "b"]
    record = json.loads((tmp_path / "b" / "r.json").read_text())
    assert record["tables"] == {"per_layer": "r.per_layer.parquet"}
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "b" / "r.per_layer.parquet"), table)


def test_non_finite_metrics_are_written_as_words(tmp_path):
    save_result(
        "c",
        "r",
        parameters={},
        metrics={"nan": math.nan, "inf": math.inf},
        provenance=PROVENANCE,
        directory=tmp_path,
    )
    record = json.loads((tmp_path / "c" / "r.json").read_text())  # strict JSON, no NaN literal
    assert record["metrics"] == {"nan": "nan", "inf": "inf"}


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"run_id": "../escape"}, ValueError, "run_id"),
        ({"run_id": ""}, ValueError, "run_id"),
        ({"chapter": "a/b"}, ValueError, "chapter"),
        ({"metrics": {"bits": 1}}, ValueError, "share the names"),
        ({"metrics": {"v": [1, 2]}}, TypeError, "scalar"),
        ({"metrics": {"v": object()}}, TypeError, "object"),
        ({"provenance": {"model": "m"}}, TypeError, "provenance"),
        ({"tables": {"t": [1, 2]}}, TypeError, "DataFrame"),
    ],
)
def test_save_result_refuses_bad_input(tmp_path, kwargs, error, match):
    arguments = {
        "chapter": "ch",
        "run_id": "r",
        "parameters": {"bits": 3},
        "metrics": {"v": 1.0},
        "provenance": PROVENANCE,
        "directory": tmp_path,
    }
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        save_result(arguments.pop("chapter"), arguments.pop("run_id"), **arguments)


def test_collect_without_results_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results"):
        collect("nothing", directory=tmp_path)


def test_collect_skips_and_names_foreign_and_truncated_files(tmp_path):
    (tmp_path / "ch").mkdir()
    foreign = tmp_path / "ch" / "x.json"
    foreign.write_text('{"a": 1}')
    with pytest.warns(ResultFileWarning, match=rf"{foreign}: not a rqlib result"):
        with pytest.raises(FileNotFoundError, match="no readable results"):
            collect("ch", directory=tmp_path)
    good = save_result(
        "ch", "r", parameters={}, metrics={"v": 1}, provenance=PROVENANCE, directory=tmp_path
    )
    truncated = tmp_path / "ch" / "t.json"
    truncated.write_text(good.read_text()[:40])
    with pytest.warns(ResultFileWarning) as caught:
        frame = collect("ch", directory=tmp_path)
    assert list(frame["run_id"]) == ["r"]
    assert sorted(str(w.message).split(":")[0] for w in caught) == sorted(
        [f"skipped {foreign}", f"skipped {truncated}"]
    )
    assert [s["path"] for s in frame.attrs["skipped"]] == [str(truncated), str(foreign)]


def test_results_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RQLIB_RESULTS_DIR", str(tmp_path))
    save_result("ch", "r", parameters={}, metrics={"v": 1}, provenance=PROVENANCE)
    assert (tmp_path / "ch" / "r.json").is_file()
    assert len(collect("ch")) == 1


def test_glued_strings_have_no_quotes():
    assert repr(_Text("key_bits = 3")) == "key_bits = 3"


def test_current_means_this_code_and_chapter_from_a_clean_tree(tmp_path, monkeypatch):
    from rqlib.book import results
    from rqlib.book.provenance import code_fingerprint

    monkeypatch.setattr(results, "_chapter_notebook", lambda chapter: tmp_path / "none.ipynb")
    now = {**PROVENANCE, "code": code_fingerprint(), "chapter_code": "no notebook"}
    cases = {
        "current": now,
        "other-code": {**now, "code": "0" * 16},
        "other-chapter": {**now, "chapter_code": "1" * 16},
        "dirty": {**now, "commit": "abc-dirty"},
        "older": {k: v for k, v in PROVENANCE.items()},  # no fingerprints at all
    }
    for run_id, prov in cases.items():
        save_result(
            "ch", run_id, parameters={}, metrics={"v": 1}, provenance=prov, directory=tmp_path
        )
    frame = collect("ch", directory=tmp_path).set_index("run_id")
    assert frame["current"].to_dict() == {name: name == "current" for name in cases}
    with pytest.raises(StaleResultsError) as refused:
        collect("ch", directory=tmp_path, current_code_only=True)
    for name in cases:
        assert (
            f"{name}.json" in str(refused.value) or f"{name}.dirty.json" in str(refused.value)
        ) == (name != "current")
    for path in tmp_path.glob("ch/*.json"):
        if not path.name.startswith("current"):
            path.unlink()
    assert list(collect("ch", directory=tmp_path, current_code_only=True)["run_id"]) == ["current"]


def test_a_clean_rerun_replaces_the_dirty_run_and_its_tables(tmp_path, rng):
    table = pd.DataFrame({"x": torch.rand(3, generator=rng).numpy()})
    dirty = {**PROVENANCE, "commit": "abc-dirty"}
    save_result(
        "ch",
        "r",
        parameters={},
        metrics={"v": 1},
        provenance=dirty,
        tables={"t": table},
        directory=tmp_path,
    )
    assert sorted(p.name for p in (tmp_path / "ch").iterdir()) == [
        "r.dirty.json",
        "r.dirty.t.parquet",
    ]
    save_result(
        "ch",
        "r",
        parameters={},
        metrics={"v": 2},
        provenance=PROVENANCE,
        tables={"t": table},
        directory=tmp_path,
    )
    assert sorted(p.name for p in (tmp_path / "ch").iterdir()) == ["r.json", "r.t.parquet"]
