"""Cheap static checks on the chapters (executing them is the book build's and nbmake's job)."""

import ast
from pathlib import Path

import nbformat
import papermill
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PARAMS_FILES = sorted((ROOT / "params").glob("*.yaml"))


def test_the_five_chapters_exist():
    assert [p.stem for p in CHAPTERS] == [
        "01_derivation",
        "02_depth",
        "03_kernels",
        "04_perplexity",
        "05_sweeps",
    ]


def code_cells(notebook):
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


@pytest.fixture(params=CHAPTERS, ids=lambda p: p.stem)
def chapter(request):
    return request.param, nbformat.read(request.param, as_version=4)


def test_outputs_are_stripped(chapter):
    path, notebook = chapter
    for index, cell in enumerate(code_cells(notebook)):
        assert cell.outputs == [], f"{path.name} cell {index} has outputs: strip them"
        assert cell.execution_count is None, f"{path.name} cell {index} has an execution count"


def test_one_parameters_cell_describing_every_parameter(chapter):
    """papermill --help-notebook shows each parameter's inline comment as its description."""
    path, notebook = chapter
    tagged = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
    assert tagged[0].cell_type == "code"
    described = papermill.inspect_notebook(str(path))
    assert "run_id" in described, f"{path.name} has no run_id parameter (the sweep needs it)"
    for name, description in described.items():
        assert description["help"].strip(), f"{path.name}: parameter {name} has no description"


def test_every_chapter_states_its_provenance_and_draws_a_figure(chapter):
    path, notebook = chapter
    code = "\n".join(cell.source for cell in code_cells(notebook))
    # figures reach the page only through the inline backend; `make book` exports
    # MPLBACKEND=Agg, under which plt.show() silently draws nothing
    assert "%matplotlib inline" in code, f"{path.name} must select the inline backend"
    tree = ast.parse("\n".join(line for line in code.splitlines() if not line.startswith("%")))
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "rqlib.book.provenance"
        for alias in node.names
    }
    calls = {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert "provenance" in imported and "provenance" in calls, (
        f"{path.name} never calls provenance()"
    )
    assert "plt.show()" in code, f"{path.name} draws no figure"
    assert "save_result(" in code, f"{path.name} cannot save its results"


def test_chapters_import_rqlib_instead_of_defining_its_formulas(chapter):
    path, notebook = chapter
    code = "\n".join(cell.source for cell in code_cells(notebook))
    assert "from rqlib" in code
    for name in ("lloyd_max", "make_quantizer", "make_rotation", "coordinate_density"):
        assert f"def {name}(" not in code, f"{path.name} re-implements rqlib's {name}"


@pytest.mark.parametrize("params_file", PARAMS_FILES, ids=lambda p: p.name)
def test_params_files_name_only_existing_parameters(params_file):
    chapter_name = params_file.stem.rsplit("-", 1)[0]
    notebook = ROOT / "notebooks" / f"{chapter_name}.ipynb"
    assert notebook.is_file(), f"{params_file.name} names no chapter (expected {notebook.name})"
    values = yaml.safe_load(params_file.read_text())
    assert isinstance(values, dict) and values
    unknown = set(values) - set(papermill.inspect_notebook(str(notebook)))
    assert not unknown, f"{params_file.name} sets unknown parameters {sorted(unknown)}"


def test_there_is_a_gpu_params_file_for_the_model_chapters():
    names = {p.name for p in PARAMS_FILES}
    for chapter_name in ("01_derivation", "02_depth", "04_perplexity"):
        assert f"{chapter_name}-gpu.yaml" in names
