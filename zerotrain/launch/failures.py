"""A rank's failure, as the user and the scheduler see it: printed once, and with the rank's own exit code.

Under torchrun every rank of a failed run printed the same error (a config error: once per rank) and torchrun exited
1 whatever the ranks' codes were (2 for a user error, 75 for a requeue), so a scheduler could not tell a preemption
from a crash. Two halves fix that:

* in each rank, :func:`report` prints a :class:`~zerotrain.errors.ZerotrainError` on rank 0 only when a torchrun
  agent is there to show the others' (``TORCHELASTIC_ERROR_FILE`` is set), and records every rank's message, exit
  code and time in that error file, the channel torchrun reads its workers' failures from. Under srun (no agent)
  each rank prints its own: every task has its own log file.
* ``python -m zerotrain.launch.torchrun`` (:mod:`zerotrain.launch.torchrun`) runs torchrun and exits with the code
  of the rank that failed first, after one line naming it (and its message, when rank 0 did not print it).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerotrain.errors import EXIT_REQUEUE, ZerotrainError

if TYPE_CHECKING:  # torch is imported only by the launcher side
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set by torchrun's agent for every worker


def _rank() -> int:
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def prints_here() -> bool:
    """Whether this process prints what every rank would say alike (an error, an interruption): rank 0 under a
    torchrun agent, which shows all ranks' output together; every rank without one (srun: a log file per task)."""
    return _rank() == 0 or not os.environ.get(ERROR_FILE_ENV)


def report(error: ZerotrainError) -> None:
    """Print ``error`` where the user will see it once, and record it for the launcher; see the module docstring."""
    error_file = os.environ.get(ERROR_FILE_ENV)
    if error_file:
        _write_error_file(error_file, error, _rank())
    if prints_here():
        print(f"error: {error}", file=sys.stderr, flush=True)


def _write_error_file(path: str, error: ZerotrainError, rank: int) -> None:
    # torchrun's format (torch.distributed.elastic.multiprocessing.errors.ProcessFailure reads message and
    # extraInfo.timestamp); the nanosecond time orders failures that happened within the same second.
    record = {"message": {"message": f"{type(error).__name__}: {error}", "extraInfo": {
        "py_callstack": "", "timestamp": str(int(time.time())), "zerotrain": {
            "rank": rank, "exit_code": error.exit_code, "message": str(error), "time_ns": time.time_ns()}}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        pass  # the message was (or is now) printed; the launcher falls back to the exit code


@dataclass(frozen=True)
class RankFailure:
    """One failed rank as the launcher saw it: its exit code (negative: killed by that signal) and our record."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    time_ns: int
    message: str | None = None  # a ZerotrainError's message, from the error file

    @property
    def exit_code(self) -> int:
        """What a shell would report: 128 + n for a process killed by signal n."""
        return 128 - self.exitcode if self.exitcode < 0 else self.exitcode

    def describe(self) -> str:
        who = f"rank {self.rank} (local rank {self.local_rank}, pid {self.pid})"
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            return f"{who} was killed by {name} (exit code {self.exit_code}); the other ranks were stopped"
        if self.exitcode == EXIT_REQUEUE:
            return f"{who} exited with code {EXIT_REQUEUE}: preempted, checkpoint saved, relaunch to resume"
        if self.message is not None:
            return f"{who} failed first, exit code {self.exit_code}"
        return f"{who} failed first, exit code {self.exit_code} (its traceback is above)"


def failure_from_torchrun(rank: int, failure: ProcessFailure) -> RankFailure:
    """A :class:`RankFailure` from torchrun's ``ProcessFailure`` (and our record in its error file, if any)."""
    ours = {}
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message")
    if isinstance(message, dict):
        ours = message.get("extraInfo", {}).get("zerotrain", {})
    return RankFailure(rank=rank, local_rank=failure.local_rank, pid=failure.pid, exitcode=failure.exitcode,
                       time_ns=int(ours.get("time_ns", failure.timestamp * 10**9)), message=ours.get("message"))


def first_failure(failures: list[RankFailure]) -> RankFailure:
    """The rank that failed first (by the time it recorded, then by rank): its code is the run's.

    A rank without our record has torchrun's time, whole seconds of when torchrun noticed it. A rank killed by a
    signal (the OOM killer's SIGKILL, a segfault) takes its peers down within the same second (gloo's "connection
    reset", exit 1), so within a second a killed rank counts as first: it is the cause, the others' errors follow."""
    return min(failures, key=lambda f: (f.time_ns // 10**9, f.exitcode >= 0, f.time_ns, f.rank))
