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

Run ids: a readable stem made of the ``-p`` combination, then a hash of every parameter the
run gets (the ``-p`` values, the ``-f`` file's values and the chapter's defaults for the rest),
e.g. ``key_bits=3+method=turboquant-mse-1a2b3c4d5e``. Two runs with different parameters never
share an id (values such as ``a/b``, ``a_b`` and ``a b`` have the same stem but not the same
hash), so a rerun with another parameters file writes new results instead of replacing the
earlier ones (and :func:`rqlib.book.results.save_result` refuses to replace a run by another).
A run counts as succeeded only if it executed and wrote its results file.
"""

from __future__ import annotations

import hashlib
import itertools
import json
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
#: Longest readable stem of a run id (the hash after it keeps ids distinct).
STEM_LENGTH = 80


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


def _canonical(value: Any) -> str:
    """A value as typed JSON (``3`` and ``"3"`` differ), for hashing."""
    return json.dumps(value, sort_keys=True, default=lambda v: f"{type(v).__name__}:{v!r}")


def run_id_for(combination: Mapping[str, Any], parameters: Mapping[str, Any] | None = None) -> str:
    """The id of one run: a readable stem from ``combination`` (the ``-p`` values) and a hash of
    ``parameters`` (every parameter the run gets; default: the combination alone).

    ``key_bits=3+method=turboquant-mse-1a2b3c4d5e``: the stem keeps letters, digits and
    ``._=+-`` (other characters become ``_``, at most :data:`STEM_LENGTH` of them); the hash,
    10 hex digits of a sha256 of the parameters as typed JSON, tells apart what the stem
    cannot.
    """
    parameters = dict(combination if parameters is None else parameters)
    parameters.pop(RUN_ID_PARAMETER, None)
    if combination:
        stem = "+".join(f"{name}={value}" for name, value in combination.items())
        stem = re.sub(r"[^A-Za-z0-9._=+-]", "_", stem)[:STEM_LENGTH].strip("._=+-") or "run"
        if not stem[0].isalnum():
            stem = "run" + stem
    else:
        stem = "defaults"
    digest = hashlib.sha256(_canonical(parameters).encode()).hexdigest()[:10]
    return f"{stem}-{digest}"


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
    # what a parameter is when the run does not set it: the chapter's default, as written
    defaults = {
        name: f"default: {info.get('default')}"
        for name, info in known.items()
        if name != RUN_ID_PARAMETER
    }
    runs: list[SweepRun] = []
    seen: dict[str, dict] = {}
    names = list(grid)
    for values in itertools.product(*(grid[name] for name in names)):
        combination = dict(zip(names, values))
        given = {**fixed, **combination}
        run_id = run_id_for(combination, {**defaults, **given})
        if run_id in seen:  # a hash collision: never let two runs share a results file
            raise ValueError(f"runs {seen[run_id]} and {combination} share the id {run_id!r}")
        seen[run_id] = combination
        parameters = {**given, RUN_ID_PARAMETER: run_id}
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
    """The fixed parameters of a YAML parameters file (``{}`` without one); ``ValueError``
    naming the file when it is not YAML or not a mapping of names to values."""
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"parameters file {path} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        first = str(error).strip().splitlines()
        raise ValueError(
            f"parameters file {path} is not valid YAML: {' '.join(line.strip() for line in first)}"
        ) from None
    loaded = {} if loaded is None else loaded
    if not isinstance(loaded, dict) or not all(isinstance(key, str) for key in loaded):
        raise ValueError(f"parameters file {path} must hold a mapping of name: value")
    return loaded


def results_written(chapter: str, run: SweepRun, since: float, directory: Path) -> bool:
    """Whether ``run`` wrote its results file (clean or ``.dirty``) at or after ``since``."""
    for name in (f"{run.run_id}.json", f"{run.run_id}.dirty.json"):
        path = Path(directory) / chapter / name
        if path.is_file() and path.stat().st_mtime >= since - 1:
            return True
    return False
