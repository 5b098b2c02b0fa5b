"""A rank that dies ends the whole SLURM job in bounded time, with the dead task named: killed during start-up
(before the process group forms: the others used to wait 30 minutes) and killed during a step.

Both jobs run side by side on the local 2-node cluster (2 nodes x 2 tasks, the real slurm/train.sbatch and
train.py), started together to share the start-up time. The kill is SIGKILL to task 3 (on node2), as a crash or the
OOM killer would; the bound is srun's --kill-on-bad-exit plus the cluster's KillWait (10 s here) for tasks that
trap SIGTERM, with headroom for a loaded machine.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import Signaller
from slurm_testlib import REPO, SlurmCluster

SBATCH = REPO / "slurm" / "train.sbatch"
BOUND_S = 60
ENDED = ("FAILED", "CANCELLED", "COMPLETED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def first_step_logged(run_dir: Path):
    return lambda _pid: (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip()


@pytest.fixture(scope="module")
def jobs(slurm_cluster: SlurmCluster, tiny_data: Path, tmp_path_factory) -> Iterator[dict]:
    workdir = tmp_path_factory.mktemp("slurm-hangs")
    (workdir / "logs").mkdir()
    submitted: dict = {"workdir": workdir}
    for name in ("startup", "step"):
        submitted[name] = slurm_cluster.sbatch(
            "--nodes=2", "--ntasks-per-node=2", f"--job-name=kill-{name}", str(SBATCH), "tiny_llama",
            f"data.train.0.path={tiny_data}", f"run.output_dir={workdir / 'runs'}", f"run.name={name}",
            "train.steps=200", "train.log_interval=1", "train.eval_interval=0", "wandb.mode=disabled",
            "zero.zero_hpz_partition_size=2", "cluster.init_timeout_s=60",
            cwd=workdir, env={"ZEROTRAIN_ROOT": str(REPO)},
        )
    key = b"SLURM_PROCID"
    submitted["kill_startup"] = Signaller(f"SLURM_JOB_ID={submitted['startup']}", 3, signal.SIGKILL, rank_key=key)
    submitted["kill_step"] = Signaller(f"SLURM_JOB_ID={submitted['step']}", 3, signal.SIGKILL,
                                       ready=first_step_logged(workdir / "runs" / "step"), rank_key=key)
    yield submitted
    for name in ("startup", "step"):
        slurm_cluster.run("scancel", str(submitted[name]), check=False)


def ended_within(cluster: SlurmCluster, job_id: int, since: float) -> tuple[dict[str, str], float]:
    deadline = since + BOUND_S + 120  # past the bound: measure, then fail with the number
    while time.monotonic() < deadline:
        info = cluster.job(job_id)
        if info.get("JobState") in ENDED:
            return info, time.monotonic() - since
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still {info.get('JobState')} {time.monotonic() - since:.0f} s after the kill")


@pytest.mark.parametrize("when", ["startup", "step"])
def test_a_killed_task_ends_the_job_in_bounded_time_and_is_named(slurm_cluster, jobs, when):
    killed_at = jobs[f"kill_{when}"].result(timeout=900)
    info, elapsed = ended_within(slurm_cluster, jobs[when], killed_at)
    assert info["JobState"] == "FAILED" and elapsed < BOUND_S, (info, elapsed)
    batch_log = (jobs["workdir"] / "logs" / f"kill-{when}-{jobs[when]}.out").read_text()
    assert "task 3" in batch_log and "Killed" in batch_log, batch_log[-2000:]
    assert "requeueing" not in batch_log
