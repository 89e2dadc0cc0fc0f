"""The Slurm queue as a sweep's status reads it: which of a sweep's jobs are waiting or running.

Kept apart from :mod:`rqlib.book.slurm` (which submits through submitit and imports the sweep)
so that :mod:`rqlib.book.sweep` can read the queue without an import cycle.
"""

from __future__ import annotations

import shutil
import subprocess

__all__ = ["RUNNING_STATES", "WAITING_STATES", "SlurmUnavailableError", "queue_states"]

#: Queue states of a job that has not started yet, and of one that is executing.
WAITING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING"})
RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "SIGNALING"})


class SlurmUnavailableError(OSError):
    """Slurm's commands are missing or its controller does not answer (the message says which)."""


def queue_states(job_ids: list[str]) -> dict[str, str]:
    """The queue state (``PENDING``, ``RUNNING``, ``CANCELLED``...) of each of ``job_ids``
    that Slurm still lists; a job it no longer lists is absent.

    Raises :class:`SlurmUnavailableError` with ``squeue``'s message when the queue cannot be
    read.
    """
    if shutil.which("squeue") is None:
        raise SlurmUnavailableError(
            "squeue is not on PATH: the state of the sweep's Slurm jobs cannot be read"
        )
    listed = subprocess.run(
        ["squeue", "--noheader", "--states=all", "--format=%i|%T"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if listed.returncode != 0:
        message = " ".join(listed.stderr.split()) or f"exit status {listed.returncode}"
        raise SlurmUnavailableError(f"squeue failed, so the jobs' states are unknown: {message}")
    wanted = set(job_ids)
    states = {}
    for line in listed.stdout.splitlines():
        job_id, _, state = line.strip().partition("|")
        if job_id in wanted:
            states[job_id] = state
    return states
