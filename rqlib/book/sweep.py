"""Run a chapter once per combination of parameters (papermill), collecting results as JSON.

Example::

    python -m rqlib sweep notebooks/04_perplexity.ipynb -p key_bits 2 3 4 -p method a b

runs the chapter for the 6 combinations of ``key_bits`` and ``method``. Each run is a papermill
execution written to ``book/_generated/<chapter>/<run_id>.ipynb``; the chapter itself saves
its numbers to ``results/<chapter>/<run_id>.json`` (the sweep sets the ``run_id`` parameter),
which ``rqlib.book.results.collect("<chapter>")`` reads back as a DataFrame. ``-f params.yaml`` sets
fixed parameters for every run (e.g. a GPU box's model and corpus; ``-p`` wins over the file).
Parameter names are checked against the chapter's ``parameters`` cell before anything runs;
values are read as YAML scalars (``3`` is an int, ``0.5`` a float, ``true`` a bool, anything
else a string).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from rqlib.base.paths import repo_root

#: The parameter every sweepable chapter must have: the name of its results file.
RUN_ID_PARAMETER = "run_id"


@dataclass(frozen=True)
class SweepRun:
    """One execution of the sweep: its parameters and where its outputs go."""

    run_id: str
    parameters: dict[str, Any]
    output_notebook: Path


def notebook_parameters(notebook: Path) -> dict[str, dict[str, Any]]:
    """The chapter's parameters (name -> papermill's description), from its ``parameters`` cell."""
    import papermill

    notebook = Path(notebook)
    if not notebook.is_file():
        raise FileNotFoundError(f"notebook {notebook} does not exist")
    found = papermill.inspect_notebook(str(notebook))
    if not found:
        raise ValueError(f"{notebook} has no cell tagged 'parameters'; it cannot be swept")
    return found


def parse_value(text: str) -> Any:
    """A command-line value as a YAML scalar: ``"3"`` -> 3, ``"0.5"`` -> 0.5, ``"a"`` -> ``"a"``."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if value is None or isinstance(value, (dict, list)):
        return text
    return value


def run_id_for(combination: Mapping[str, Any]) -> str:
    """A file-name-safe name for one combination, e.g. ``key_bits=3+method=turboquant-mse``."""
    if not combination:
        return "defaults"
    parts = [f"{name}={value}" for name, value in combination.items()]
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", "+".join(parts))


def plan_sweep(
    notebook: Path,
    grid: Mapping[str, Sequence[Any]],
    fixed: Mapping[str, Any] | None = None,
    output_dir: Path | None = None,
) -> list[SweepRun]:
    """Check every name against the chapter's parameters and list the runs of the grid.

    Raises ``ValueError`` naming any unknown parameter and listing the known ones, for an
    empty list of values, for ``run_id`` given by hand, or when the chapter has no ``run_id``.
    """
    notebook = Path(notebook)
    known = notebook_parameters(notebook)
    fixed = dict(fixed or {})
    if RUN_ID_PARAMETER not in known:
        raise ValueError(
            f"{notebook} has no {RUN_ID_PARAMETER!r} parameter, so its runs cannot be told "
            "apart; add one to its parameters cell"
        )
    for source, names in (("-p", grid), ("params file", fixed)):
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise ValueError(
                f"unknown parameter(s) {unknown} ({source}) for {notebook.name}; "
                f"its parameters are: {', '.join(sorted(known))}"
            )
        if RUN_ID_PARAMETER in names:
            raise ValueError(f"{RUN_ID_PARAMETER!r} is set by the sweep; do not pass it ({source})")
    for name, values in grid.items():
        if len(values) == 0:
            raise ValueError(f"parameter {name!r} was given no values")
        if len(set(map(repr, values))) != len(values):
            raise ValueError(f"parameter {name!r} repeats a value: {list(values)}")
    chapter = notebook.stem
    if output_dir is None:
        output_dir = repo_root() / "book" / "_generated" / chapter
    output_dir = Path(output_dir)
    runs = []
    names = list(grid)
    for values in itertools.product(*(grid[name] for name in names)):
        combination = dict(zip(names, values))
        run_id = run_id_for(combination)
        parameters = {**fixed, **combination, RUN_ID_PARAMETER: run_id}
        runs.append(SweepRun(run_id, parameters, output_dir / f"{run_id}.ipynb"))
    return runs


def execute_run(notebook: Path, run: SweepRun, kernel_name: str | None = None) -> SweepRun:
    """Execute one run with papermill, in the notebook's own folder (as the book build does)."""
    import papermill

    notebook = Path(notebook).resolve()
    run.output_notebook.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(
        str(notebook),
        str(run.output_notebook),
        parameters=run.parameters,
        cwd=str(notebook.parent),
        kernel_name=kernel_name,
        progress_bar=False,
    )
    return run


def run_sweep(
    notebook: Path, runs: list[SweepRun], *, jobs: int = 1, kernel_name: str | None = None
) -> list[tuple[SweepRun, BaseException]]:
    """Execute ``runs`` (``jobs`` at a time) with a progress bar; return the failures."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an integer >= 1, got {jobs!r}")
    failures: list[tuple[SweepRun, BaseException]] = []
    progress = tqdm(total=len(runs), desc=f"sweep {Path(notebook).name}", unit="run")
    if jobs == 1:
        for run in runs:
            progress.set_postfix_str(run.run_id)
            try:
                execute_run(notebook, run, kernel_name)
            except Exception as error:  # reported below with the failing notebook's path
                failures.append((run, error))
            progress.update()
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(execute_run, notebook, run, kernel_name): run for run in runs}
            for future in as_completed(futures):
                error = future.exception()
                if error is not None:
                    failures.append((futures[future], error))
                progress.update()
    progress.close()
    return failures


def grid_from_pairs(pairs: list[list[str]]) -> dict[str, list[Any]]:
    """The grid of ``-p NAME VALUE...`` pairs: name -> values read as YAML scalars."""
    grid: dict[str, list[Any]] = {}
    for pair in pairs:
        if len(pair) < 2:
            raise ValueError(f"-p {pair[0]} needs at least one value: -p NAME VALUE [VALUE ...]")
        name, *values = pair
        if name in grid:
            raise ValueError(f"parameter {name!r} is given twice with -p; list all its values once")
        grid[name] = [parse_value(value) for value in values]
    return grid


def fixed_from_file(path: Path | None) -> dict[str, Any]:
    """The fixed parameters of a YAML parameters file (``{}`` without one)."""
    if path is None:
        return {}
    if not path.is_file():
        raise FileNotFoundError(f"parameters file {path} does not exist")
    loaded = yaml.safe_load(path.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"parameters file {path} must hold a mapping of name: value")
    return loaded
