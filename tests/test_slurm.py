"""``rqlib sweep --executor slurm`` against a real Slurm: the one-node cluster of ``cluster/``.

The session fixture starts it with ``cluster/start.sh`` (munged, slurmctld and slurmd on this
machine; ``.ci/run`` installs them with apt when they are missing). When a daemon cannot start,
every test here fails with the daemon's own log: they are never skipped.

The sweeps run a tiny chapter (a ``parameters`` cell, a ``run_id``, a results file) that can
be held running until a file is removed, so that a test sees a run queued or running, cancels
it with ``scancel`` or signals it as Slurm signals a preempted job, then lets it finish.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_sweep import write_notebook

from rqlib.book.slurm import queue_states
from rqlib.book.sweep import plan_sweep, records_dir, sweep_status

ROOT = Path(__file__).resolve().parent.parent
#: How long a test waits for a run to reach a state before it fails (each run takes seconds).
PATIENCE_S = 60

HELD_CHAPTER = [
    (
        "code",
        "# Method name ('broken' fails on purpose).\nmethod = 'a'\n"
        "# File whose existence holds the run before it saves ('' : none).\nhold = ''\n"
        "# Name of this run's results file; empty: save nothing.\nrun_id = ''",
        ["parameters"],
    ),
    (
        "code",
        "import os, time\n"
        "from rqlib.book.results import save_result\n"
        "while hold and os.path.exists(hold):\n    time.sleep(0.2)\n"
        "if method == 'broken':\n    raise RuntimeError('this combination fails on purpose')\n"
        "if run_id:\n"
        "    save_result('held', run_id, parameters={'method': method, 'hold': hold},\n"
        "                metrics={'score': len(method)}, provenance={'commit': 'test'})",
        [],
    ),
]


@pytest.fixture(scope="session")
def slurm():
    """The one-node cluster, started once per session (``SLURM_CONF`` set for the tests)."""
    folder = Path(os.environ.get("RQLIB_SLURM_DIR") or "/tmp/rqlib-slurm")  # as make slurm-up
    started = subprocess.run(
        ["bash", str(ROOT / "cluster" / "start.sh")], capture_output=True, text=True
    )
    if started.returncode != 0:
        pytest.fail(f"the Slurm cluster did not start:\n{started.stdout}{started.stderr}")
    os.environ["SLURM_CONF"] = str(folder / "slurm.conf")
    return folder


@pytest.fixture
def held(tmp_path):
    return write_notebook(tmp_path / "held.ipynb", HELD_CHAPTER)


def sweep(*arguments: str) -> subprocess.CompletedProcess[str]:
    """``python -m rqlib sweep ARGUMENTS`` in a process of its own, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "rqlib", "sweep", *arguments],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def states(results: Path) -> dict[str, dict]:
    """run id -> its row of ``--status``, read through the library."""
    return {row["run_id"]: row for row in sweep_status(results)}


def wait_until(condition, what: str):
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"waited {PATIENCE_S} s for {what}")


def run_ids(notebook: Path, grid: dict, results: Path) -> dict:
    """method -> run id of the runs the sweep plans for ``grid``."""
    runs = plan_sweep(notebook, grid, {}, None, results)
    return {run.parameters["method"]: run.run_id for run in runs}


def test_a_slurm_sweep_writes_results_and_reports_its_runs(slurm, held, tmp_path):
    results = tmp_path / "sweep"
    hold = tmp_path / "hold"
    hold.touch()
    submitted = sweep(
        str(held), "-p", "method", "a", "bb", "-p", "hold", str(hold),
        "--executor", "slurm", "--results-dir", str(results), "--time-limit", "5", "--detach",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    ids = run_ids(held, {"method": ["a", "bb"], "hold": [str(hold)]}, results)
    # while held: both runs are queued or running, each with its job id
    during = wait_until(
        lambda: (s := states(results)) and all(r["state"] == "running" for r in s.values()) and s,
        "both runs to run",
    )
    assert {r["job_id"] for r in during.values()} == set(
        submitted.stdout.split("Slurm jobs: ")[1].split("\n")[0].split()
    )
    status = sweep("--status", str(results))
    assert status.returncode == 0 and "0 queued, 2 running, 0 done, 0 failed" in status.stdout
    hold.unlink()
    after = wait_until(
        lambda: (s := states(results)) and all(r["state"] == "done" for r in s.values()) and s,
        "both runs to finish",
    )
    assert all(r["wall_seconds"] > 0 and r["error"] == "" for r in after.values())
    for method, run_id in ids.items():
        record = json.loads((results / "held" / f"{run_id}.json").read_text())
        assert record["metrics"] == {"score": len(method)}  # computed by the node from -p
    status = sweep("--status", str(results))
    assert "0 queued, 0 running, 2 done, 0 failed" in status.stdout
    assert all(run_id in status.stdout for run_id in ids.values())


def test_a_cancelled_job_is_reported_then_resumed(slurm, held, tmp_path):
    results = tmp_path / "sweep"
    hold = tmp_path / "hold"
    hold.touch()
    grid = ["-p", "method", "a", "bb", "-p", "hold", str(hold)]
    common = ["--executor", "slurm", "--results-dir", str(results), "--time-limit", "5"]
    assert sweep(str(held), *grid, *common, "--detach").returncode == 0
    running = wait_until(
        lambda: (s := states(results)) and all(r["state"] == "running" for r in s.values()) and s,
        "both runs to run",
    )
    ids = run_ids(held, {"method": ["a", "bb"], "hold": [str(hold)]}, results)
    cancelled = running[ids["bb"]]["job_id"]
    subprocess.run(["scancel", cancelled], check=True)
    # held until Slurm has killed it (after its grace period, KillWait): a run that finished
    # within that period would have saved its results, and would be done, not failed
    wait_until(lambda: states(results)[ids["bb"]]["state"] == "failed", "the cancelled run")
    hold.unlink()
    after = wait_until(
        lambda: (s := states(results)) and s[ids["a"]]["state"] == "done" and s,
        "the other run to finish",
    )
    assert after[ids["bb"]]["state"] == "failed"
    # the record says failed with the job id and an error: the job's own (its kernel killed)
    # or, when the job was killed before it could record one, that it left the queue
    assert after[ids["bb"]]["job_id"] == cancelled and after[ids["bb"]]["error"]
    assert not (results / "held" / f"{ids['bb']}.json").exists()
    # --resume submits only the run without results, and it completes
    resumed = sweep(str(held), *grid, *common, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "--resume: 1 of 2 runs have results already" in resumed.stdout
    assert "submitted 1 Slurm jobs" in resumed.stdout and "1/1 runs succeeded" in resumed.stdout
    assert {r["state"] for r in states(results).values()} == {"done"}
    assert json.loads((results / "held" / f"{ids['bb']}.json").read_text())["metrics"] == {
        "score": 2
    }


def test_a_node_side_failure_names_its_job_and_log(slurm, held, tmp_path):
    results = tmp_path / "sweep"
    failed = sweep(
        str(held), "-p", "method", "broken", "--executor", "slurm",
        "--results-dir", str(results), "--time-limit", "5",
    )  # fmt: skip
    assert failed.returncode == 1
    (row,) = states(results).values()
    line = [text for text in failed.stderr.splitlines() if text.startswith("FAILED")]
    assert line == [
        f"FAILED {row['run_id']} (Slurm job {row['job_id']}): RuntimeError: this combination "
        f"fails on purpose (log: {row['log']})"
    ]
    log = Path(row["log"])
    assert log.parent == records_dir(results, "held") / "slurm"
    assert "this combination fails on purpose" in log.read_text()


def test_a_preempted_job_is_requeued_once_and_finishes(slurm, held, tmp_path):
    """Slurm signals a job it preempts (or that reaches its time limit) with USR2: submitit
    checkpoints the run and requeues it, and the requeued job finishes the run."""
    results = tmp_path / "sweep"
    hold = tmp_path / "hold"
    hold.touch()
    common = ["--executor", "slurm", "--results-dir", str(results), "--time-limit", "5"]
    grid = ["-p", "method", "a", "-p", "hold", str(hold)]
    assert sweep(str(held), *grid, *common, "--detach").returncode == 0
    (record,) = records_dir(results, "held").glob("*.json")
    row = wait_until(  # the run itself says so: its Python handles the signal from then on
        lambda: (r := json.loads(record.read_text()))["state"] == "running" and r,
        "the run to run",
    )
    # what Slurm sends the job's steps before it preempts the job (sbatch --signal=USR2@90)
    subprocess.run(["scancel", "--signal=USR2", row["job_id"]], check=True)
    wait_until(lambda: json.loads(record.read_text()).get("requeued"), "the run to be requeued")
    # Slurm holds a requeued job for about two minutes (its BeginTime); start it sooner, but
    # not within the second of the requeue: slurmd refuses a launch whose credential dates
    # from the second in which the job's earlier credential was revoked ("Job credential
    # revoked"), and the job then ends without running. Two seconds later, the new
    # credential is newer than the revocation.
    job = row["job_id"]
    wait_until(lambda: queue_states([job]).get(job) == "PENDING", "the job to be pending again")
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now+2"], check=True)
    hold.unlink()
    (done,) = wait_until(
        lambda: (s := states(results)) and all(r["state"] == "done" for r in s.values()) and s,
        "the requeued run to finish",
    ).values()
    assert done["job_id"] == row["job_id"]  # scontrol requeue keeps the job id
    assert (results / "held" / f"{row['run_id']}.json").is_file()
