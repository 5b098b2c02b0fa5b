"""PreemptionHandler: handlers only set a flag; should_stop agrees across ranks; repeated signals are harmless; a
SIGTERM (scancel) is not reported as a requeue."""

import os
import signal
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tools.launcher import PYTHON, run
from zerotrain.launch.preemption import REQUEUE_EXIT_CODE, PreemptionHandler


@pytest.fixture
def handler():
    h = PreemptionHandler()
    yield h
    h.uninstall()


def test_requeue_exit_code_is_distinct_from_crashes_and_signals():
    assert REQUEUE_EXIT_CODE not in (0, 1, 2, 126, 127) and REQUEUE_EXIT_CODE < 128


def test_signal_only_sets_a_flag(handler):
    assert not handler.requested and not handler.should_stop()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert handler.requested and handler.received == signal.SIGUSR1
    assert handler.should_stop() and handler.stopping


def test_sigterm_also_requests_a_stop(handler):
    os.kill(os.getpid(), signal.SIGTERM)
    assert handler.should_stop()


def test_second_signal_while_saving_is_ignored_not_fatal(handler, capfd):
    os.kill(os.getpid(), signal.SIGUSR1)
    assert handler.should_stop()  # the trainer is now saving
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert handler.received == signal.SIGUSR1 and handler.should_stop()
    err = capfd.readouterr().err
    assert "SIGTERM received while saving the preemption checkpoint: ignored" in err


def test_uninstall_restores_previous_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    h = PreemptionHandler()
    assert signal.getsignal(signal.SIGUSR1) == h._on_signal
    h.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before


def _agreement_worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    handler = PreemptionHandler()
    decisions = []
    for step in range(4):
        if step == 1 and rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is signalled
        decisions.append(handler.should_stop())
    results[rank] = decisions
    dist.destroy_process_group()


def test_all_ranks_agree_on_the_stop_step():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    # fork: torch is already imported here, so the workers start in milliseconds instead of re-importing it
    mp.start_processes(_agreement_worker, args=(port, results), nprocs=2, join=True, start_method="fork")
    assert results[0] == results[1] == [False, True, True, True]


def test_only_sigusr1_says_requeue(handler):
    """scancel sends SIGTERM and train.sbatch does not requeue after it: the run must not claim it will be."""
    assert "another rank got a stop signal" in handler.stop_message(7)
    os.kill(os.getpid(), signal.SIGTERM)
    assert handler.should_stop()
    terminated = handler.stop_message(7)
    assert terminated == ("terminated (SIGTERM): checkpoint saved at step 7, not requeued; relaunch the same command "
                          "to continue from it")
    usr1 = PreemptionHandler(install=False)
    usr1.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert "exiting for requeue" in usr1.stop_message(7) and "SIGUSR1" in usr1.stop_message(7)
    finally:
        usr1.uninstall()
    assert "requeue" not in terminated.replace("not requeued", "")  # the control: the old text said "for requeue"


def test_a_run_terminated_by_sigterm_saves_and_does_not_claim_a_requeue(tmp_path, shakespeare):
    proc = run([PYTHON, "tests/workers/signal_at_step.py", "SIGTERM", "2", "recipe=tiny_llama", "train.steps=4",
                "train.log_interval=1", "train.eval_interval=0", "wandb.enabled=false", f"run.output_dir={tmp_path}",
                "run.name=term", f"data.train.0.path={shakespeare}"], check=False, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == REQUEUE_EXIT_CODE, out[-2000:]  # train.sbatch tells SIGTERM apart by its own trap
    assert "terminated (SIGTERM): checkpoint saved at step 2, not requeued" in out, out[-2000:]
    assert "exiting for requeue" not in out
    assert (tmp_path / "term" / "checkpoints" / "latest").read_text() == "step_00000002"


def test_a_signal_recorded_during_startup_is_taken_over_by_the_handler(capfd):
    """train.py's first-lines handler records the signal; the trainer's handler, installed later, keeps it."""
    from zerotrain.launch.preemption import install_early_handlers

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        install_early_handlers()
        os.kill(os.getpid(), signal.SIGUSR1)  # the process is still alive: the default action would have killed it
        os.kill(os.getpid(), signal.SIGTERM)
        handler = PreemptionHandler()
        assert handler.received == signal.SIGUSR1 and handler.should_stop()
        err = capfd.readouterr().err
        assert "SIGUSR1 received during start-up" in err and "a stop is already pending: ignored" in err
        assert "SIGUSR1 from start-up still pending" in err
        handler.uninstall()
        assert not PreemptionHandler(install=True).requested  # taken once: a later handler starts clean
    finally:
        for sig, previous in before.items():
            signal.signal(sig, previous)


@pytest.mark.launch  # runs a stand-in scontrol
@pytest.mark.parametrize("restarts, this_start, requeued", [(1, 0, True), (3, 2, True), (0, 0, False), (2, 2, False)])
def test_a_sigterm_from_a_slurm_requeue_is_named_a_requeue(handler, tmp_path, monkeypatch, restarts, this_start,
                                                           requeued):
    """scontrol requeue (or a preemption SLURM requeues) raises the job's Restarts above this start's
    SLURM_RESTART_COUNT while the tasks stop; scancel does not. The stand-in prints what SLURM's scontrol printed
    on the local cluster during each (tests/slurm/test_slurm_startup_signals.py checks the real one)."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/bash\necho "JobId=$4 JobState=COMPLETING Reason=None Restarts={restarts}"\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    if this_start:
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(this_start))
    else:
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    os.kill(os.getpid(), signal.SIGTERM)
    assert handler.should_stop()
    message = handler.stop_message(9)
    if requeued:
        assert message == ("requeued by SLURM (SIGTERM: scontrol requeue or a preemption): checkpoint saved at step 9; "
                           "the job's next start resumes from it")
    else:  # the control: a cancellation keeps saying so
        assert message.startswith("terminated (SIGTERM): checkpoint saved at step 9, not requeued")
