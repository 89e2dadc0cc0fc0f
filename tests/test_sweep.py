"""rqlib.book.sweep: papermill over a grid, with the parameters checked before anything runs."""

import json

import nbformat
import pytest

from rqlib.__main__ import main
from rqlib.book.results import collect
from rqlib.book.sweep import parse_value, plan_sweep, run_id_for

TINY_CHAPTER = [
    ("markdown", "# A tiny chapter", []),
    (
        "code",
        "# Bits per coordinate.\nbits = 3\n# Method name.\nmethod = 'a'\n"
        "# Name of this run's results file; empty: save nothing.\nrun_id = ''",
        ["parameters"],
    ),
    (
        "code",
        "from rqlib.book.results import save_result\n"
        "if method == 'broken':\n    raise RuntimeError('this combination fails on purpose')\n"
        "if run_id:\n"
        "    save_result('tiny', run_id, parameters={'bits': bits, 'method': method},\n"
        "                metrics={'score': bits * 10 + len(method)},\n"
        "                provenance={'commit': 'test', 'model': 'none'})",
        [],
    ),
]


def write_notebook(path, cells):
    notebook = nbformat.v4.new_notebook()
    for kind, source, tags in cells:
        make = nbformat.v4.new_code_cell if kind == "code" else nbformat.v4.new_markdown_cell
        notebook.cells.append(make(source, metadata={"tags": tags}))
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    notebook.metadata["language_info"] = {"name": "python"}
    nbformat.write(notebook, path)
    return path


@pytest.fixture
def tiny(tmp_path):
    return write_notebook(tmp_path / "tiny.ipynb", TINY_CHAPTER)


def test_values_are_yaml_scalars():
    assert parse_value("3") == 3 and parse_value("0.5") == 0.5 and parse_value("true") is True
    assert parse_value("turboquant-mse") == "turboquant-mse"
    assert parse_value("[1") == "[1"  # not valid YAML: kept as the string typed
    assert parse_value("a: b") == "a: b"  # a mapping is not a scalar: kept as typed


def test_plan_lists_the_product_with_distinct_run_ids(tiny, tmp_path):
    runs = plan_sweep(tiny, {"bits": [2, 3, 4], "method": ["a", "b"]}, {}, tmp_path / "out")
    assert len(runs) == 6
    assert len({run.run_id for run in runs}) == 6
    first = runs[0]
    stem = "bits=2+method=a-"
    assert first.run_id.startswith(stem) and len(first.run_id) == len(stem) + 10
    assert first.parameters == {"bits": 2, "method": "a", "run_id": first.run_id}
    assert first.output_notebook == tmp_path / "out" / f"{first.run_id}.ipynb"
    # the readable stem sanitizes, the hash keeps apart what sanitizing merges
    ids = [run_id_for({"m": value}) for value in ("a/b", "a_b", "a b", "a\\b")]
    assert all(i.startswith("m=a_b-") for i in ids) and len(set(ids)) == 4
    # the hash covers every parameter, typed: -f values and value types count
    assert run_id_for({"m": "a"}, {"m": "a", "bits": 3}) != run_id_for({"m": "a"}, {"m": "a"})
    assert run_id_for({"bits": 3}) != run_id_for({"bits": "3"})


def test_run_ids_cover_the_parameters_file_and_the_chapter_defaults(tiny, tmp_path):
    grid = {"method": ["a"]}
    plain = plan_sweep(tiny, grid, {}, tmp_path)
    with_file = plan_sweep(tiny, grid, {"bits": 5}, tmp_path)
    assert plain[0].run_id != with_file[0].run_id
    assert plan_sweep(tiny, grid, {}, tmp_path)[0].run_id == plain[0].run_id  # deterministic
    # a chapter whose default changed gets other ids: its old runs are not replaced
    changed = write_notebook(
        tmp_path / "tiny.ipynb",
        [
            (kind, source.replace("bits = 3", "bits = 4"), tags)
            for kind, source, tags in TINY_CHAPTER
        ],
    )
    assert plan_sweep(changed, grid, {}, tmp_path)[0].run_id != plain[0].run_id


@pytest.mark.parametrize(
    "grid, fixed, match",
    [
        ({"bitz": [1]}, {}, r"unknown parameter\(s\) \['bitz'\].*bits, method, run_id"),
        ({}, {"metod": "a"}, r"unknown parameter\(s\) \['metod'\] \(params file\)"),
        ({"run_id": ["x"]}, {}, "set by the sweep"),
        ({"bits": []}, {}, "no values"),
        ({"bits": [1, 1]}, {}, "repeats"),
    ],
)
def test_plan_refuses_bad_grids(tiny, grid, fixed, match):
    with pytest.raises(ValueError, match=match):
        plan_sweep(tiny, grid, fixed)


def test_notebooks_that_cannot_be_swept(tmp_path):
    no_parameters = write_notebook(tmp_path / "a.ipynb", [("code", "x = 1", [])])
    with pytest.raises(ValueError, match="no cell tagged 'parameters'"):
        plan_sweep(no_parameters, {}, {})
    no_run_id = write_notebook(tmp_path / "b.ipynb", [("code", "# x\nx = 1", ["parameters"])])
    with pytest.raises(ValueError, match="no 'run_id' parameter"):
        plan_sweep(no_run_id, {}, {})
    with pytest.raises(FileNotFoundError):
        plan_sweep(tmp_path / "missing.ipynb", {}, {})


def test_command_line_error_names_the_parameter(tiny, capsys):
    assert main(["sweep", str(tiny), "-p", "bitz", "1", "2"]) == 2
    assert "unknown parameter(s) ['bitz']" in capsys.readouterr().err
    assert main(["sweep", str(tiny), "-p", "bits"]) == 2
    assert "needs at least one value" in capsys.readouterr().err


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_sweep_runs_every_combination_and_reports_failures(
    tiny, tmp_path, monkeypatch, capsys, jobs
):
    """End to end with real papermill kernels: two runs succeed, one fails on purpose."""
    monkeypatch.setenv("RQLIB_RESULTS_DIR", str(tmp_path / "results"))
    params = tmp_path / "fixed.yaml"
    params.write_text("bits: 5\n")
    code = main(
        [
            "sweep",
            str(tiny),
            "-f",
            str(params),
            "-p",
            "method",
            "a",
            "bb",
            "broken",
            "--output-dir",
            str(tmp_path / "executed"),
            "--jobs",
            jobs,
        ]
    )
    assert code == 1  # one run failed
    captured = capsys.readouterr()
    assert "2/3 runs succeeded" in captured.out
    assert "FAILED method=broken" in captured.err
    frame = collect("tiny").sort_values("method")
    assert list(frame["method"]) == ["a", "bb"]
    assert list(frame["bits"]) == [5, 5]  # from the parameters file
    assert list(frame["score"]) == [51, 52]  # computed by the notebook from its parameters
    runs = {
        run.parameters["method"]: run
        for run in plan_sweep(tiny, {"method": ["a", "bb", "broken"]}, {"bits": 5})
    }
    executed = sorted(p.name for p in (tmp_path / "executed").iterdir())
    assert executed == sorted(f"{run.run_id}.ipynb" for run in runs.values())
    record = json.loads((tmp_path / "results" / "tiny" / f"{runs['a'].run_id}.json").read_text())
    assert record["parameters"] == {"bits": 5, "method": "a"}
    # every run's state, read back from the sweep's folder as for a Slurm sweep
    assert main(["sweep", "--status", str(tmp_path / "results")]) == 0
    status = capsys.readouterr().out
    assert status.splitlines()[-1] == "0 queued, 0 running, 2 done, 1 failed"
    broken = next(line for line in status.splitlines() if line.startswith("method=broken"))
    assert "failed  local:" in broken
    assert "RuntimeError: this combination fails on purpose" in broken
