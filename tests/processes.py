"""Finding and signalling the processes a test launched, through /proc (Linux): by a variable in their environment.

The tests that kill or signal a rank "during start-up" do it while the rank is inside its heavy imports (libtorch is
mapped, no trainer object exists yet): a moment a test can observe from outside without any hook in the code.
:class:`Background` runs a launch in a thread, so that two launches that mostly wait (a timeout and its negative
control) wait at the same time.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RankKey = bytes  # the environment variable that holds a process's rank: b"RANK" (torchrun), b"SLURM_PROCID" (srun)


def train_processes(marker: str, rank_key: RankKey = b"RANK") -> dict[int, int]:
    """rank -> pid of the ``train.py`` processes (not a torchrun agent) whose environment holds ``marker``
    (``NAME=value``)."""
    found = {}
    needle = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle not in environ or not any(a.endswith(b"train.py") for a in cmdline[:4]):
            continue
        if any(b"torch.distributed.run" in a or b"zerotrain.launch.torchrun" in a for a in cmdline):
            continue
        rank = next((int(e.split(b"=", 1)[1]) for e in environ if e.startswith(rank_key + b"=")), 0)
        found[rank] = int(entry)
    return found


def kill_marked(marker: str, rank_key: RankKey = b"RANK") -> None:
    """SIGKILL every ``train.py`` process of the launch marked ``marker`` (its launcher then ends it); none is fine."""
    for pid in train_processes(marker, rank_key).values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def importing_torch(pid: int) -> bool:
    """The process has libtorch mapped: it is inside its heavy imports, long before any trainer object exists."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def when(predicate: Callable[[], Any], timeout: float = 600.0, poll: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something true; return that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for the launched processes")


def to_launcher_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group of ``pid``'s parent (a torchrun agent: its ranks run in sessions of their
    own), as Ctrl-C in a terminal does to its foreground group."""
    status = Path(f"/proc/{pid}/status").read_text()
    parent = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
    os.killpg(os.getpgid(parent), sig)


class Signaller(threading.Thread):
    """Send ``sig`` to rank ``rank`` of the launch marked ``marker`` once ``ready(pid)`` holds (by default: it is
    importing torch), with ``send(pid, sig)`` (``os.kill``; :func:`to_launcher_group`: Ctrl-C); ``result()`` gives
    the monotonic time it was sent, or re-raises what went wrong."""

    def __init__(self, marker: str, rank: int, sig: int, ready: Callable[[int], bool] = importing_torch,
                 rank_key: RankKey = b"RANK", send: Callable[[int, int], None] = os.kill):
        super().__init__(daemon=True)
        self.marker, self.rank, self.sig, self.ready, self.rank_key = marker, rank, sig, ready, rank_key
        self.send = send
        self.sent_at: float | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            pid = when(lambda: train_processes(self.marker, self.rank_key).get(self.rank))
            when(lambda: self.ready(pid), poll=0.01)
            self.send(pid, self.sig)
            self.sent_at = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e

    def result(self, timeout: float = 10) -> float:
        self.join(timeout)
        if self.error:
            raise self.error
        assert self.sent_at is not None, "the signal was never sent"
        return self.sent_at


def listening(port: int) -> bool:
    """Some process on this host listens on TCP ``port`` (IPv4 or IPv6), as rank 0's rendezvous store does."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: TCP_LISTEN
                return True
    return False


class Background(threading.Thread):
    """``fn(*args, **kwargs)`` in a thread, started at once; ``result(timeout)`` joins it and returns what it returned,
    or re-raises what it raised."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any):
        super().__init__(daemon=True)
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.value: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args, **self.kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e

    def result(self, timeout: float) -> Any:
        self.join(timeout)
        assert not self.is_alive(), f"{getattr(self.fn, '__name__', self.fn)} still running after {timeout:.0f} s"
        if self.error:
            raise self.error
        return self.value
