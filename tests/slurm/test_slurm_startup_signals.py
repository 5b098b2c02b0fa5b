"""SLURM signals at every moment of start-up, on the real cluster: each one is honoured (a checkpoint at the first
step, exit 75, a requeue, a resume), never the default action that used to fail the job.

Two jobs (2 nodes x 2 tasks, the real slurm/train.sbatch and train.py) run side by side and are signalled at a
different moment of each start, so 3 requeues per job cover 6 moments:

* job ``early``: USR1 to the batch shell (``scancel --signal=USR1 --batch``, what ``--signal=B:USR1@N`` does) while
  the batch script checks its interpreter (before srun), then while the tasks' interpreters start, then during the
  engine build (the trainer's handler exists);
* job ``late``: USR1 to the batch shell the moment srun is launched, then USR1 straight to the tasks while their
  interpreters start (``scancel --signal=USR1``, no ``--batch``: the tasks start with it blocked), then
  ``scontrol requeue`` after a step, which the run must call a requeue.

The interpreter is a wrapper that sleeps 3 s before starting Python (a slow shared file system), so the start-up
moments last long enough to be hit from outside. The control: the same batch script with the old behaviour (no
hold: ``ZEROTRAIN_SIGNAL_HOLD=0``; tasks not started blocked), signalled while the tasks start, FAILS of the signal.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from processes import Background
from slurm_testlib import REPO, SlurmCluster, report

from tools.launcher import PYTHON

SBATCH = REPO / "slurm" / "train.sbatch"
STEPS = 30
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
Moment = tuple[str, Callable[[int, int, Path], bool], str]  # name, predicate(job, start, workdir), how to signal


def job_processes(job_id: int, start: int, wanted: Callable[[list[str]], bool]) -> bool:
    """Whether a process of start ``start`` (SLURM_RESTART_COUNT) of job ``job_id`` on this host has a ``wanted``
    argv (read first: it rules most processes out without reading their environment)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = [a.decode(errors="replace") for a in
                    Path(f"/proc/{entry}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")]
            if not wanted(argv):
                continue
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        restart = next((int(e.split(b"=", 1)[1]) for e in environ if e.startswith(b"SLURM_RESTART_COUNT=")), 0)
        if f"SLURM_JOB_ID={job_id}".encode() in environ and restart == start:
            return True
    return False


def checking_interpreter(job_id: int, start: int, _workdir: Path) -> bool:  # train.sbatch's check, before srun
    return job_processes(job_id, start, lambda argv: any("find_spec" in a for a in argv))


def srun_launched(job_id: int, start: int, _workdir: Path) -> bool:
    return job_processes(job_id, start, lambda argv: Path(argv[0]).name == "srun")


def task_starting(job_id: int, start: int, _workdir: Path) -> bool:  # a task exists, inside its interpreter's start
    return job_processes(job_id, start, lambda argv: Path(argv[0]).name != "srun" and "train.py" in argv)


def rank0_log(workdir: Path, name: str, job_id: int) -> Path:
    return workdir / "logs" / f"{name}-{job_id}" / "rank-0.out"


def building_engine(job_id: int, start: int, workdir: Path) -> bool:  # the layout is logged just before the engine
    log = rank0_log(workdir, "early", job_id)
    return log.exists() and log.read_text().count("node layout: ") > start


def trained_a_step(job_id: int, start: int, workdir: Path) -> bool:  # this start logged a step (steps 1-2 earlier)
    metrics = workdir / "runs" / "late" / "metrics.jsonl"
    return metrics.exists() and any(json.loads(line).get("step", 0) > start for line in metrics.read_text().splitlines()
                                    if line.endswith("}"))


MOMENTS: dict[str, list[Moment]] = {
    "early": [("batch script start", checking_interpreter, "batch"), ("interpreter start", task_starting, "batch"),
              ("engine build", building_engine, "batch")],
    "late": [("srun launch", srun_launched, "batch"), ("interpreter start, to the tasks", task_starting, "tasks"),
             ("scontrol requeue after a step", trained_a_step, "requeue")],
}


def signal_job(cluster: SlurmCluster, job_id: int, how: str) -> None:
    if how == "batch":
        cluster.run("scancel", "--signal=USR1", "--batch", str(job_id))
    elif how == "tasks":
        cluster.run("scancel", "--signal=USR1", str(job_id))
    else:
        cluster.run("scontrol", "requeue", str(job_id))


def release_after_requeue(cluster: SlurmCluster, job_id: int, restarts: int, timeout: float = 600) -> None:
    """Wait until the job is back in the queue with ``restarts`` restarts, then start it now (not in ~120 s)."""
    deadline = time.monotonic() + timeout
    while True:
        info = cluster.job(job_id)
        if info.get("JobState") == "PENDING" and int(info.get("Restarts", 0)) >= restarts:
            break
        assert info.get("JobState") not in ENDED, f"job {job_id} ended {info.get('JobState')} instead of a requeue"
        assert time.monotonic() < deadline, f"job {job_id} not requeued: {info.get('JobState')}"
        time.sleep(0.5)
    time.sleep(2.5)  # SLURM refuses to move a job's start time within ~2 s of its requeue
    for _ in range(20):
        cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
        time.sleep(1)
        if cluster.job(job_id).get("JobState") != "PENDING":
            return
    raise AssertionError(f"job {job_id} was not released after its requeue")


def drive(cluster: SlurmCluster, job_id: int, moments: list[Moment], workdir: Path) -> list[str]:
    """Signal the job at each moment in turn, releasing it after each requeue; the moments signalled, in order."""
    sent: list[str] = []
    for start, (name, reached, how) in enumerate(moments):
        deadline = time.monotonic() + 600
        while not reached(job_id, start, workdir):
            state = cluster.job(job_id).get("JobState")
            assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job_id} {state} before '{name}'"
            assert time.monotonic() < deadline, f"job {job_id} never reached '{name}'"
            time.sleep(0.05)
        signal_job(cluster, job_id, how)
        sent.append(name)
        report(f"job {job_id} start {start}: signalled at {name} ({how})")
        release_after_requeue(cluster, job_id, start + 1)
    return sent


def slow_interpreter(workdir: Path) -> Path:
    """An interpreter that takes 3 s to start, as on a slow shared file system."""
    path = workdir / "slow-python"
    path.write_text(f'#!/bin/bash\nsleep 3\nexec {PYTHON} "$@"\n')
    path.chmod(0o755)
    return path


def old_behaviour_script(workdir: Path) -> Path:
    """train.sbatch with its tasks started unblocked (run with ZEROTRAIN_SIGNAL_HOLD=0: no hold either)."""
    source = SBATCH.read_text()
    blocking = "  BLOCK_SIGNALS=(env --block-signal=USR1 --block-signal=TERM)\n"
    assert blocking in source
    path = workdir / "train-unprotected.sbatch"
    path.write_text(source.replace(blocking, "  :\n"))
    return path


@pytest.fixture(scope="module")
def jobs(slurm_cluster: SlurmCluster, tiny_data: Path, tmp_path_factory) -> Iterator[dict]:
    workdir = tmp_path_factory.mktemp("slurm-startup-signals")
    (workdir / "logs").mkdir()
    env = {"ZEROTRAIN_ROOT": str(REPO), "ZEROTRAIN_PYTHON": str(slow_interpreter(workdir))}
    submitted: dict = {"workdir": workdir}

    def submit(name: str, script: Path, **extra: str) -> int:
        return slurm_cluster.sbatch(
            "--nodes=2", "--ntasks-per-node=2", f"--job-name={name}", str(script), "tiny_llama",
            f"data.train.0.path={tiny_data}", f"run.output_dir={workdir / 'runs'}", f"run.name={name}",
            f"train.steps={STEPS}", "train.log_interval=1", "train.eval_interval=0", "wandb.mode=disabled",
            "zero.zero_hpz_partition_size=2", "cluster.init_timeout_s=900",  # a loaded machine: slow imports
            cwd=workdir, env={**env, **extra})

    for name in MOMENTS:
        submitted[name] = submit(name, SBATCH)
    submitted["control"] = submit("control", old_behaviour_script(workdir), ZEROTRAIN_SIGNAL_HOLD="0")
    submitted["drivers"] = {name: Background(drive, slurm_cluster, submitted[name], MOMENTS[name], workdir)
                           for name in MOMENTS}
    yield submitted
    for name in (*MOMENTS, "control"):
        slurm_cluster.run("scancel", str(submitted[name]), check=False)


def finished(cluster: SlurmCluster, job_id: int, timeout: float = 900) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while (info := cluster.job(job_id)).get("JobState") not in ENDED:
        assert time.monotonic() < deadline, f"job {job_id} still {info.get('JobState')}"
        time.sleep(1)
    return info


def test_the_old_behaviour_fails_of_a_signal_during_task_start_up(slurm_cluster, jobs):
    """The control: no hold, tasks not started blocked, USR1 to the batch shell while the tasks start."""
    job_id = jobs["control"]
    deadline = time.monotonic() + 600
    while not task_starting(job_id, 0, jobs["workdir"]):
        assert slurm_cluster.job(job_id).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING")
        assert time.monotonic() < deadline
        time.sleep(0.05)
    signal_job(slurm_cluster, job_id, "batch")
    info = finished(slurm_cluster, job_id, timeout=300)
    batch_log = (jobs["workdir"] / "logs" / f"control-{job_id}.out").read_text()
    assert info["JobState"] == "FAILED", (info, batch_log[-2000:])
    assert "User defined signal 1" in batch_log, batch_log[-2000:]


def assert_resumed_every_start(run_dir: Path, rank0: str, stops: list[int]) -> None:
    for step in stops:
        assert re.search(rf"resumed from .*step_0*{step}\b", rank0), f"no resume from step {step}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    steps = sorted({r["step"] for r in records if "loss" in r})
    assert steps == list(range(1, STEPS + 1)), steps


def test_signals_before_srun_during_task_start_and_engine_build_are_honoured(slurm_cluster, jobs):
    workdir, job_id = jobs["workdir"], jobs["early"]
    assert jobs["drivers"]["early"].result(timeout=1800) == [m[0] for m in MOMENTS["early"]]
    info = finished(slurm_cluster, job_id)
    batch_log = (workdir / "logs" / f"early-{job_id}.out").read_text()
    rank0 = rank0_log(workdir, "early", job_id).read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "3", info
    # before srun and during the tasks' start: held until every task had its handlers, then passed on
    assert batch_log.count("got SIGUSR1 before every training task has its signal handlers") == 2, batch_log
    assert batch_log.count("forwarding SIGUSR1 to the training tasks, held") == 2
    assert batch_log.count("got SIGUSR1: forwarding to the training tasks") == 1  # engine build: ready at once
    assert batch_log.count(f"checkpoint saved before the time limit: requeueing job {job_id}") == 3
    assert "User defined signal" not in batch_log
    for step in (1, 2, 3):
        assert f"preempted at step {step}: checkpoint saved" in rank0
    assert_resumed_every_start(workdir / "runs" / "early", rank0, [1, 2, 3])


def test_signals_at_srun_launch_straight_to_starting_tasks_and_a_slurm_requeue_are_honoured(slurm_cluster, jobs):
    workdir, job_id = jobs["workdir"], jobs["late"]
    assert jobs["drivers"]["late"].result(timeout=1800) == [m[0] for m in MOMENTS["late"]]
    info = finished(slurm_cluster, job_id)
    batch_log = (workdir / "logs" / f"late-{job_id}.out").read_text()
    rank0 = rank0_log(workdir, "late", job_id).read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "3", info
    assert batch_log.count("got SIGUSR1 before every training task has its signal handlers") == 1, batch_log
    assert "SIGUSR1 received during start-up" in rank0  # straight to a task still in its interpreter's start
    # The script's own requeue after each USR1 stop; after scontrol requeue it must not requeue again. Its line
    # naming SLURM's requeue appears only when SLURM's kill (KillWait) leaves the batch shell time to write it.
    own = f"checkpoint saved before the time limit: requeueing job {job_id}"
    assert batch_log.count(own) == 2 and "User defined signal" not in batch_log, batch_log
    for step in (1, 2):
        assert f"preempted at step {step}: checkpoint saved" in rank0
    # scontrol requeue: SLURM requeues the job itself, and both the run and the batch script say so
    stopped = re.search(r"requeued by SLURM \(SIGTERM: scontrol requeue or a preemption\): checkpoint saved at "
                        r"step (\d+); the job's next start resumes from it", rank0)
    assert stopped, rank0[-3000:]
    assert "not requeued" not in rank0
    # The batch shell did not requeue it a second time (SLURM's KillWait may end it before it logs what SLURM did).
    assert "not requeueing" not in batch_log
    assert_resumed_every_start(workdir / "runs" / "late", rank0, [1, 2, int(stopped.group(1))])
