"""How a run ends when something goes wrong at launch: a signal during start-up, a user error on every rank, a rank
killed during start-up, a rank that never joins. Real train.py, real torchrun, real processes and signals.

* A SIGUSR1 (SLURM's time-limit warning) during the heavy imports is recorded by the handler train.py installs on
  its first lines, and the run checkpoints at its first step and exits 75 for a requeue (the negative control, the
  same train.py without those lines, dies of the signal: exit 138 in a shell).
* Under ``python -m zerotrain.launch.torchrun`` the run exits with the failed rank's code (2, 75, 128+n), a user
  error is printed once, and a rank killed during start-up is named (plain torchrun: exit 1 for all of them).
* An option refused with hpZ (zero.offload_param) exits 2 naming both keys, before the run directory is written.
* A rank whose peer never joins fails after ``cluster.init_timeout_s`` with a message instead of hanging (the
  control: with the default it is still waiting in the rendezvous).
* A rank stopped (SIGSTOP) during training ends the run after ``cluster.collective_timeout_s``, exit 5, with a
  message naming the key (the control: with the default 30 minutes the run is still waiting).
* Ctrl-C (SIGINT to the launcher's process group) during training ends the run with one line and exit 130; with
  ``checkpoint.on_interrupt=true`` a checkpoint is saved at the step boundary first (plain torchrun: exit 1 and a
  traceback).

A negative control that waits runs at the same time as the launch it controls, so the two waits overlap.
"""

from __future__ import annotations

import dataclasses
import re
import signal
import time
import uuid
from pathlib import Path

import pytest
from processes import Background, Signaller, kill_marked, listening, to_launcher_group

from tools.launcher import PYTHON, REPO, free_port, run

TINY = ["recipe=tiny_llama", "train.log_interval=1", "train.eval_interval=0", "wandb.enabled=false",
        "checkpoint.interval=100", "zero.zero_hpz_partition_size=1"]
WRAPPER = [PYTHON, "-m", "zerotrain.launch.torchrun", "--standalone"]
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone"]


def marked() -> tuple[str, dict[str, str]]:
    """A variable for the launch's environment, and the ``NAME=value`` that finds its processes."""
    value = uuid.uuid4().hex
    return f"ZT_TEST_MARKER={value}", {"ZT_TEST_MARKER": value}


# ---- a signal during start-up --------------------------------------------------------------------------------------


def test_sigusr1_during_startup_is_kept_and_the_run_checkpoints_and_exits_for_requeue(shakespeare, tmp_path):
    args = [*TINY, "train.steps=5", f"data.train.0.path={shakespeare}", f"run.output_dir={tmp_path}", "run.name=r"]
    marker, env = marked()
    signaller = Signaller(marker, 0, signal.SIGUSR1)
    proc = run([PYTHON, "train.py", *args], env=env, check=False, timeout=900)
    signaller.result()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 75, out[-3000:]
    assert "SIGUSR1 received during start-up" in out and "SIGUSR1 from start-up still pending" in out
    assert "preempted at step 1: checkpoint saved" in out
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text() == "step_00000001"


def test_negative_control_without_the_early_handler_sigusr1_kills_the_task(tmp_path):
    """The same launch and signal, train.py without its first-lines handler: the default action ends the task."""
    source = (REPO / "train.py").read_text()
    assert "    install_early_handlers()\n" in source
    unprotected = tmp_path / "train.py"
    unprotected.write_text(source.replace("    install_early_handlers()\n", "    pass\n"))
    marker, env = marked()
    signaller = Signaller(marker, 0, signal.SIGUSR1)
    proc = run([PYTHON, str(unprotected), "recipe=tiny_llama"], env=env, check=False, timeout=300)
    signaller.result()
    assert proc.returncode == -signal.SIGUSR1  # a shell (and SLURM) reports 138


# ---- exit codes and messages under torchrun ----------------------------------------------------------------------


def test_user_error_under_torchrun_exits_2_and_is_printed_once():
    args = ["--nproc_per_node=2", "train.py", "recipe=tiny_llama", "optim.lr=-1"]
    proc = run([*WRAPPER, *args], check=False, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert out.count("optim.lr=-1.0 is out of range") == 1, out[-3000:]
    assert "exit code 2" in proc.stderr

    # Negative control: plain torchrun loses the code.
    plain = run([*TORCHRUN, *args], check=False, timeout=600)
    assert plain.returncode == 1


def test_an_option_refused_with_hpz_exits_2_naming_both_keys_before_anything_is_written(shakespeare, tmp_path):
    """zerotrain.hpz.options at the engine build (docs/hpz.md#option-matrix): hpZ 2 on 2 ranks + parameter offload."""
    args = ["--nproc_per_node=2", "train.py", "recipe=tiny_llama", "zero=zero3_hpz", "zero.offload_param.device=cpu",
            "wandb.enabled=false", f"data.train.0.path={shakespeare}", f"run.output_dir={tmp_path}", "run.name=r"]
    proc = run([*WRAPPER, *args], check=False, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert out.count("zero.offload_param.device=cpu with zero.zero_hpz_partition_size=2 (hpZ) is refused") == 1
    assert "issues/6926" in out and "Traceback" not in out
    assert not (tmp_path / "r").exists()  # refused before the run directory was written


def test_rank_killed_during_startup_is_named_and_ends_the_run():
    marker, env = marked()
    signaller = Signaller(marker, 1, signal.SIGKILL)
    proc = run([*WRAPPER, "--nproc_per_node=2", "train.py", "recipe=tiny_llama"], env=env, check=False, timeout=600)
    ended = time.monotonic() - signaller.result()
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-3000:]
    assert "rank 1 (local rank 1, pid" in proc.stderr and "was killed by SIGKILL" in proc.stderr
    assert ended < 60, f"the run took {ended:.0f} s to end after rank 1 died"


def test_rank_killed_during_a_step_is_named_and_ends_the_run(shakespeare, tmp_path):
    marker, env = marked()
    metrics = tmp_path / "s" / "metrics.jsonl"
    signaller = Signaller(marker, 1, signal.SIGKILL, ready=lambda _pid: metrics.exists() and metrics.read_text())
    args = [*TINY, "train.steps=200", f"data.train.0.path={shakespeare}", f"run.output_dir={tmp_path}", "run.name=s"]
    proc = run([*WRAPPER, "--nproc_per_node=2", "train.py", *args], env=env, check=False, timeout=900)
    ended = time.monotonic() - signaller.result()
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr[-3000:]
    assert "rank 1 (local rank 1, pid" in proc.stderr and "was killed by SIGKILL" in proc.stderr
    assert ended < 60, f"the run took {ended:.0f} s to end after rank 1 died"


# ---- a rank that stops during training ----------------------------------------------------------------------------
# Two 2-rank launches at once (what they mostly do is wait: their waits overlap), rank 1 of each SIGSTOPped once the
# first step is logged: one with cluster.collective_timeout_s=10, and its negative control with the default (30
# minutes), which must still be waiting 15 s after the first one ended; then it is killed.


def stopped_rank_launch(shakespeare, tmp_path: Path, *args: str) -> tuple[Background, Signaller, str]:
    """A 2-rank run in the background whose rank 1 is SIGSTOPped once the first step is logged: (the launch, its
    signaller, its marker)."""
    marker, env = marked()
    metrics = tmp_path / "t" / "metrics.jsonl"
    signaller = Signaller(marker, 1, signal.SIGSTOP, ready=lambda _pid: metrics.exists() and metrics.read_text())
    run_args = [*TINY, "train.steps=500", f"data.train.0.path={shakespeare}", f"run.output_dir={tmp_path}",
                "run.name=t", *args]
    # The launcher's timeout kills the whole tree (SIGKILL ends a stopped process too).
    launch = Background(run, [*WRAPPER, "--nproc_per_node=2", "train.py", *run_args], env=env, check=False,
                        timeout=600)
    return launch, signaller, marker


@pytest.fixture(scope="module")
def stopped_ranks(shakespeare, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("stopped")
    timed, timed_signal, _ = stopped_rank_launch(shakespeare, root / "timed", "cluster.collective_timeout_s=10")
    default, default_signal, default_marker = stopped_rank_launch(shakespeare, root / "default")
    try:
        proc = timed.result(timeout=600)
        ended = time.monotonic() - timed_signal.result()
        stopped_at = default_signal.result(timeout=600)
        time.sleep(max(0.0, stopped_at + ended + 15 - time.monotonic()))
        waiting = default.is_alive()  # checked before the kill below ends it
    finally:
        kill_marked(default_marker)
    return {"timed": proc, "ended": ended, "default_waiting": waiting, "default": default.result(timeout=600)}


def test_a_stopped_rank_ends_the_run_after_the_collective_timeout(stopped_ranks):
    proc, ended = stopped_ranks["timed"], stopped_ranks["ended"]
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert "a collective waited 10 s (cluster.collective_timeout_s)" in proc.stderr, proc.stderr[-3000:]
    assert "rank 0:" in proc.stderr and "Traceback" not in proc.stderr
    assert ended < 60, f"the run took {ended:.0f} s to end after rank 1 stopped"

    # Negative control: with the default (30 minutes) the same run, started at the same time, is still waiting 15 s
    # past that moment after its own rank 1 stopped (then it is killed: no timeout message).
    assert stopped_ranks["default_waiting"], stopped_ranks["default"].stderr[-3000:]
    assert "cluster.collective_timeout_s" not in stopped_ranks["default"].stderr


# ---- Ctrl-C ------------------------------------------------------------------------------------------------------


def interrupted_run(shakespeare, tmp_path: Path, *args: str):
    """A 2-rank run under the wrapper that gets Ctrl-C (SIGINT to its process group) once a step is logged."""
    marker, env = marked()
    metrics = tmp_path / "c" / "metrics.jsonl"
    signaller = Signaller(marker, 0, signal.SIGINT, ready=lambda _pid: metrics.exists() and "loss" in
                          metrics.read_text(), send=to_launcher_group)
    run_args = [*TINY, "train.steps=500", f"data.train.0.path={shakespeare}", f"run.output_dir={tmp_path}",
                "run.name=c", *args]
    proc = run([*WRAPPER, "--nproc_per_node=2", "train.py", *run_args], env=env, check=False, timeout=900)
    signaller.result()
    return proc, proc.stdout + proc.stderr, tmp_path / "c" / "checkpoints"


def test_ctrl_c_with_checkpoint_on_interrupt_saves_at_the_step_boundary_and_exits_130(shakespeare, tmp_path):
    proc, out, root = interrupted_run(shakespeare, tmp_path, "checkpoint.on_interrupt=true")
    assert proc.returncode == 130, out[-3000:]
    saved = re.findall(r"interrupted \(SIGINT\): checkpoint saved at step (\d+) \(checkpoint.on_interrupt=true\); "
                       r"relaunch the same command to continue from it", out)
    assert len(saved) == 1, out[-3000:]
    assert (root / "latest").read_text() == f"step_{int(saved[0]):08d}"
    assert out.count("SIGINT received: will checkpoint") == 1, "acknowledged once, by rank 0"
    assert "Traceback" not in out and "death signal" not in out and "closing signal" not in out


def test_ctrl_c_stops_at_once_in_one_line_and_exits_130(shakespeare, tmp_path):
    """The control of the one above: without checkpoint.on_interrupt no checkpoint is saved."""
    proc, out, root = interrupted_run(shakespeare, tmp_path)
    assert proc.returncode == 130, out[-3000:]
    lines = [line for line in out.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and re.fullmatch(
        r"interrupted: after step \d+, no checkpoint saved on the way out: no checkpoint exists yet; "
        r"checkpoint.on_interrupt=true saves one at the step boundary first", lines[0]), out[-3000:]
    assert not (root / "latest").exists()
    assert "Traceback" not in out and "death signal" not in out


def test_negative_control_plain_torchrun_exits_1_with_a_traceback_on_ctrl_c():
    marker, env = marked()
    signaller = Signaller(marker, 0, signal.SIGINT, send=to_launcher_group)  # during the ranks' start-up
    proc = run([*TORCHRUN, "--nproc_per_node=2", "train.py", "recipe=tiny_llama"], env=env, check=False, timeout=600)
    signaller.result()
    assert proc.returncode == 1 and "SignalException" in proc.stderr, proc.stderr[-3000:]


# ---- a rank that never joins -------------------------------------------------------------------------------------


def lone_rank_zero(tmp_path: Path, *args: str, port: int, env: dict[str, str], timeout: float):
    """Rank 0 of a world of 2 whose rank 1 never starts (as if killed before it joined)."""
    data = tmp_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "manifest.json").write_text("{}")  # train.py's input check; the process group is formed before data
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), **env}
    return run([PYTHON, "train.py", "recipe=tiny_llama", f"data.train.0.path={data}", f"run.output_dir={tmp_path}",
                *args], env=env, check=False, timeout=timeout)


def test_a_rank_that_never_joins_fails_after_the_init_timeout(tmp_path):
    # The negative control, with the default (300 s), starts at the same moment (both mostly wait).
    marker, env = marked()
    control_port = free_port()
    control = Background(lone_rank_zero, tmp_path / "default", port=control_port, env=env, timeout=600)
    started = time.monotonic()
    try:
        proc = lone_rank_zero(tmp_path / "timed", "cluster.init_timeout_s=5", port=free_port(), env={}, timeout=300)
        failed_after = time.monotonic() - started
        time.sleep(max(0.0, started + failed_after + 15 - time.monotonic()))
        waiting = control.is_alive() and listening(control_port)  # checked before the kill below ends it
    finally:
        kill_marked(marker)
    killed = control.result(timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "rank 0 on node" in proc.stderr and "the process group did not form within 5 s" in proc.stderr
    assert "cluster.init_timeout_s" in proc.stderr and "Traceback" not in proc.stderr
    assert failed_after < 120

    # Negative control: with the default the same rank is still waiting, in the rendezvous (its store listens),
    # well past the moment it failed above (and it did not fail by itself later either: it was killed).
    assert waiting, killed.stderr[-3000:]
    assert killed.returncode == -signal.SIGKILL and "did not form" not in killed.stderr, killed.stderr[-3000:]


# ---- the record torchrun reads back (no processes) ---------------------------------------------------------------


def test_error_file_round_trip_through_torchruns_own_reader(tmp_path, monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from zerotrain.errors import ConfigError
    from zerotrain.launch.failures import failure_from_torchrun, first_failure, report

    failures = []
    for rank in (1, 0):
        path = tmp_path / f"error-{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        monkeypatch.setenv("RANK", str(rank))
        report(ConfigError("optim.lr=-1.0 is out of range"))
        failures.append(failure_from_torchrun(rank, ProcessFailure(rank, 100 + rank, 2, str(path))))
    assert capsys.readouterr().err.count("error: optim.lr=-1.0 is out of range") == 1  # rank 0 only
    first = first_failure(failures)
    assert first.rank == 1 and first.exit_code == 2 and first.message == "optim.lr=-1.0 is out of range"

    killed = failure_from_torchrun(3, ProcessFailure(3, 7, -signal.SIGKILL, str(tmp_path / "none.json")))
    assert killed.exit_code == 137 and "rank 3 (local rank 3, pid 7) was killed by SIGKILL" in killed.describe()

    # A rank killed by a signal and the peer it took down (gloo's connection reset: exit 1, no record of ours),
    # both noticed by torchrun within the same second: the killed rank is the cause, whatever the ranks' order.
    crashed = failure_from_torchrun(0, ProcessFailure(0, 8, 1, str(tmp_path / "none.json")))
    crashed = dataclasses.replace(crashed, time_ns=killed.time_ns)  # the same poll of torchrun's
    assert first_failure([crashed, killed]).rank == 3
    # Negative control: a failure recorded a second earlier is still the first, killed rank or not.
    earlier = dataclasses.replace(crashed, time_ns=killed.time_ns - 10**9)
    assert first_failure([earlier, killed]).rank == 0
