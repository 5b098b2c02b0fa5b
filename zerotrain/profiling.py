"""Looking inside steps without editing code: torch.profiler traces and CUDA memory snapshots, as config keys.

The ``profile`` section (:class:`ProfileConfig`) is declared here. Off by default, and then nothing here runs: the
trainer builds a :class:`Profiler` only when ``profile.enabled`` or a memory snapshot is asked for.

Traces. ``torch.profiler`` records the steps its schedule picks (``profile.steps``, or ``wait``/``warmup``/
``active``/``repeat`` counted from the launch's first step) and torch's own exporter writes one Chrome trace per
rank and traced window::

    <run dir>/profile/step_N/rank_R.json      (.json.gz with profile.gzip; N: the window's last step)

Open them in https://ui.perfetto.dev or chrome://tracing. Besides torch's operators and collectives
(``c10d::_allgather_base_`` / ``gloo:all_gather``: ZeRO-3's parameter all-gathers; ``c10d::_reduce_scatter_base_``:
its gradient reduce-scatter) they hold our ranges (:func:`trace_range`): ``zerotrain/forward``,
``zerotrain/backward``, ``zerotrain/optimizer`` per micro-batch and ``zerotrain/hpz/shard_copy`` per hpZ
secondary-shard copy. On rank 0 each trace can also go to W&B as an artifact
(``profile.wandb_artifact``).

Memory snapshots (CUDA). With ``profile.memory_snapshot_steps`` or ``profile.memory_snapshot_on_oom`` the CUDA
caching allocator records its history (``torch.cuda.memory._record_memory_history``) from the first step, and
``torch.cuda.memory._dump_snapshot`` writes ``<run dir>/profile/memory/step_N/rank_R.pickle`` after each chosen
step, or ``<run dir>/profile/memory/oom/rank_R.pickle`` when the allocator runs out of memory (an observer the
allocator calls before it raises). Drag a snapshot onto https://pytorch.org/memory_viz. On the CPU there is no
allocator history: asking for snapshots logs a warning and does nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from zerotrain.fields import bounded

log = logging.getLogger("zerotrain")

PROFILE_DIR = "profile"
_NO_RANGE = contextlib.nullcontext()


def trace_range(name: str) -> contextlib.AbstractContextManager:
    """A named range in the trace (``torch.profiler.record_function``) while a profiler records, else nothing: the
    check is torch's own Python flag for this, so an untraced step pays one attribute read."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _NO_RANGE


@dataclass
class ProfileConfig:
    """The ``profile`` section: torch.profiler traces and CUDA memory snapshots of chosen steps (off by default)."""

    enabled: bool = False
    """Trace steps with torch.profiler: one Chrome trace per rank in <run dir>/profile/step_N/rank_R.json."""
    steps: list[int] = bounded(factory=list, ge=1)
    """The optimizer steps to trace (e.g. [5, 6]: one trace of both, consecutive steps share one); empty: the
    wait/warmup/active/repeat schedule instead."""
    wait: int = bounded(1, ge=0)
    """Schedule without profile.steps: steps skipped at the start of each cycle. The cycles count from the launch's
    first step (a resumed launch starts them again)."""
    warmup: int = bounded(1, ge=0)
    """Steps profiled but discarded before each traced window (the profiler's own start-up cost lands there)."""
    active: int = bounded(1, ge=1)
    """Steps in each traced window."""
    repeat: int = bounded(1, ge=0)
    """Cycles of wait + warmup + active; 0: repeat until the run ends."""
    cpu: bool = True
    """Record host (CPU) activity: operators, Python-level record_function ranges, collectives."""
    cuda: bool = True
    """Record CUDA kernels and memory copies (ignored where CUDA is not available)."""
    record_shapes: bool = False
    """Record operators' input shapes (larger traces)."""
    with_stack: bool = False
    """Record the Python stack of every operator (much larger traces, slower steps while tracing)."""
    profile_memory: bool = False
    """Record tensor allocations and frees in the trace."""
    gzip: bool = False
    """Write rank_R.json.gz instead of rank_R.json."""
    wandb_artifact: bool = False
    """Also log rank 0's traces to its W&B run as artifacts of type 'profile' (when W&B logging is on)."""
    memory_snapshot_steps: list[int] = bounded(factory=list, ge=1)
    """CUDA: dump a memory snapshot after each of these optimizer steps (pytorch.org/memory_viz reads it)."""
    memory_snapshot_on_oom: bool = False
    """CUDA: dump a memory snapshot when the allocator runs out of memory, before the error is raised."""
    memory_history_entries: int = bounded(100_000, ge=1)
    """Allocator events kept for snapshots (the oldest are dropped past this)."""

    @property
    def wants_memory_history(self) -> bool:
        return bool(self.memory_snapshot_steps) or self.memory_snapshot_on_oom

    @property
    def active_any(self) -> bool:
        return self.enabled or self.wants_memory_history


def step_schedule(steps: list[int], first_step: int) -> Callable[[int], Any]:
    """A torch.profiler schedule recording exactly ``steps`` (training steps; profiler step k is training step
    ``first_step + k``): warm up the step before each window, save at a window's last step."""
    from torch.profiler import ProfilerAction

    wanted = set(steps)

    def action(k: int) -> ProfilerAction:
        step = first_step + k
        if step in wanted:
            return ProfilerAction.RECORD if step + 1 in wanted else ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.WARMUP if step + 1 in wanted else ProfilerAction.NONE

    return action


class Profiler:
    """The trainer's hook: ``begin(step)`` before each optimizer step, ``end(step)`` after it, ``close()`` when the
    loop ends (a window cut short by the end of the run is written then). ``publish(path, name)``, if given, is
    called on rank 0 with each trace written (the W&B artifact)."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int,
                 publish: Optional[Callable[[Path, str], None]] = None):
        self.cfg = cfg
        self.root = run_dir / PROFILE_DIR
        self.rank = rank
        self.publish = publish if cfg.wandb_artifact and rank == 0 else None
        self.traces: list[Path] = []
        self._prof: Any = None
        self._step = 0  # the training step the profiler is in
        self._memory = cfg.wants_memory_history and torch.cuda.is_available()
        if cfg.wants_memory_history and not self._memory and rank == 0:
            log.warning("profile.memory_snapshot_*: CUDA memory snapshots need a CUDA device; none taken")
        if self._memory:
            torch.cuda.memory._record_memory_history(max_entries=cfg.memory_history_entries)
            if cfg.memory_snapshot_on_oom:
                # CUDA builds only: torch ships no stub for it
                getattr(torch._C, "_cuda_attach_out_of_memory_observer")(self._on_oom)  # noqa: B009

    def begin(self, step: int) -> None:
        self._step = step
        if self.cfg.enabled and self._prof is None:
            self._prof = self._start(step)

    def end(self, step: int) -> None:
        if self._prof is not None:
            self._prof.step()
        if self._memory and step in self.cfg.memory_snapshot_steps:
            self._snapshot(self.root / "memory" / f"step_{step}" / f"rank_{self.rank}.pickle")

    def close(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()  # saves a window still being recorded
        if self._memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._memory = False

    def _start(self, first_step: int):
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] if self.cfg.cpu else []
        if self.cfg.cuda and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        if self.cfg.steps:
            plan = step_schedule(self.cfg.steps, first_step)
        else:
            plan = schedule(wait=self.cfg.wait, warmup=self.cfg.warmup, active=self.cfg.active,
                            repeat=self.cfg.repeat)
        prof = profile(activities=activities, schedule=plan, on_trace_ready=self._write_trace,
                       record_shapes=self.cfg.record_shapes, with_stack=self.cfg.with_stack,
                       profile_memory=self.cfg.profile_memory)
        prof.start()
        return prof

    def _write_trace(self, prof) -> None:
        """torch's on_trace_ready: called at the step that closes a window (or at stop)."""
        step = self._step
        suffix = ".json.gz" if self.cfg.gzip else ".json"  # torch's exporter gzips a name ending in .gz
        path = self.root / f"step_{step}" / f"rank_{self.rank}{suffix}"
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"rank_{self.rank}.partial{suffix}")  # a crash mid-export leaves no rank_R.json
        prof.export_chrome_trace(str(partial))
        partial.replace(path)
        self.traces.append(path)
        if self.rank == 0:
            log.info("profiler trace written: %s (open it in https://ui.perfetto.dev)", path)
        if self.publish is not None:
            self.publish(path, f"trace-step_{step}")

    def _snapshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        log.warning("rank %d: CUDA memory snapshot written: %s (view it at https://pytorch.org/memory_viz)",
                    self.rank, path)

    def _on_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        try:
            self._snapshot(self.root / "memory" / "oom" / f"rank_{self.rank}.pickle")
        except Exception as e:  # the OOM being raised is what the user must see; the snapshot is a bonus
            log.warning("rank %d: could not write the out-of-memory snapshot: %s", self.rank, e)

