"""SLURM variables -> torch.distributed environment, and the launch train.sbatch renders (no cluster needed)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerotrain.launch.slurm import (
    MASTER_PORT_BASE,
    MASTER_PORT_SPAN,
    SlurmEnvError,
    apply_slurm_env,
    launch_info,
    master_port,
    parse_tasks_per_node,
    scontrol_hostnames,
)

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "train.sbatch"


def fake_hostnames(nodelist: str) -> list[str]:
    """What `scontrol show hostnames` prints for the node lists used below."""
    table = {"gpu[01-04]": ["gpu01", "gpu02", "gpu03", "gpu04"], "node[1-2]": ["node1", "node2"]}
    return table[nodelist]


def srun_task_env(rank: int, nodes: int = 4, per_node: int = 8, job_id: str = "123456") -> dict[str, str]:
    """The variables srun gives task ``rank`` of a block-distributed step (what slurmstepd exports)."""
    node = rank // per_node
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % per_node),
        "SLURM_NODEID": str(node),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_STEP_NODELIST": "gpu[01-04]",
        "SLURM_JOB_NODELIST": "gpu[01-04]",
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURMD_NODENAME": f"gpu{node + 1:02d}",
    }


@pytest.mark.parametrize(
    "spec, expected",
    [("8", [8]), ("4(x2)", [4, 4]), ("4(x2),3", [4, 4, 3]), ("2,1(x3),5", [2, 1, 1, 1, 5]), ("16(x128)", [16] * 128)],
)
def test_tasks_per_node_forms_expand(spec, expected):
    assert parse_tasks_per_node(spec) == expected


@pytest.mark.parametrize("spec", ["", "4(x)", "x2", "4(2)", "four"])
def test_malformed_tasks_per_node_is_an_error(spec):
    with pytest.raises(SlurmEnvError, match="tasks-per-node"):
        parse_tasks_per_node(spec)


def test_master_port_is_derived_from_job_id_in_fixed_range():
    assert master_port("123456") == MASTER_PORT_BASE + 3456
    assert master_port(123457) == master_port("123456") + 1  # consecutive jobs on one node do not collide
    ports = {master_port(j) for j in range(0, 200_000, 7)}
    assert min(ports) >= MASTER_PORT_BASE and max(ports) < MASTER_PORT_BASE + MASTER_PORT_SPAN
    assert MASTER_PORT_BASE + MASTER_PORT_SPAN <= 32768  # below Linux's ephemeral port range


@pytest.mark.parametrize(
    "rank, expected",
    [
        (0, {"RANK": "0", "LOCAL_RANK": "0", "NODE_RANK": "0"}),
        (7, {"RANK": "7", "LOCAL_RANK": "7", "NODE_RANK": "0"}),
        (8, {"RANK": "8", "LOCAL_RANK": "0", "NODE_RANK": "1"}),
        (31, {"RANK": "31", "LOCAL_RANK": "7", "NODE_RANK": "3"}),
    ],
)
def test_per_rank_env_for_4_nodes_x_8_gpus(rank, expected):
    environ = srun_task_env(rank)
    info = apply_slurm_env(environ, hostnames=fake_hostnames)
    assert info is not None and info.node_name == f"gpu{int(expected['NODE_RANK']) + 1:02d}"
    port = str(MASTER_PORT_BASE + 3456)
    common = {"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "gpu01", "MASTER_PORT": port}
    assert {k: environ[k] for k in [*expected, *common]} == {**expected, **common}
    assert environ["GROUP_RANK"] == environ["NODE_RANK"]


def test_uneven_nodes_take_their_own_task_count():
    environ = {**srun_task_env(0, nodes=2), "SLURM_NTASKS": "7", "SLURM_PROCID": "5", "SLURM_NODEID": "1",
               "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4,3", "SLURM_STEP_NODELIST": "node[1-2]"}
    info = launch_info(environ, fake_hostnames)
    assert (info.local_world_size, info.master_addr) == (3, "node1")


def test_ntasks_per_node_used_when_no_step_counts():
    environ = srun_task_env(9)
    del environ["SLURM_STEP_TASKS_PER_NODE"], environ["SLURM_TASKS_PER_NODE"]
    environ["SLURM_NTASKS_PER_NODE"] = "8"
    assert launch_info(environ, fake_hostnames).local_world_size == 8


def test_stale_rendezvous_from_submitting_shell_is_overwritten():
    environ = {**srun_task_env(8), "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
    apply_slurm_env(environ, hostnames=fake_hostnames)
    assert (environ["MASTER_ADDR"], environ["MASTER_PORT"]) == ("gpu01", str(MASTER_PORT_BASE + 3456))


def test_master_port_override():
    environ = {**srun_task_env(3), "ZEROTRAIN_MASTER_PORT": "23456"}
    assert apply_slurm_env(environ, hostnames=fake_hostnames).master_port == 23456


def test_nothing_happens_outside_slurm_or_under_torchrun():
    plain = {"PATH": "/usr/bin"}
    assert apply_slurm_env(plain, hostnames=fake_hostnames) is None and plain == {"PATH": "/usr/bin"}
    torchrun = {**srun_task_env(5), "RANK": "2", "WORLD_SIZE": "4"}
    before = dict(torchrun)
    assert apply_slurm_env(torchrun, hostnames=fake_hostnames) is None and torchrun == before


def test_batch_shell_without_srun_is_a_single_process():
    # What the batch shell of `sbatch -N2 --ntasks-per-node=2` really has: rank-like variables, but no step.
    batch_shell = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                   "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x2)",
                   "SLURM_JOB_NODELIST": "node[1-2]"}
    assert apply_slurm_env(batch_shell, hostnames=fake_hostnames) is None and "RANK" not in batch_shell


def test_unexpandable_nodelist_fails_loudly_instead_of_localhost():
    def broken(nodelist):
        raise SlurmEnvError(f"'scontrol show hostnames {nodelist}' failed")

    environ = srun_task_env(0)
    with pytest.raises(SlurmEnvError, match="scontrol show hostnames"):
        apply_slurm_env(environ, hostnames=broken)
    assert "MASTER_ADDR" not in environ


def test_missing_scontrol_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SlurmEnvError, match="'scontrol' is not on PATH"):
        scontrol_hostnames("node[1-2]")


def test_rank_outside_world_is_an_error():
    environ = {**srun_task_env(0), "SLURM_PROCID": "32"}
    with pytest.raises(SlurmEnvError, match="SLURM_PROCID=32"):
        launch_info(environ, fake_hostnames)


# ---- the launch rendered by slurm/train.sbatch, with a fake allocation ----------------------------------------


def render_launch(extra_env: dict[str, str], *args: str) -> tuple[list[str], dict[str, str]]:
    """Run train.sbatch in dry-run mode: the exact srun argv and the variables it exports for the tasks."""
    env = {"PATH": os.environ["PATH"], "SLURM_SUBMIT_DIR": str(REPO), "ZEROTRAIN_DRY_RUN": "1", **extra_env}
    out = subprocess.run(
        ["bash", str(SBATCH), *args], env=env, cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    fields = out.rstrip("\0").split("\0")
    split = fields.index("")
    return fields[:split], dict(f.split("=", 1) for f in fields[split + 1 :])


ALLOCATION_4X8 = {
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NAME": "zerotrain",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_JOB_NODELIST": "gpu[01-04]",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_NTASKS_PER_NODE": "8",
    "SLURM_TASKS_PER_NODE": "8(x4)",
    "SLURM_CPUS_ON_NODE": "96",
    "ZEROTRAIN_PYTHON": "/opt/env/bin/python",
}


def test_srun_line_for_4_nodes_x_8_gpus_passes_overrides_unchanged():
    overrides = ["train.steps=2000", "wandb.tags=[hpz, 4 nodes]", "run.name=it's $HOME `x`", "optim.lr=1e-5"]
    argv, env = render_launch(ALLOCATION_4X8, "llama2_7b", *overrides)
    assert argv == [
        "srun", "--nodes=4", "--ntasks=32", "--ntasks-per-node=8", "--distribution=block", "--kill-on-bad-exit=1",
        "--wait=120", f"--output={REPO}/logs/zerotrain-123456/rank-%t.out", "--open-mode=append",
        # the tasks start with the stop signals blocked until train.py's first lines (coreutils >= 8.31 here)
        "env", "--block-signal=USR1", "--block-signal=TERM",
        "/opt/env/bin/python", "-u", "train.py", "recipe=llama2_7b", *overrides,
    ]  # fmt: skip
    assert env == {
        "OMP_NUM_THREADS": "12",  # 96 CPUs / 8 tasks
        "TORCH_EXTENSIONS_DIR": f"{REPO}/.cache/torch_extensions",
        "DS_ACCELERATOR": "",  # GPUs: DeepSpeed detects CUDA itself
        "ZEROTRAIN_READY_DIR": f"{REPO}/logs/zerotrain-123456/.ready",  # where each task says its handlers exist
    }


def test_gpu_job_without_matching_tasks_per_node_is_refused():
    allocation = {**ALLOCATION_4X8, "SLURM_NTASKS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1(x4)"}
    env = {"PATH": os.environ["PATH"], "SLURM_SUBMIT_DIR": str(REPO), "ZEROTRAIN_DRY_RUN": "1", **allocation}
    result = subprocess.run(["bash", str(SBATCH), "llama2_7b"], env=env, cwd=REPO, capture_output=True, text=True,
                            check=False)
    assert result.returncode == 2 and "add --ntasks-per-node=8" in result.stderr


def test_cpu_job_takes_tasks_per_node_from_slurm_and_uses_cpu_accelerator():
    allocation = {"SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "tiny", "SLURM_JOB_NUM_NODES": "2",
                  "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_CPUS_ON_NODE": "4"}
    argv, env = render_launch(allocation, "tiny_llama", "zero.zero_hpz_partition_size=2")
    assert argv[1:4] == ["--nodes=2", "--ntasks=4", "--ntasks-per-node=2"]
    assert argv[-2:] == ["recipe=tiny_llama", "zero.zero_hpz_partition_size=2"]
    assert env["DS_ACCELERATOR"] == "cpu" and env["OMP_NUM_THREADS"] == "2"


# ---- before srun: the time limit against the warning's lead, and the interpreter ---------------------------------


def test_time_limit_shorter_than_the_signal_lead_plus_startup_is_warned_about():
    def stderr_for(seconds_left: int, **extra: str) -> str:
        allocation = {**ALLOCATION_4X8, "SLURM_JOB_END_TIME": str(int(time.time()) + seconds_left), **extra}
        env = {"PATH": os.environ["PATH"], "SLURM_SUBMIT_DIR": str(REPO), "ZEROTRAIN_DRY_RUN": "1", **allocation}
        return subprocess.run(["bash", str(SBATCH), "llama2_7b"], env=env, cwd=REPO, capture_output=True, text=True,
                              check=True).stderr

    short = stderr_for(600)  # a newcomer's --time=10: the USR1 comes at once
    assert "warning: the job's time limit is" in short and "--signal=B:USR1@600" in short
    assert "Ask for --time=25 (minutes) or more" in short
    assert stderr_for(2 * 3600) == ""  # the control: a limit well past lead + margin says nothing
    assert stderr_for(600, ZEROTRAIN_SIGNAL_LEAD="120") == ""  # a shorter lead, declared, fits in 10 minutes


def run_batch_script(tmp_path: Path, python: str) -> tuple[subprocess.CompletedProcess, list[str] | None]:
    """The real train.sbatch, not a dry run, in a fake CPU allocation, with a recording srun on PATH."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "srun-argv"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" > "{calls}"\n')
    (bin_dir / "srun").chmod(0o755)
    allocation = {"SLURM_JOB_ID": "88", "SLURM_JOB_NAME": "t", "SLURM_JOB_NUM_NODES": "1",
                  "SLURM_TASKS_PER_NODE": "2", "SLURM_CPUS_ON_NODE": "2", "ZEROTRAIN_PYTHON": python}
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "ZEROTRAIN_ROOT": str(REPO),
           **allocation}
    result = subprocess.run(["bash", str(SBATCH), "tiny_llama"], env=env, cwd=tmp_path, capture_output=True,
                            text=True, check=False, timeout=60)
    argv = calls.read_text().rstrip("\0").split("\0") if calls.exists() else None
    return result, argv


def test_an_interpreter_without_the_packages_is_refused_before_srun(tmp_path):
    result, argv = run_batch_script(tmp_path, "/usr/bin/python3")  # the system Python: no torch, no DeepSpeed
    if result.returncode == 0:
        pytest.skip("/usr/bin/python3 has the training packages here")
    assert result.returncode == 2 and argv is None, result.stderr
    assert "interpreter '/usr/bin/python3' (ZEROTRAIN_PYTHON) cannot import:" in result.stderr
    assert "torch" in result.stderr and "export ZEROTRAIN_PYTHON=<env>/bin/python" in result.stderr

    result, argv = run_batch_script(tmp_path, str(tmp_path / "no-such-python"))
    assert result.returncode == 2 and argv is None and "not found or not executable" in result.stderr

    # The control: the project's interpreter passes, and srun gets the task line.
    result, argv = run_batch_script(tmp_path, sys.executable)
    assert result.returncode == 0, result.stderr
    assert argv[:3] == ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2"] and sys.executable in argv
