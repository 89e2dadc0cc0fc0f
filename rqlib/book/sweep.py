"""Run a chapter once per combination of parameters (papermill), collecting results as JSON.

Example::

    python -m rqlib sweep notebooks/04_perplexity.ipynb -p key_bits 2 3 4 -p method a b

runs the chapter for the 6 combinations of ``key_bits`` and ``method``. The chapter saves its
numbers to ``<results>/<chapter>/<run_id>.json`` (the sweep sets the ``run_id`` parameter and
``$RQLIB_RESULTS_DIR`` for the run), which ``rqlib.book.results.collect("<chapter>",
"<results>")`` reads back as a DataFrame. ``<results>`` is a folder of the user's
(:func:`sweep_results_dir`: ``--results-dir``, else ``$RQLIB_RESULTS_DIR``, else
``<checkout>/sweeps``); a sweep writes into the committed ``results/`` the book reads only when
asked with ``--into-committed-results``. ``-f params.yaml`` sets fixed parameters for every run
(e.g. a GPU box's model and corpus; ``-p`` wins over the file). Parameter names are checked
against the chapter's ``parameters`` cell before anything runs; values are read as YAML scalars
(``3`` is an int, ``0.5`` a float, ``true`` a bool, anything else a string).

Every run has a record, ``<results>/runs/<chapter>/<run_id>.json``: queued, running, done or
failed, with its job id, wall time and the first line of its error, next to its executed
notebook (``<run_id>.ipynb``). Runs execute in a local process pool (:func:`run_sweep`) or as
Slurm jobs (:mod:`rqlib.book.slurm`); both write the same records through
:func:`execute_and_record`, so :func:`sweep_status` reads either. A run holds a lock while it
executes, so one submitted twice never executes twice at once.

Run ids: a readable stem made of the ``-p`` combination, then a hash of every parameter the
run gets (the ``-p`` values, the ``-f`` file's values and the chapter's defaults for the rest),
e.g. ``key_bits=3+method=turboquant-mse-1a2b3c4d5e``. Two runs with different parameters never
share an id (values such as ``a/b``, ``a_b`` and ``a b`` have the same stem but not the same
hash), so a rerun with another parameters file writes new results instead of replacing the
earlier ones (and :func:`rqlib.book.results.save_result` refuses to replace a run by another).
A run counts as succeeded only if it executed and wrote its results file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import re
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from rqlib.base.files import CorruptFileError, atomic_write_text, file_lock, read_json
from rqlib.base.paths import env_path, repo_root
from rqlib.book.results import RESULTS_DIR_ENV

#: The parameter every sweepable chapter must have: the name of its results file.
RUN_ID_PARAMETER = "run_id"
#: Longest readable stem of a run id (the hash after it keeps ids distinct).
STEM_LENGTH = 80
#: Where a sweep's results go when the user names no folder (``<checkout>/sweeps``, git-ignored).
SWEEPS_FOLDER = "sweeps"
#: The subfolder of a sweep's results folder that holds its run records, notebooks and logs.
RUNS_FOLDER = "runs"


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
    results: Path | None = None,
) -> list[SweepRun]:
    """Check every name against the chapter's parameters and list the runs of the grid.

    Executed notebooks go to ``output_dir`` (default: the records folder of ``results``,
    :func:`records_dir`; ``results`` defaults to :func:`sweep_results_dir`).

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
        output_dir = records_dir(sweep_results_dir() if results is None else results, chapter)
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


# ---- where a sweep writes ------------------------------------------------------------------


def committed_results_dir() -> Path:
    """The committed results folder the book reads, ``<checkout>/results``."""
    return repo_root() / "results"


def sweep_results_dir(named: Path | None = None, *, into_committed: bool = False) -> Path:
    """The results folder of a sweep: ``named`` (``--results-dir``), else
    ``$RQLIB_RESULTS_DIR``, else ``<checkout>/sweeps`` (git-ignored); the committed
    ``results/`` only with ``into_committed`` (``--into-committed-results``).

    Raises ``ValueError`` when the folder would be the committed one without
    ``into_committed``, or when ``into_committed`` meets another folder named by the user.
    """
    committed = committed_results_dir()
    named = Path(named) if named is not None else env_path(RESULTS_DIR_ENV)
    if into_committed:
        if named is not None and named.resolve() != committed.resolve():
            raise ValueError(
                f"--into-committed-results writes to {committed}, but {named} was named too "
                f"(--results-dir or ${RESULTS_DIR_ENV}); name one folder"
            )
        return committed
    folder = named if named is not None else repo_root() / SWEEPS_FOLDER
    if folder.resolve() == committed.resolve():
        raise ValueError(
            f"{folder} is the committed results folder the book reads; a sweep writes there "
            "only with --into-committed-results"
        )
    return folder


def records_dir(results: Path, chapter: str) -> Path:
    """Where a sweep keeps one record per run, its executed notebooks and its job logs:
    ``<results>/runs/<chapter>`` (beside the results, not among them)."""
    return Path(results) / RUNS_FOLDER / chapter


def result_path(results: Path, chapter: str, run_id: str) -> Path | None:
    """The results file ``run_id`` wrote (clean, else ``.dirty``), or ``None``."""
    for name in (f"{run_id}.json", f"{run_id}.dirty.json"):
        path = Path(results) / chapter / name
        if path.is_file():
            return path
    return None


# ---- one run, on any machine ---------------------------------------------------------------


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


class RunBusyError(RuntimeError):
    """The run is being executed by another process (the message names its lock file)."""


@contextlib.contextmanager
def _run_lock(records: Path, run_id: str) -> Iterator[None]:
    """Hold ``<records>/<run_id>.lock`` for one execution; :class:`RunBusyError` when another
    process (on any node of a shared folder that honours ``flock``) holds it."""
    records.mkdir(parents=True, exist_ok=True)
    path = records / f"{run_id}.lock"
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunBusyError(
                f"run {run_id} is already being executed by another process ({path} is locked)"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _results_env(results: Path) -> Iterator[None]:
    """``$RQLIB_RESULTS_DIR`` set to ``results`` for the kernels started inside the block."""
    before = os.environ.get(RESULTS_DIR_ENV)
    os.environ[RESULTS_DIR_ENV] = str(Path(results).resolve())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(RESULTS_DIR_ENV, None)
        else:
            os.environ[RESULTS_DIR_ENV] = before


def first_line(error: BaseException) -> str:
    """The first line of an error's message that says something (a notebook's failing cell:
    its exception and message), or the error's type when none does."""
    if getattr(error, "ename", None):  # papermill's PapermillExecutionError
        return f"{error.ename}: {error.evalue}".splitlines()[0]
    lines = [line.strip() for line in str(error).splitlines() if line.strip(" -=\t")]
    return lines[0] if lines else type(error).__name__


def execute_and_record(
    notebook: Path,
    run: SweepRun,
    results: Path,
    *,
    kernel_name: str | None = None,
    job_id: str | None = None,
    log: str | None = None,
) -> str:
    """Execute one run with its results going to ``results``, recording its state
    (running, then done or failed) in :func:`records_dir`; return the results file's path.

    The run holds a lock while it executes, so that the same run submitted twice never
    executes (nor writes its results) twice at once; the results file itself is written
    atomically by :func:`rqlib.book.results.save_result`, which refuses to replace another
    run's file. Raises the run's error (``RuntimeError`` when it executed but saved nothing).
    """
    chapter = Path(notebook).stem
    records = records_dir(results, chapter)
    with _run_lock(records, run.run_id):
        started = time.time()
        update_record(
            records,
            run.run_id,
            state="running",
            started=started,
            finished=None,
            wall_seconds=None,
            error=None,
            host=socket.gethostname(),
            pid=os.getpid(),
            **({"job_id": job_id} if job_id else {}),
            **({"log": log} if log else {}),
        )
        try:
            with _results_env(results):
                execute_run(notebook, run, kernel_name)
            written = result_path(results, chapter, run.run_id)
            if written is None or written.stat().st_mtime < started - 1:
                raise RuntimeError(f"wrote no results file in {Path(results) / chapter}")
        except Exception as error:
            finished = time.time()
            update_record(
                records,
                run.run_id,
                state="failed",
                finished=finished,
                wall_seconds=finished - started,
                error=first_line(error),
            )
            raise
        finished = time.time()
        update_record(
            records,
            run.run_id,
            state="done",
            finished=finished,
            wall_seconds=finished - started,
            result=written.name,
        )
    return str(written)


def _execute_locally(notebook: Path, run: SweepRun, results: Path, kernel_name: str | None) -> str:
    return execute_and_record(
        notebook, run, results, kernel_name=kernel_name, job_id=f"local:{os.getpid()}"
    )


def queue_runs(notebook: Path, runs: list[SweepRun], results: Path, executor: str) -> Path:
    """Record every run as queued (with its parameters and notebook) before any executes;
    return the records folder."""
    records = records_dir(results, Path(notebook).stem)
    for run in runs:
        update_record(
            records,
            run.run_id,
            state="queued",
            executor=executor,
            parameters=run.parameters,
            notebook=str(run.output_notebook),
            queued=time.time(),
            started=None,
            finished=None,
            wall_seconds=None,
            error=None,
            job_id=None,
            log=None,
        )
    return records


def run_sweep(
    notebook: Path,
    runs: list[SweepRun],
    *,
    jobs: int = 1,
    kernel_name: str | None = None,
    results: Path | None = None,
) -> list[tuple[SweepRun, BaseException]]:
    """Execute ``runs`` on this machine (``jobs`` at a time) with a progress bar, their results
    going to ``results`` (default :func:`sweep_results_dir`) and their states recorded beside
    them (:func:`records_dir`, read by :func:`sweep_status`); return the failures."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an integer >= 1, got {jobs!r}")
    results = sweep_results_dir() if results is None else Path(results)
    queue_runs(notebook, runs, results, "local")
    failures: list[tuple[SweepRun, BaseException]] = []
    progress = tqdm(total=len(runs), desc=f"sweep {Path(notebook).name}", unit="run")
    if jobs == 1:
        for run in runs:
            progress.set_postfix_str(run.run_id)
            try:
                _execute_locally(notebook, run, results, kernel_name)
            except Exception as error:  # reported below with the failing notebook's path
                failures.append((run, error))
            progress.update()
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {
                pool.submit(_execute_locally, notebook, run, results, kernel_name): run
                for run in runs
            }
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


# ---- what every run of a sweep is doing ----------------------------------------------------

#: The states :func:`sweep_status` reports.
RUN_STATES = ("queued", "running", "done", "failed")


def update_record(records: Path, run_id: str, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into ``<records>/<run_id>.json`` (written atomically, under a lock
    shared by the records folder) and return the record."""
    records = Path(records)
    records.mkdir(parents=True, exist_ok=True)
    path = records / f"{run_id}.json"
    with file_lock(records / ".records.lock"):
        record: dict[str, Any] = {"run_id": run_id}
        if path.is_file():
            try:
                record.update(read_json(path))
            except CorruptFileError:
                pass  # a record is rewritten whole: a damaged one loses only its history
        record.update(fields)
        atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reconcile(record: dict[str, Any], live_jobs: Mapping[str, str]) -> dict[str, Any]:
    """A record whose process or job is gone without saying so becomes ``failed``; a Slurm
    job's queue state wins over the record's while the job is in the queue."""
    record = dict(record)
    state = record.get("state")
    job_id = record.get("job_id") or ""
    if state not in ("queued", "running"):
        return record
    if record.get("executor") == "slurm" and job_id:
        from rqlib.book.slurm_queue import RUNNING_STATES, WAITING_STATES

        queue_state = live_jobs.get(job_id)
        if queue_state in WAITING_STATES:
            record["state"] = "queued"
        elif queue_state in RUNNING_STATES:
            record["state"] = "running"
        else:  # ended (CANCELLED, FAILED, TIMEOUT...; or no longer listed) without a result
            how = queue_state or "no longer in the queue"
            record["state"] = "failed"
            record["error"] = f"Slurm job {job_id} ended without a result ({how}; see its log)"
        return record
    pid = record.get("pid")
    if state == "running" and isinstance(pid, int) and record.get("host") == socket.gethostname():
        if not _process_alive(pid):
            record["state"] = "failed"
            record["error"] = f"process {pid} ended without finishing the run"
    return record


def sweep_status(directory: Path) -> list[dict[str, Any]]:
    """Every recorded run of the sweeps whose results folder is ``directory`` (or of one
    chapter, given its records folder ``<results>/runs/<chapter>``), local or Slurm alike:
    dicts with ``chapter``, ``run_id``, ``state`` (one of :data:`RUN_STATES`), ``job_id``,
    ``wall_seconds``, ``error`` (its first line) and ``log``.

    Raises ``FileNotFoundError`` naming the folder when it holds no run records.
    """
    directory = Path(directory)
    if (directory / RUNS_FOLDER).is_dir():
        folders = sorted(p for p in (directory / RUNS_FOLDER).iterdir() if p.is_dir())
    else:
        folders = [directory]
    paths = [path for folder in folders for path in sorted(folder.glob("*.json"))]
    if not paths:
        raise FileNotFoundError(
            f"{directory} holds no sweep records (expected {directory / RUNS_FOLDER}/<chapter>/"
            "<run_id>.json, written by python -m rqlib sweep)"
        )
    from rqlib.book.slurm_queue import queue_states

    records = []
    for path in paths:
        try:
            record = read_json(path)
        except CorruptFileError as error:
            record = {"run_id": path.stem, "state": "failed", "error": str(error)}
        record.setdefault("chapter", path.parent.name)
        records.append(record)
    slurm_jobs = [r["job_id"] for r in records if r.get("executor") == "slurm" and r.get("job_id")]
    live = queue_states(slurm_jobs) if slurm_jobs else {}
    rows = []
    for record in records:
        record = _reconcile(record, live)
        wall = record.get("wall_seconds")
        if wall is None and record.get("state") == "running" and record.get("started"):
            wall = time.time() - float(record["started"])
        rows.append(
            {
                "chapter": record.get("chapter"),
                "run_id": record.get("run_id"),
                "state": record.get("state"),
                "job_id": record.get("job_id") or "",
                "wall_seconds": wall,
                "error": record.get("error") or "",
                "log": record.get("log") or "",
            }
        )
    return rows


def format_status(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`sweep_status` as a plain-text table, then a count per state."""
    header = ("run", "state", "job", "wall", "error")
    lines = [
        (
            str(row["run_id"]),
            str(row["state"]),
            str(row["job_id"]),
            "" if row["wall_seconds"] is None else f"{row['wall_seconds']:.0f} s",
            str(row["error"])[:100],
        )
        for row in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    text = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
        for line in [header, *lines]
    ]
    counts = {state: sum(row["state"] == state for row in rows) for state in RUN_STATES}
    text.append(", ".join(f"{count} {state}" for state, count in counts.items()))
    return "\n".join(text)


def results_written(chapter: str, run: SweepRun, since: float, directory: Path) -> bool:
    """Whether ``run`` wrote its results file (clean or ``.dirty``) at or after ``since``."""
    path = result_path(directory, chapter, run.run_id)
    return path is not None and path.stat().st_mtime >= since - 1
