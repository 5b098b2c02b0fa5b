"""End to end on a real SLURM cluster (two emulated nodes on this host, CPU, gloo): the real slurm/train.sbatch
running the real train.py with the tiny recipe, 2 nodes x 2 tasks, hpZ size 2.

Two jobs are submitted together at the start and run side by side: a reference run, and the same run that is
sent USR1 (as SLURM's time-limit warning would) after its first steps, so it checkpoints, exits with the
requeue code, is requeued by the batch script, and finishes from the checkpoint. Its loss curve must equal the
reference's step for step, in one W&B run.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import Background
from slurm_testlib import REPO, SlurmCluster

SBATCH = REPO / "slurm" / "train.sbatch"
STEPS = 12
NODES_OF_RANKS = ["node1", "node1", "node2", "node2"]


def overrides(data: Path, output_dir: Path, name: str) -> list[str]:
    return [
        f"data.train.0.path={data}",
        f"run.output_dir={output_dir}",
        f"run.name={name}",
        f"train.steps={STEPS}",
        "train.log_interval=1",
        "train.eval_interval=0",
        "schedule.warmup_steps=2",
        "zero.zero_hpz_partition_size=2",
        "wandb.group=slurm tests",  # a space: overrides must reach train.py unchanged
    ]


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def layout_from_log(log: str) -> dict:
    match = re.search(r"node layout: (\{.*\})", log)
    assert match, "rank 0 logged no node layout"
    return json.loads(match.group(1))


@pytest.fixture(scope="module")
def jobs(slurm_cluster: SlurmCluster, tiny_data: Path, tmp_path_factory) -> Iterator[dict]:
    """Submit the reference and the to-be-preempted job at once (they fit side by side on the two nodes), and
    preempt the second in a background thread as soon as it has trained a step, whichever test runs first."""
    workdir = tmp_path_factory.mktemp("slurm-jobs")
    (workdir / "logs").mkdir()  # sbatch cannot create its --output directory
    submitted: dict = {"workdir": workdir}
    # W&B only where the test looks at it: the offline writer costs start-up time on a loaded machine.
    for name, wandb_mode in (("reference", "disabled"), ("preempted", "offline")):
        submitted[name] = slurm_cluster.sbatch(
            "--nodes=2", "--ntasks-per-node=2", f"--job-name={name}", str(SBATCH), "tiny_llama",
            *overrides(tiny_data, workdir / "runs", name), f"wandb.mode={wandb_mode}",
            cwd=workdir, env={"ZEROTRAIN_ROOT": str(REPO)},
        )
    preemption = Background(_preempt_and_release, slurm_cluster, submitted["preempted"],
                             workdir / "runs" / "preempted" / "metrics.jsonl")
    yield {**submitted, "preemption": preemption}
    preemption.join(timeout=1)
    for name in ("reference", "preempted"):  # leave nothing running after a failure
        slurm_cluster.run("scancel", str(submitted[name]), check=False)


def test_hpz_job_trains_on_two_nodes_with_intra_node_groups(slurm_cluster, jobs):
    info = slurm_cluster.wait(jobs["reference"], ("COMPLETED",), timeout=600)
    assert info["ExitCode"] == "0:0"
    workdir = jobs["workdir"]
    run_dir = workdir / "runs" / "reference"

    curve = losses(run_dir)
    assert sorted(curve) == list(range(1, STEPS + 1))
    values = [curve[s] for s in sorted(curve)]
    assert values[-1] < values[0] - 0.3, f"loss did not fall: {values}"
    assert sum(b < a for a, b in itertools.pairwise(values)) >= len(values) - 3, f"loss mostly not falling: {values}"

    rank0_log = (workdir / "logs" / f"reference-{jobs['reference']}" / "rank-0.out").read_text()
    layout = layout_from_log(rank0_log)
    # ranks 0-1 on node1, 2-3 on node2 (from each rank's SLURMD_NODENAME)
    assert layout["node_of_rank"] == NODES_OF_RANKS
    assert layout["hpz_size"] == 2 and layout["hpz_groups"] == [[0, 1], [2, 3]]
    for group in layout["hpz_groups"]:
        assert len({layout["node_of_rank"][r] for r in group}) == 1, f"hpZ group {group} crosses nodes"
    assert "group: slurm tests" in (run_dir / "config.yaml").read_text()  # the override arrived unchanged


def _preempt_and_release(cluster: SlurmCluster, job_id: int, metrics: Path) -> None:
    """Send USR1 to the batch shell after the first logged steps (what --signal=B:USR1@N does near the time
    limit), then release the requeued job: it would wait ~120 s (BeginTime), and releasing it works only >= 2 s
    after the requeue."""
    deadline = time.monotonic() + 420
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 1):
        assert cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING"), "job ended before it could be signalled"
        assert time.monotonic() < deadline, "no training step logged in time"
        time.sleep(0.25)
    cluster.run("scancel", "--signal=USR1", "--batch", str(job_id))
    cluster.wait(job_id, ("PENDING",), timeout=240, poll=0.5)
    time.sleep(2.5)
    for _ in range(10):
        cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        try:
            cluster.wait(job_id, ("RUNNING", "COMPLETING", "COMPLETED"), timeout=5)
            return
        except AssertionError:
            continue
    raise AssertionError(f"job {job_id} was not released after its requeue")


def test_preempted_job_checkpoints_requeues_and_continues_the_same_curve(slurm_cluster, jobs):
    workdir, job_id = jobs["workdir"], jobs["preempted"]
    run_dir = workdir / "runs" / "preempted"
    jobs["preemption"].result(timeout=700)
    info = slurm_cluster.wait(job_id, ("COMPLETED",), timeout=420)
    assert info["ExitCode"] == "0:0" and info["Restarts"] == "1"

    batch_log = (workdir / "logs" / f"preempted-{job_id}.out").read_text()
    assert "got SIGUSR1: forwarding" in batch_log and f"requeueing job {job_id}" in batch_log
    rank0_log = (workdir / "logs" / f"preempted-{job_id}" / "rank-0.out").read_text()
    stopped = re.search(r"preempted at step (\d+): checkpoint saved", rank0_log)
    assert stopped and 1 <= int(stopped.group(1)) < STEPS, "the job was not stopped mid-run by the signal"
    assert re.search(rf"resumed from .*step_0*{stopped.group(1)}\b", rank0_log), "the requeued job did not resume"

    slurm_cluster.wait(jobs["reference"], ("COMPLETED",), timeout=420)
    assert losses(run_dir) == losses(workdir / "runs" / "reference")  # step for step, exactly

    run_ids = {p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")}
    assert len(run_ids) == 1, f"the requeued job started a new W&B run: {sorted(run_ids)}"


def test_unreachable_rendezvous_fails_in_bounded_time_with_a_clear_error(slurm_cluster):
    probe = str(Path(__file__).with_name("rendezvous_probe.py"))
    env = {**slurm_cluster.env, "PYTHONPATH": str(REPO), "ZEROTRAIN_RENDEZVOUS_TIMEOUT": "3"}
    srun = ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--job-name=rdzv", sys.executable, probe]

    started = time.monotonic()
    result = subprocess.run(srun, check=False, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 3, result.stdout + result.stderr
    assert "rank 0: rendezvous ok" in result.stdout  # rank 0 could listen, but never does
    message = re.search(r"FAILED after ([\d.]+)s: (.*)", result.stderr)
    assert message and 2.0 <= float(message.group(1)) < 10, result.stderr
    assert re.search(r"rank 1 on node node2: cannot reach the rendezvous node1:\d+", message.group(2))
    assert "firewall" in message.group(2) and elapsed < 60

    result = subprocess.run([*srun, "node9.invalid"], check=False, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    for rank, node in ((0, "node1"), (1, "node2")):
        assert f"rank {rank} on node {node}: cannot resolve the rendezvous host MASTER_ADDR='node9.invalid'" in \
            result.stderr
    assert "localhost" not in result.stdout + result.stderr
