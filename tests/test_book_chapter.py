"""A chapter's run (rqlib.book.chapter): typed parameters, the cost note, the results file."""

from pathlib import Path

import pytest

from rqlib.book import chapter as chapter_module
from rqlib.book.chapter import Chapter, format_duration, gpu_needs, parameter_specs

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("name", CHAPTERS)
def test_every_parameter_is_typed_and_its_default_fits_its_type(name):
    """`papermill --help-notebook` shows the annotation of each parameter as its type."""
    specs = parameter_specs(name)
    assert "run_id" in specs and specs["run_id"]["type"] == "str"
    for parameter, spec in specs.items():
        chapter_module._check_value(parameter, spec["type"], spec["default"])
        assert spec["help"].strip(), f"{name}: {parameter} has no description"


def namespace(name):
    return {p: spec["default"] for p, spec in parameter_specs(name).items()}


def test_values_are_checked_against_the_annotations():
    check = chapter_module._check_value
    check("n", "int", 3)
    check("x", "float", 3)  # an int is a float
    check("bits", "list[int]", 3)  # one value for a list parameter
    check("bits", "list[int]", [2, 3])
    for kind, value in (("int", True), ("int", "3"), ("list[int]", []), ("list[int]", ["2"])):
        with pytest.raises(TypeError, match=f"must be {kind.replace('[', '.').replace(']', '.')}"):
            check("p", kind, value)
    with pytest.raises(ValueError, match="cannot check"):
        check("p", "dict[str, int]", {})


def test_a_chapter_run_refuses_a_wrong_type_and_a_missing_parameter():
    values = namespace("05_sweeps")
    Chapter("05_sweeps", values)  # the defaults pass
    with pytest.raises(TypeError, match="parameter metric must be str"):
        Chapter("05_sweeps", {**values, "metric": 3})
    del values["metric"]
    with pytest.raises(NameError, match="metric"):
        Chapter("05_sweeps", values)


def test_changed_parameters_and_the_cost_note(monkeypatch):
    glued = {}
    monkeypatch.setattr(chapter_module, "glue_metrics", glued.update)
    run = Chapter("05_sweeps", {**namespace("05_sweeps"), "metric": "kl"})
    assert run.changed() == {"metric": "kl"}

    class Prov:
        device = "cpu (test)"

    assert run.finish(Prov()) is None  # no run_id: nothing saved
    assert glued["run_setting"] == "with metric = 'kl'"
    assert glued["run_device"] == "cpu (test)"
    assert glued["run_time"].endswith(" s")
    assert glued["gpu_needs"] == "It has no GPU parameter file: it needs no GPU."


def test_finish_saves_the_results_file_when_run_id_is_set(monkeypatch, tmp_path):
    from rqlib.book.provenance import provenance

    monkeypatch.setenv("RQLIB_RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(chapter_module, "glue_metrics", lambda values: None)
    run = Chapter("05_sweeps", {**namespace("05_sweeps"), "run_id": "unit"})
    run.metrics.update(n_runs=3, best_value=1.5)
    prov = provenance(model="none (test)", corpus="none (test)", tokens=0)
    path = run.finish(prov)
    # a run from a tree with uncommitted library changes is saved beside, as *.dirty.json
    expected = "unit.dirty.json" if prov.commit.endswith("-dirty") else "unit.json"
    assert path == tmp_path / "05_sweeps" / expected
    from rqlib.book.results import collect

    row = collect("05_sweeps", directory=tmp_path).iloc[0]
    assert row["n_runs"] == 3 and row["metric"] == "delta_ppl_pct" and row["run_seconds"] >= 0


def test_gpu_needs_name_the_hub_model_and_its_memory():
    text = gpu_needs("04_perplexity")
    assert "The GPU parameter file params/04_perplexity-gpu.yaml needs a CUDA GPU" in text
    assert "Qwen/Qwen2.5-3B-Instruct" in text and "GB of GPU memory" in text
    assert "GB for the fp16 keys and values" in gpu_needs("03_kernels")


def test_format_duration():
    assert format_duration(4.4) == "4 s"
    assert format_duration(192.0) == "3 min 12 s"
    with pytest.raises(ValueError):
        format_duration(-1.0)
