"""Stop cleanly when SLURM is about to end the job: checkpoint at a step boundary, exit, get requeued.

SLURM warns a job before its time limit (``#SBATCH --signal=B:USR1@<seconds>``; the batch shell forwards the
USR1 to every task) and sends SIGTERM on cancellation or preemption. The protocol:

1. The signal handler ONLY records that a signal arrived. Saving inside a handler would run at an arbitrary
   bytecode — possibly mid-collective or mid-optimizer-step — and on one rank while the others keep training.
2. At every step boundary the trainer calls :meth:`PreemptionHandler.should_stop`. It all-reduces (MAX) the
   flag over the world group, so all ranks agree on the same step even if the signal reached them at different
   moments (or reached only some of them).
3. When it returns True the trainer saves a checkpoint (a collective, on every rank) and every rank exits with
   :data:`REQUEUE_EXIT_CODE`. ``slurm/train.sbatch`` sees that exit code from ``srun`` and runs
   ``scontrol requeue $SLURM_JOB_ID``; the requeued job resumes from the checkpoint with the same run name. After
   SIGTERM the script does not requeue: ``scancel`` means stop, and ``scontrol requeue`` or a preemption with
   ``PreemptMode=REQUEUE`` is SLURM requeueing the job itself. :meth:`PreemptionHandler.stop_message` says which
   (:func:`slurm_requeued`).

A second signal while stopping (e.g. SIGTERM from ``scancel`` during the save) is logged and ignored: the save
finishes if SLURM's KillWait allows, and SIGKILL ends it otherwise.

Ctrl-C (SIGINT; a torchrun agent passes it on to every rank) goes the same way once the trainer calls
:meth:`PreemptionHandler.catch_interrupt` (``checkpoint.on_interrupt``, from its first step): checkpoint at the step
boundary, then exit 130 (:data:`~zerotrain.errors.EXIT_INTERRUPTED`; a preemption signal on any rank wins: 75). A
second Ctrl-C stops at once (``KeyboardInterrupt``), as does the first one without ``catch_interrupt``.

Start-up: importing torch, transformers and DeepSpeed takes seconds to minutes, and until a handler exists
SIGUSR1's default action kills the task (exit 138, no checkpoint, no requeue). So ``train.py`` calls
:func:`install_early_handlers` on its first lines, before any heavy import: a handler that only records the signal.
The trainer's :class:`PreemptionHandler` takes the record over when it installs its own, so a signal that arrived
during start-up is not lost: the run stops (checkpoint, exit 75) at its first step boundary. Before those first
lines (the interpreter's own start) two things in ``slurm/train.sbatch`` cover the task:

* it starts each task with SIGUSR1/SIGTERM blocked (``env --block-signal``: the mask survives exec), so a signal sent
  to the tasks directly stays pending; :func:`install_early_handlers` unblocks it into its handler;
* it holds a signal it got itself (the time-limit warning, ``scancel --signal=USR1 --batch``) until every task has
  reported that its handler exists: :func:`install_early_handlers` creates ``$ZEROTRAIN_READY_DIR/rank-<rank>``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Mapping
from types import FrameType
from typing import Any

from zerotrain.errors import EXIT_INTERRUPTED, EXIT_REQUEUE
from zerotrain.launch.failures import prints_here

# Every rank exits with it after the preemption checkpoint is saved; slurm/train.sbatch requeues the job when srun
# returns it (75, EX_TEMPFAIL: see zerotrain/errors.py).
REQUEUE_EXIT_CODE = EXIT_REQUEUE

DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

# slurm/train.sbatch: the directory where each task says that its handlers exist (rank-<SLURM_PROCID>)
READY_DIR_ENV = "ZEROTRAIN_READY_DIR"

_early_received: int | None = None  # the first signal the start-up handler recorded

# What the ranks agree on at a step boundary (the largest wins): no stop, Ctrl-C, a preemption (a requeue)
_NO_STOP, _INTERRUPT, _PREEMPT = 0, 1, 2


def _say(message: str) -> None:
    # os.write, not print/logging: a handler may interrupt a print holding the stream's lock.
    os.write(2, f"[zerotrain.preemption pid {os.getpid()}] {message}\n".encode())


def _on_early_signal(signum: int, frame: FrameType | None) -> None:
    global _early_received
    name = signal.Signals(signum).name
    if _early_received is None:
        _early_received = signum
        _say(f"{name} received during start-up: will checkpoint and exit at the first step boundary")
    else:
        _say(f"{name} received during start-up, a stop is already pending: ignored")


def install_early_handlers(signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
    """Record (only record) SIGUSR1/SIGTERM from the first line of the program until the trainer's handler exists;
    :class:`PreemptionHandler` adopts what was recorded. Call from the main thread, before heavy imports.

    Then unblock them (a signal that came while the launcher kept them blocked is delivered to the handler here) and
    tell ``slurm/train.sbatch`` that this task can take a signal (see the module docstring)."""
    signals = tuple(signals)
    for sig in signals:
        signal.signal(sig, _on_early_signal)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
    _report_ready()


def _report_ready() -> None:
    directory = os.environ.get(READY_DIR_ENV)
    if not directory:
        return
    rank = os.environ.get("SLURM_PROCID") or os.environ.get("RANK") or "0"
    try:
        os.close(os.open(os.path.join(directory, f"rank-{rank}"), os.O_CREAT | os.O_WRONLY, 0o644))
    except OSError as e:
        _say(f"cannot tell the batch script that this task's signal handlers exist ({e}): a signal it holds for the "
             f"tasks is passed on after ZEROTRAIN_SIGNAL_HOLD seconds instead")


def slurm_requeued(environ: Mapping[str, str] | None = None, timeout_s: float = 5.0) -> bool:
    """Whether SLURM has requeued this job since it started: ``scontrol requeue`` and a preemption with
    ``PreemptMode=REQUEUE`` raise the job's ``Restarts`` above this start's ``SLURM_RESTART_COUNT`` at once (the job
    is still COMPLETING while its tasks stop), ``scancel`` does not. False outside SLURM or without an answer."""
    import shutil  # here, not at the top: train.py imports this module first thing, so it stays light
    import subprocess

    environ = os.environ if environ is None else environ
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id or shutil.which("scontrol") is None:
        return False
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                             timeout=timeout_s, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    fields = dict(field.split("=", 1) for field in out.split() if "=" in field)
    try:
        return int(fields.get("Restarts", "0")) > int(environ.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        return False


def ignore_stop_signals(signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
    """On the way out, once the run's outcome is decided: ignore SIGUSR1/SIGTERM from here on.

    ``srun --kill-on-bad-exit`` sends SIGTERM to the other tasks as soon as the first one exits non-zero (75 after a
    preemption checkpoint: every rank is leaving with the same code). Python gives back the default action of every
    signal it handled when it finalizes, so a SIGTERM during that teardown would end the task with 143 instead of
    its code, and the job would not be requeued; an ignored signal stays ignored through finalization.
    """
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


class PreemptionHandler:
    """Turns SIGUSR1/SIGTERM into a stop request that all ranks agree on at a step boundary.

    Constructing it installs the handlers (``install=False`` to defer). Create it early, before the slow
    model/DeepSpeed setup: a USR1 arriving before any handler exists kills the process (SIGUSR1's default action).
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS, group: Any = None, install: bool = True) -> None:
        self.signals = tuple(signals)
        self.group = group  # process group for the agreement; None = the world
        self.received: int | None = None  # the first signal this process got
        self.stopping = False  # set once should_stop() returned True: from then on signals are ignored
        self.agreed = _NO_STOP  # the stop all ranks agreed on (should_stop)
        self._previous: dict[int, Any] = {}
        if install:
            self.install()

    # -- signal side: only flags ------------------------------------------------------------------------------

    def install(self) -> PreemptionHandler:
        """Install the handlers (from the main thread, as Python requires). Returns self for chaining."""
        for sig in self.signals:
            if sig in self._previous:
                continue
            self._previous[sig] = signal.signal(sig, self._on_signal)
            if self._previous[sig] is _on_early_signal:
                self._adopt_early_signal()
        # Started blocked by slurm/train.sbatch without install_early_handlers (another entry point): deliver now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
        return self

    def _adopt_early_signal(self) -> None:
        """Take over a signal recorded by the start-up handler: the stop it asked for is still pending."""
        global _early_received
        if _early_received is not None and self.received is None:
            self.received = _early_received
            _say(f"{signal.Signals(_early_received).name} from start-up still pending: will checkpoint and exit at "
                 "the first step boundary")
        _early_received = None

    def catch_interrupt(self) -> None:
        """From now on Ctrl-C (SIGINT) is a stop request like the others: checkpoint, then exit 130 (see the module
        docstring). The trainer calls it when training starts, with ``checkpoint.on_interrupt``."""
        if signal.SIGINT not in self.signals:
            self.signals += (signal.SIGINT,)
        self.install()

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and (self.stopping or self.received is not None):
            raise KeyboardInterrupt("a second Ctrl-C while stopping: no checkpoint saved by this stop")
        if signum == signal.SIGINT and not prints_here():
            self.received = signum  # every rank gets Ctrl-C from the torchrun agent: the printing one says so
        elif self.stopping:
            _say(f"{name} received while saving the preemption checkpoint: ignored")
        elif self.received is not None:
            _say(f"{name} received, a stop is already pending: ignored")
        else:
            self.received = signum
            _say(f"{name} received: will checkpoint and exit at the next step boundary")

    @property
    def requested(self) -> bool:
        """Whether THIS process got a signal (no communication). Use :meth:`should_stop` to decide."""
        return self.received is not None

    @property
    def interrupted(self) -> bool:
        """The ranks agreed on a stop for Ctrl-C (no rank got a preemption signal)."""
        return self.agreed == _INTERRUPT

    @property
    def exit_code(self) -> int:
        """Every rank's exit code once the stop checkpoint is saved: 130 for Ctrl-C, 75 (requeue) otherwise."""
        return EXIT_INTERRUPTED if self.interrupted else REQUEUE_EXIT_CODE

    def stop_message(self, step: int) -> str:
        """What the run says once the stop checkpoint of ``step`` is saved, by the signal this process got: SIGUSR1
        (SLURM's time-limit warning) leads to a requeue by the job script; SIGTERM is a requeue by SLURM itself
        (``scontrol requeue``, a preemption; asked of SLURM on the logging rank only) or else a cancellation."""
        if self.interrupted:
            return (f"interrupted (SIGINT): checkpoint saved at step {step} (checkpoint.on_interrupt=true); relaunch "
                    f"the same command to continue from it")
        if self.received == signal.SIGUSR1:
            return f"preempted at step {step}: checkpoint saved, exiting for requeue (SIGUSR1, the time-limit warning)"
        if self.received is not None and self.received != signal.SIGINT:  # Ctrl-C here, a preemption elsewhere: below
            name = signal.Signals(self.received).name
            if _logging_rank() and slurm_requeued():
                return (f"requeued by SLURM ({name}: scontrol requeue or a preemption): checkpoint saved at step "
                        f"{step}; the job's next start resumes from it")
            return (f"terminated ({name}): checkpoint saved at step {step}, not requeued; relaunch the same command "
                    f"to continue from it")
        return f"another rank got a stop signal: checkpoint saved at step {step}, exiting"

    # -- step-boundary side: collective agreement --------------------------------------------------------------

    def should_stop(self) -> bool:
        """True on every rank iff any rank got a signal. A collective: call on all ranks at the same step.

        Costs one scalar all-reduce and a host sync per call, negligible next to a ZeRO-3 step.
        """
        if self.stopping:
            return True
        mine = _NO_STOP if self.received is None else _INTERRUPT if self.received == signal.SIGINT else _PREEMPT
        self.agreed = _agree_max(mine, self.group)
        self.stopping = self.agreed != _NO_STOP
        return self.stopping


def _logging_rank() -> bool:
    """Rank 0 of the world (or a single process): the rank whose info lines are shown, so only it asks SLURM."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _agree_max(value: int, group: Any = None) -> int:
    """MAX-all-reduce a small integer over ``group``; just the value without a process group (single process)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    # NCCL only reduces device tensors; gloo (CPU runs) only host tensors.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    tensor = torch.tensor([value], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return int(tensor.item())
