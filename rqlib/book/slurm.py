"""A sweep's runs as Slurm jobs, submitted with submitit: one job per run.

:func:`submit_sweep` records every run as queued (:func:`rqlib.book.sweep.queue_runs`), then
submits one job per run through a ``submitit.SlurmExecutor`` whose log folder is
``<results>/runs/<chapter>/slurm``. On the node, :class:`SweepJob` executes the run with
:func:`rqlib.book.sweep.execute_and_record`, as a local sweep does: the same run record
(running, done or failed, with the job id and the log path), the same lock against a second
execution of the run, the same atomic results file. The node runs the Python that submitted
(the project's ``.venv/bin/python``), which imports ``rqlib`` from the checkout, so the
checkout must be on a folder the nodes share.

A job that Slurm preempts or that reaches its time limit receives ``USR2`` before it is
killed; submitit then calls :meth:`SweepJob.checkpoint`, which requeues the run once. A second
preemption, a cancelled job (``scancel``) or a run that raises is reported as failed, with its
job id and log path; ``python -m rqlib sweep ... --resume`` submits the runs that have no
results file.

:func:`queue_states` reads the queue (``squeue``), :func:`wait_for_sweep` follows the runs
until each has ended, with a progress bar.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit
import yaml
from tqdm.auto import tqdm

from rqlib.book.slurm_queue import (
    SlurmUnavailableError,
    queue_states,
)
from rqlib.book.sweep import (
    SweepRun,
    execute_and_record,
    queue_runs,
    records_dir,
    sweep_status,
    update_record,
)

__all__ = [
    "SlurmOptions",
    "SlurmUnavailableError",
    "SweepJob",
    "make_executor",
    "queue_states",
    "submit_sweep",
    "wait_for_sweep",
]


@dataclass(frozen=True)
class SlurmOptions:
    """What each run's job asks Slurm for (``None``: Slurm's default).

    ``config`` names a YAML file of ``submitit.SlurmExecutor`` parameters (``partition``,
    ``time``, ``mem``, ``gpus_per_node``, ``additional_parameters``, ``setup``...), read
    first; the other fields override it. ``sbatch_flags`` are extra ``sbatch`` options, each
    ``name=value`` or ``name`` (``qos=high``, ``exclusive``).
    """

    partition: str | None = None
    gpus_per_run: int = 0
    time_minutes: int | None = None
    mem: str | None = None
    cpus_per_run: int | None = None
    sbatch_flags: tuple[str, ...] = ()
    config: Path | None = None
    python: str = field(default_factory=lambda: sys.executable)


def _config_parameters(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Slurm configuration {path} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        line = " ".join(str(error).split())
        raise ValueError(f"Slurm configuration {path} is not valid YAML: {line}") from None
    if not isinstance(loaded, dict) or not all(isinstance(key, str) for key in loaded):
        raise ValueError(
            f"Slurm configuration {path} must be a mapping of submitit SlurmExecutor "
            "parameters (partition: ..., time: ..., mem: ...)"
        )
    return loaded


def _flag_parameters(flags: tuple[str, ...]) -> dict[str, Any]:
    """``("qos=high", "--exclusive")`` -> ``{"qos": "high", "exclusive": True}`` (the leading
    dashes of an ``sbatch`` option are optional)."""
    parameters: dict[str, Any] = {}
    for flag in flags:
        name, _, value = flag.removeprefix("--").partition("=")
        if not re.fullmatch(r"[a-z][a-z0-9-]*", name):
            raise ValueError(f"sbatch flag {flag!r} must read name=value or name (e.g. qos=high)")
        parameters[name] = value if value else True
    return parameters


def make_executor(folder: Path, options: SlurmOptions) -> submitit.SlurmExecutor:
    """A ``submitit.SlurmExecutor`` logging to ``folder``, one task of one node per job, with
    ``options`` applied (``ValueError`` naming the configuration file for a parameter
    submitit does not know)."""
    executor = submitit.SlurmExecutor(folder=str(folder), python=options.python)
    config = _config_parameters(options.config)
    try:
        executor.update_parameters(**config)
    except (ValueError, TypeError) as error:
        first = " ".join(str(error).split())[:300]
        raise ValueError(f"Slurm configuration {options.config}: {first}") from None
    given: dict[str, Any] = {"nodes": 1, "ntasks_per_node": 1}
    if options.partition:
        given["partition"] = options.partition
    if options.gpus_per_run:
        given["gpus_per_node"] = options.gpus_per_run
    if options.time_minutes is not None:
        given["time"] = options.time_minutes
    if options.mem:
        given["mem"] = options.mem
    if options.cpus_per_run is not None:
        given["cpus_per_task"] = options.cpus_per_run
    extra = _flag_parameters(options.sbatch_flags)
    if extra:
        given["additional_parameters"] = {**config.get("additional_parameters", {}), **extra}
    executor.update_parameters(**given)
    return executor


class SweepJob(submitit.helpers.Checkpointable):
    """What a node executes for one run; requeued once when preempted or out of time."""

    def __init__(
        self,
        notebook: Path,
        results: Path,
        kernel_name: str | None = None,
        requeued: bool = False,
    ) -> None:
        self.notebook = Path(notebook).resolve()
        self.results = Path(results).resolve()
        self.kernel_name = kernel_name
        self.requeued = requeued

    def _records(self) -> Path:
        return records_dir(self.results, self.notebook.stem)

    def __call__(self, run: SweepRun) -> str:
        environment = submitit.JobEnvironment()
        return execute_and_record(
            self.notebook,
            run,
            self.results,
            kernel_name=self.kernel_name,
            job_id=str(environment.job_id),
            log=str(environment.paths.stderr),
        )

    def checkpoint(self, run: SweepRun) -> submitit.helpers.DelayedSubmission | None:
        """submitit's hook on preemption or time-out: requeue the run once, never twice."""
        if self.requeued:
            return None  # submitit then fails the job: execute_and_record records the error
        update_record(
            self._records(), run.run_id, state="queued", error="requeued once", requeued=True
        )
        again = SweepJob(self.notebook, self.results, self.kernel_name, requeued=True)
        return submitit.helpers.DelayedSubmission(again, run)


def submit_sweep(
    notebook: Path,
    runs: list[SweepRun],
    results: Path,
    options: SlurmOptions,
    *,
    kernel_name: str | None = None,
) -> dict[str, str]:
    """Record ``runs`` as queued and submit one Slurm job for each; return run id -> job id.

    Raises ``FileNotFoundError`` when ``sbatch`` is not on ``PATH``.
    """
    if shutil.which("sbatch") is None:
        raise FileNotFoundError(
            "sbatch is not on PATH: --executor slurm needs a Slurm client (make slurm-up "
            "starts a one-node cluster on this machine)"
        )
    results = Path(results).resolve()
    records = queue_runs(notebook, runs, results, "slurm")
    executor = make_executor(records / "slurm", options)
    job = SweepJob(notebook, results, kernel_name)
    jobs = {}
    for run in runs:
        submitted = executor.submit(job, run)
        jobs[run.run_id] = str(submitted.job_id)
        update_record(
            records, run.run_id, job_id=str(submitted.job_id), log=str(submitted.paths.stderr)
        )
    return jobs


def wait_for_sweep(
    results: Path, chapter: str, run_ids: list[str], *, poll_seconds: float = 2.0
) -> list[Mapping[str, Any]]:
    """Follow ``run_ids`` with a progress bar until each is done or failed; return the rows
    of :func:`rqlib.book.sweep.sweep_status` of the failed ones."""
    records = records_dir(results, chapter)
    wanted = set(run_ids)
    progress = tqdm(total=len(wanted), desc=f"sweep {chapter} (slurm)", unit="run")
    while True:
        rows = [row for row in sweep_status(records) if row["run_id"] in wanted]
        ended = [row for row in rows if row["state"] in ("done", "failed")]
        progress.n = len(ended)
        running = sum(row["state"] == "running" for row in rows)
        progress.set_postfix_str(f"{running} running")
        progress.refresh()
        if len(ended) == len(wanted):
            break
        time.sleep(poll_seconds)
    progress.close()
    return [row for row in rows if row["state"] == "failed"]
