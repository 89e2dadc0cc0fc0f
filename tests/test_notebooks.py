"""Cheap static checks on the chapters (executing them is the book build's and nbmake's job)."""

import ast
import re
from pathlib import Path

import nbformat
import papermill
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PARAMS_FILES = sorted((ROOT / "params").glob("*.yaml"))


def test_the_six_chapters_exist():
    assert [p.stem for p in CHAPTERS] == [
        "01_derivation",
        "02_depth",
        "03_kernels",
        "04_perplexity",
        "05_sweeps",
        "06_bound",
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


def test_every_chapter_states_its_provenance_and_glues_numbered_figures(chapter):
    path, notebook = chapter
    code = "\n".join(cell.source for cell in code_cells(notebook))
    prose = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "markdown")
    # figures reach the page only through the inline backend; `make book` exports
    # MPLBACKEND=Agg, under which a figure would silently draw nothing
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
    # a run of the chapter: typed parameters, glued numbers, its cost and its results file
    assert f'Chapter("{path.stem}", globals()' in code, f"{path.name} does not start a Chapter run"
    assert "run.finish(prov" in code, f"{path.name} never calls run.finish (cost note, results)"
    assert "plt.show()" not in code, f"{path.name} shows a figure without number or caption"
    glued = set(re.findall(r'run\.figure\(\s*"(\w+)"', code))
    placed = re.findall(r"```\{glue:figure\} (\w+)\n:name: (fig-[\w-]+)\n\n(.+?)```", prose, re.S)
    assert glued, f"{path.name} glues no figure"
    assert glued == {name for name, _, _ in placed}, f"{path.name}: glued {glued}, placed {placed}"
    assert all(caption.strip() for _, _, caption in placed), f"{path.name}: a figure has no caption"


def test_every_chapter_opens_with_its_cost_and_ends_with_exercises(chapter):
    path, notebook = chapter
    first = notebook.cells[0].source
    for key in ("run_time", "run_device", "run_setting", "gpu_needs"):
        assert f"{{glue:text}}`{key}`" in first, f"{path.name}: the opening note lacks {key}"
    prose = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "markdown")
    exercises = prose[prose.index("## Exercises") :]
    count = len(re.findall(r"```\{admonition\} Exercise", exercises))
    solutions = len(re.findall(r"```\{admonition\} Solution\n:class: dropdown", exercises))
    assert 2 <= count <= 4 and solutions == count, f"{path.name}: {count} exercises, {solutions}"
    assert "papermill notebooks/" in exercises, f"{path.name}: no exercise reruns the chapter"


#: Words from the project's history that the book must not show its readers ("seed" among
#: them: a random choice of rotations and sketches is a draw, ``draw=`` in a spec).
HISTORY = re.compile(r"\b(seeds?|issue[- ]?\d|issue-scale|first landing|landing)\b", re.I)


def test_no_history_words_in_the_book():
    texts = {
        p: p.read_text() for p in [*CHAPTERS, *(ROOT / "book").glob("*.md"), ROOT / "README.md"]
    }
    for path, text in texts.items():
        found = HISTORY.findall(text)
        assert not found, f"{path.name} shows history words {found}"


def test_code_cells_are_short_and_chapters_carry_ideas(chapter):
    """About 25 lines per code cell at most; chapters 3 and 4 under 250 lines of code."""
    path, notebook = chapter
    sizes = [len(cell.source.splitlines()) for cell in code_cells(notebook)]
    assert max(sizes) <= 27, f"{path.name}: a code cell of {max(sizes)} lines"
    if path.stem in ("03_kernels", "04_perplexity"):
        assert sum(sizes) < 250, f"{path.name}: {sum(sizes)} lines of code"


def test_headings_are_not_numbered_by_hand(chapter):
    """The toc numbers sections; "## 1. ..." would render "1.1. 1. ..."."""
    path, notebook = chapter
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            numbered = re.findall(r"^#+ \d+\.", cell.source, re.M)
            assert not numbered, f"{path.name}: hand-numbered headings {numbered}"


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
