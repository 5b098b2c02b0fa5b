"""Where a step's time goes: the shares spent in forward, backward, optimizer and waiting for communication.

The trainer brackets each optimizer step with :meth:`StepTimes.step` and each micro-batch's forward, backward and
``engine.step()`` with :meth:`StepTimes.phase`; :meth:`StepTimes.read` (at a log step) returns, over the steps
since the previous read, the shares of the step time logged as::

    time/forward_share  time/backward_share  time/optimizer_share  time/comm_wait_share

Each is in [0, 1] and they sum to at most 1: the rest of the step (moving the batch to the device, the loss
bookkeeping) is in none of them. ``time/comm_wait_share`` is taken out of the phase it happened in, so
``time/forward_share`` is forward *compute* (plus whatever else forward does on the host, such as ZeRO-3's
parameter bookkeeping).

What "waiting for communication" measures
-----------------------------------------
The time this rank's stream of work stands blocked in a collective during a step: every call of a collective on
DeepSpeed's communication backend (``deepspeed.comm.comm.cdb``, the one object every ``deepspeed.comm`` entry
point ends in; see :mod:`zerotrain.comm_accounting`) and every ``wait()`` on a ``torch.distributed`` work handle
(ZeRO-3's prefetched all-gathers are waited on that way), the outermost of nested ones counted once. Under gloo
that is host time the rank spends in or waiting for the collective; under NCCL the span between CUDA events
recorded on the current stream before and after the call or wait, i.e. how long that stream stood idle until the
collective finished. Communication that overlaps computation completely costs no wait and is not counted; the
all-gather stream waiting for hpZ's shard copies is stream-to-stream and not counted either.

Clocks
------
On CUDA every boundary is a CUDA event recorded on the current stream (``enable_timing``), read only by
:meth:`StepTimes.read`, at a log step (one ``Event.synchronize`` on the last one, where the trainer syncs anyway):
between log steps nothing here waits on the device. Elsewhere (the CPU, which runs its work synchronously) the
boundaries are ``time.perf_counter`` readings. The cost, about two clock readings per phase and per collective,
is measured by ``benchmarks/step_timing_cost.py``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

from zerotrain.ds_patches import PatchSet, add_collective_hook, remove_collective_hook
from zerotrain.profiling import trace_range

PHASES = ("forward", "backward", "optimizer")
KEYS = tuple(f"time/{p}_share" for p in (*PHASES, "comm_wait"))

# The backend methods that move data or wait for ranks (the ones comm_accounting counts).
COLLECTIVES = ("all_gather_into_tensor", "all_gather_base", "all_gather", "all_gather_coalesced",
               "reduce_scatter_tensor", "reduce_scatter", "all_reduce", "all_reduce_coalesced",
               "inference_all_reduce", "broadcast", "reduce", "all_to_all_single", "all_to_all", "send", "recv",
               "gather", "scatter", "barrier", "monitored_barrier")


class _HostClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def settle(self, last: float) -> None:
        pass


class _CudaClock:
    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def settle(self, last: torch.cuda.Event) -> None:
        last.synchronize()  # only at a read (a log step): the events before it are done too


class StepTimes:
    """Phase and communication-wait times of the steps since the last :meth:`read`, on ``device``'s clock."""

    def __init__(self, device: str | torch.device):
        self.clock = _CudaClock() if torch.device(device).type == "cuda" else _HostClock()
        self.source = "cuda_events" if isinstance(self.clock, _CudaClock) else "host"
        self._phase: Optional[str] = None  # the phase being timed, None outside a step
        self._in_step = False
        self._depth = threading.local()
        # (what, start mark, end mark): what is "step", a phase, or "comm:<phase>".
        self._spans: list[tuple[str, Any, Any]] = []

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        start = self.clock.mark()
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
            self._spans.append(("step", start, self.clock.mark()))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self.clock.mark()
        self._phase = name
        try:
            with trace_range("zerotrain/" + name):  # a named range in a profiler trace, nothing otherwise
                yield
        finally:
            self._phase = None
            self._spans.append((name, start, self.clock.mark()))

    def timed(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` counted as communication wait of the current phase (if any, outermost only)."""
        phase = self._phase
        depth = getattr(self._depth, "n", 0)
        if phase is None or depth:
            return fn(*args, **kwargs)
        self._depth.n = 1
        start = self.clock.mark()
        try:
            return fn(*args, **kwargs)
        finally:
            self._spans.append(("comm:" + phase, start, self.clock.mark()))
            self._depth.n = 0

    def read(self) -> dict[str, float]:
        """The shares of step time since the last read (empty if no step finished), and forget those steps."""
        spans, self._spans = self._spans, []
        if not any(what == "step" for what, _, _ in spans):
            self._spans = spans  # a step still open keeps its spans
            return {}
        self.clock.settle(spans[-1][2])
        totals: dict[str, float] = {}
        for what, start, end in spans:
            totals[what] = totals.get(what, 0.0) + self.clock.seconds(start, end)
        step = totals["step"]
        if step <= 0:
            return {}
        out = {}
        waited = 0.0
        for p in PHASES:
            comm = min(totals.get("comm:" + p, 0.0), totals.get(p, 0.0))
            waited += comm
            out[f"time/{p}_share"] = _share(totals.get(p, 0.0) - comm, step)
        out["time/comm_wait_share"] = _share(waited, step)
        return out


class NullStepTimes(StepTimes):
    """Times nothing (what the loop costs without the breakdown: ``benchmarks/step_timing_cost.py``)."""

    def __init__(self):
        super().__init__("cpu")

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        yield

    def timed(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)


def _share(part: float, whole: float) -> float:
    return min(1.0, max(0.0, part / whole))


# --------------------------------------------------------------------------- the collective hooks

_active: Optional[StepTimes] = None
_HOOK = "step_timing"  # its name among the hooks on deepspeed.comm's backend (zerotrain.ds_patches)
_wait_patch: Optional[PatchSet] = None  # torch.distributed.Work.wait, timed


def install(times: StepTimes) -> None:
    """Time collectives into ``times`` from now on (after ``deepspeed.init_distributed``). Installing again points
    the hooks at the new ``times``."""
    global _active, _wait_patch
    import torch.distributed as tdist

    _active = times
    add_collective_hook(_HOOK, _time_collective, COLLECTIVES)
    if _wait_patch is None:
        _wait_patch = PatchSet()
        _wait_patch.replace(tdist.Work, "wait", _timed_wait(tdist.Work.wait))


def _time_collective(method: str, call: Callable, *args: Any, **kwargs: Any) -> Any:
    times = _active
    return call(*args, **kwargs) if times is None else times.timed(call, *args, **kwargs)


def _timed_wait(original: Callable) -> Callable:
    @functools.wraps(original)
    def timed(*args, **kwargs):
        times = _active
        if times is None:
            return original(*args, **kwargs)
        return times.timed(original, *args, **kwargs)

    return timed


def uninstall() -> None:
    """Restore the backend's methods and ``Work.wait``. Harmless when not installed."""
    global _active, _wait_patch
    remove_collective_hook(_HOOK)
    if _wait_patch is not None:
        _wait_patch.restore()
    _wait_patch = _active = None
