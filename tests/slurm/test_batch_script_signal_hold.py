"""A SLURM signal during start-up is held or kept pending, never fatal (no cluster: the real train.sbatch and the real
first lines of train.py, with a stand-in srun that reports what it received and when).

* The tasks start under the wrapper train.sbatch renders (``env --block-signal``): a SIGUSR1 sent to a task before
  any handler exists stays pending and reaches the handler train.py's first lines install, which also report the
  task ready. The control: the same child without the wrapper dies of the signal (138 in a shell).
* The batch shell holds a signal that comes before every task reported ready and passes it on once they have. The
  control: ``ZEROTRAIN_SIGNAL_HOLD=0`` (no hold: the old behaviour) passes it on at once, to tasks that are not
  ready, which the real srun or tasks would die of (see test_slurm_startup_signals.py for the cluster).
* After a SIGTERM and exit 75 the batch shell says whether SLURM requeues the job itself (scontrol requeue: the job's
  Restarts went up) and never requeues it again; after scancel it says it does not requeue.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from test_slurm_env import ALLOCATION_4X8, render_launch

from tools.launcher import PYTHON

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "train.sbatch"

# train.py's first lines, after a pause in which the test signals the process (the interpreter's start, stretched)
CHILD = """
import sys
print("up", flush=True)
sys.stdin.readline()
from zerotrain.launch.preemption import PreemptionHandler, install_early_handlers
install_early_handlers()
print("received", PreemptionHandler().received, flush=True)
"""


def task_wrapper() -> list[str]:
    """What train.sbatch puts between srun's options and the interpreter (the signal-blocking exec wrapper)."""
    argv, _ = render_launch(ALLOCATION_4X8, "tiny_llama")
    return argv[argv.index("env") : argv.index(ALLOCATION_4X8["ZEROTRAIN_PYTHON"])]


def signalled_at_start(wrapper: list[str], ready_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "ZEROTRAIN_READY_DIR": str(ready_dir), "SLURM_PROCID": "3"}
    proc = subprocess.Popen([*wrapper, PYTHON, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "up\n"  # the interpreter runs, no handler of ours exists yet
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate("go\n", timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_task_started_blocked_keeps_an_early_sigusr1_for_its_handler(tmp_path):
    wrapper = task_wrapper()
    assert wrapper == ["env", "--block-signal=USR1", "--block-signal=TERM"], wrapper  # coreutils >= 8.31 here
    result = signalled_at_start(wrapper, tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"received {int(signal.SIGUSR1)}" in result.stdout
    assert "SIGUSR1 received during start-up" in result.stderr
    assert (tmp_path / "rank-3").is_file()  # the task told the batch script its handlers exist

    control = signalled_at_start([], tmp_path / "unused")  # the same child, started unblocked
    assert control.returncode == -signal.SIGUSR1, control.stderr


# A stand-in for srun: it signals the batch shell as it starts (the time-limit warning right after srun's launch),
# records every USR1 it gets with the number of tasks ready at that moment, makes its 2 "tasks" ready after 2 s, and
# exits 75 (a preemption checkpoint) once it got a USR1, 0 otherwise. A stand-in scontrol records what it is asked.
FAKE_SRUN = """#!/bin/bash
got=0
trap 'echo "USR1 with $(ls "$ZEROTRAIN_READY_DIR" | wc -l) ready" >> "$FAKE_LOG"; got=1' USR1
trap 'echo "TERM" >> "$FAKE_LOG"; got=1' TERM
kill -"${FAKE_SIGNAL:-USR1}" "$PPID"
sleep 2
touch "$ZEROTRAIN_READY_DIR/rank-0" "$ZEROTRAIN_READY_DIR/rank-1"
for _ in $(seq 1 50); do [ "$got" = 1 ] && exit 75; sleep 0.1; done
exit 0
"""
FAKE_SCONTROL = """#!/bin/bash
echo "$*" >> "$FAKE_LOG"
[ "$1" = show ] && echo "JobId=$4 JobState=COMPLETING Restarts=${FAKE_RESTARTS:-0}"
exit 0
"""


def batch_script_with_early_signal(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir, log = tmp_path / "bin", tmp_path / "fake.log"
    bin_dir.mkdir(parents=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    allocation = {"SLURM_JOB_ID": "88", "SLURM_JOB_NAME": "t", "SLURM_JOB_NUM_NODES": "1",
                  "SLURM_TASKS_PER_NODE": "2", "SLURM_CPUS_ON_NODE": "2", "ZEROTRAIN_PYTHON": sys.executable}
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "ZEROTRAIN_ROOT": str(REPO),
                "FAKE_LOG": str(log), **allocation, **env}
    result = subprocess.run(["bash", str(SBATCH), "tiny_llama"], env=full_env, cwd=tmp_path, capture_output=True,
                            text=True, check=False, timeout=120)
    return result, log.read_text().splitlines() if log.exists() else []


def test_the_batch_shell_holds_an_early_signal_until_every_task_is_ready(tmp_path):
    result, calls = batch_script_with_early_signal(tmp_path / "held")
    assert result.returncode == 75, result.stdout + result.stderr
    assert calls[0] == "USR1 with 2 ready", calls  # passed on once, after both tasks reported ready
    assert calls.count("USR1 with 2 ready") == 1 and not any(c.startswith("USR1 with 0") for c in calls)
    assert "got SIGUSR1 before every training task has its signal handlers (0 of 2 ready)" in result.stdout
    assert "forwarding SIGUSR1 to the training tasks, held" in result.stdout
    assert "requeue 88" in calls and "requeueing job 88" in result.stdout  # the time-limit path: requeued

    # The control, the old behaviour: no hold, the signal goes on at once to tasks that cannot take it yet.
    result, calls = batch_script_with_early_signal(tmp_path / "no-hold", ZEROTRAIN_SIGNAL_HOLD="0")
    assert calls[0] == "USR1 with 0 ready", calls
    assert "passing SIGUSR1 on anyway" in result.stderr


def test_after_a_sigterm_the_batch_shell_names_slurms_own_requeue_and_does_not_requeue_again(tmp_path):
    """scontrol requeue: SLURM raised Restarts above SLURM_RESTART_COUNT. The control: scancel (Restarts unchanged)."""
    result, calls = batch_script_with_early_signal(tmp_path / "requeue", FAKE_SIGNAL="TERM", FAKE_RESTARTS="1")
    assert result.returncode == 75 and "TERM" in calls, result.stdout + result.stderr
    assert "SLURM is requeueing job 88 (scontrol requeue or a preemption)" in result.stdout
    assert not any(c.startswith("requeue") for c in calls)

    result, calls = batch_script_with_early_signal(tmp_path / "cancel", FAKE_SIGNAL="TERM", FAKE_RESTARTS="0")
    assert "not requeueing (a cancellation)" in result.stdout and not any(c.startswith("requeue") for c in calls)
