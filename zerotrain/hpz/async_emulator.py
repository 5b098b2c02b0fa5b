"""An emulated asynchronous accelerator: DeepSpeed's GPU stream code paths, and the hpZ shard race, on the CPU.

On DeepSpeed's CPU accelerator every operation has finished when it returns, so the
hpZ secondary-shard race (DeepSpeed issue #5059) cannot happen and every hpZ mode
computes the same thing. This module replaces that accelerator with one that
*orders* work like a GPU, so a CPU test run with DeepSpeed's real engine shows the
race -- and shows that a fix orders it away::

    from zerotrain.hpz import async_emulator
    async_emulator.install()    # first: before deepspeed.init_distributed(), zero.Init, deepspeed.initialize
    ...                         # train as usual
    async_emulator.report()     # races (parameter id, stream, where), stream operations seen
    async_emulator.uninstall()  # DeepSpeed's own accelerator and functions again

The model
---------
* The accelerator (:class:`AsyncEmulatorAccelerator`, a ``CPU_Accelerator``) says it
  has real streams: ``is_synchronized_device()``, ``resolves_data_dependency()`` and
  ``handles_memory_backpressure()`` are False, so DeepSpeed takes its CUDA branches
  (docs/hpz.md lists them). ``Stream``/``Event``/``stream()``/``current_stream()``
  (per thread, like CUDA's)/``default_stream()``/``synchronize()`` are its own.
* Streams are FIFO queues. Writes into hpZ secondary shards are really deferred:
  enqueued on the writing thread's current stream. Shard memory is what is
  allocated while ``Init._partition_param_sec`` runs, plus the byte range of a
  ``ds_secondary_tensor`` carved from memory made earlier (a pool, a flat buffer),
  adopted at the first write into it in the build. A write is any aten op whose
  schema marks an argument written (``Tensor(a!)``: in-place, ``out=``, TensorLists)
  -- ``copy_``, slice assignment, ``fill_``, ``cat(out=)``, ``index_copy_``,
  ``add(out=)``, ``_foreach_copy_``, ... -- found from the schema, not a list of names.
  One the emulator cannot defer (a call writing shard and other memory together, or
  returning a new tensor) raises :class:`EmulatorError` naming the op. Shard memory is
  filled with a poison value, as ``torch.empty`` (or a recycled block) leaves garbage.
* A deferred write becomes visible by CUDA's rules only: to later work on the same
  stream (program order); to another stream after it waited on an event recorded
  after the write (``wait_event``) or on the writing stream (``wait_stream``),
  transitively; to everyone once the host has waited for it (``synchronize()`` of the
  stream, an event or the device; ``.item()``/``bool()``/``torch.equal`` on the
  writing stream). Scheduling is the worst case CUDA allows: a queued write runs only
  when something forces it -- the compute stream is infinitely slow.
* Every access to a shard with a pending write that is not ordered before it is a
  race, recorded with the parameter id, the reading stream and where it happened
  (train/eval, forward/backward, step, micro-batch). The racy read sees the shard as
  it was before the write (the poison, for a fresh shard).
* The only allocator hazard modelled: the source of a deferred shard copy is the
  gathered parameter, which DeepSpeed allocates on the all-gather stream. If the
  parameter drops that memory before the copy ran and nobody called
  ``record_stream`` with the copying stream, the caching allocator could hand the
  block to the all-gather stream: the copy is recorded as a ``freed_source`` race and
  writes poison.

Limits (what only a GPU can show)
---------------------------------
It models ordering, not timing: whether a race corrupts a GPU run depends on how
long the copy takes, which this cannot say. There is no caching allocator:
``record_stream`` is recorded, not enforced, beyond the ``freed_source`` rule above.
NCCL's internal streams are not modelled (gloo runs collectives on its own threads; a
collective reading a shard reads a snapshot taken when it was issued). Only the shard
writes are deferred; every other operation runs at once, as if perfectly
synchronised, so races between other tensors are not seen. Reads that bypass
PyTorch's dispatcher (``tolist()``, ``numpy()``, ``.cpu()`` of a CPU tensor) are not
seen and are not host syncs. Autograd's stream propagation is not modelled: backward
runs on the default stream, as DeepSpeed's does on CUDA. Work on threads that did not
inherit the dispatch mode (PyTorch propagates it to autograd's threads) is not seen.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zerotrain.ds_patches import PatchSet
from zerotrain.errors import ZerotrainError

__all__ = [
    "DEFAULT_POISON",
    "AsyncEmulatorAccelerator",
    "EmulatedEvent",
    "EmulatedStream",
    "EmulatorError",
    "Race",
    "install",
    "is_installed",
    "phase",
    "races",
    "report",
    "reset",
    "shard_build",
    "uninstall"
]

# Finite on purpose: NaN in a shard makes ZeRO-3 skip the optimizer step (invalid gradient norm), a
# large finite value corrupts the weights the way uninitialised memory usually does.
DEFAULT_POISON = 1.0e3

_lock = threading.RLock()
_tls = threading.local()  # stream, executing, building, param
_emulator: _Emulator | None = None


class EmulatorError(ZerotrainError, RuntimeError):
    """The emulator was used in a way it cannot model (installed too late, not installed, ...)."""


@dataclass(frozen=True)
class Race:
    """One access to a shard whose pending write was not ordered before it."""

    kind: str  # "read" | "write" (an unordered access) | "freed_source" (copy source recycled before the copy ran)
    param_id: int | None  # ds_id of the parameter whose shard it is (None: not known)
    stream: str  # the stream of the access (for freed_source: the copying stream)
    writer_stream: str  # the stream the pending write was enqueued on
    where: str  # phase label, e.g. "train backward step 2 micro 0"
    op: str  # the aten/c10d operation that accessed the shard


# ----------------------------------------------------------------------------- streams and events


def _core() -> _Emulator:
    if _emulator is None:
        raise EmulatorError("zerotrain.hpz.async_emulator is not installed: call async_emulator.install() first")
    return _emulator


class EmulatedStream:
    """A FIFO queue of deferred shard writes plus the ordering edges CUDA would honour.

    ``_frontier[s] = n`` means: the first ``n`` writes of stream ``s`` happen before
    anything enqueued on this stream from now on (kept transitively closed).
    """

    _names = itertools.count(1)

    def __init__(self, device: Any = None, priority: int = 0, *, name: str | None = None,
                 _owner: _Emulator | None = None, **_: Any):
        self.name = name or f"stream-{next(EmulatedStream._names)}"
        self._queue: collections.deque[_DeferredWrite] = collections.deque()
        self._enqueued = 0  # sequence number of the next write
        self._completed = 0  # writes with a lower sequence number are visible to everyone (the host waited)
        self._frontier: dict[EmulatedStream, int] = {}
        (_owner if _owner is not None else _core())._streams.add(self)

    def __repr__(self) -> str:
        return f"<EmulatedStream {self.name} queued={len(self._queue)}>"

    def _merge(self, frontier: dict[EmulatedStream, int]) -> None:
        for stream, n in frontier.items():
            if stream is not self and n > self._frontier.get(stream, 0):
                self._frontier[stream] = n

    def _position(self) -> dict[EmulatedStream, int]:
        """Everything that happens before work enqueued here now (this stream's own writes included)."""
        return {**self._frontier, self: self._enqueued}

    def wait_event(self, event: EmulatedEvent) -> None:
        with _lock:
            _core()._count("wait_event", self.name)
            if event._frontier is not None:  # waiting on a never-recorded event is a no-op, as in CUDA
                self._merge(event._frontier)

    def wait_stream(self, stream: EmulatedStream) -> None:
        with _lock:
            _core()._count("wait_stream", f"{self.name}<-{stream.name}")
            self._merge(stream._position())

    def synchronize(self) -> None:
        with _lock:
            core = _core()
            core._count("stream_synchronize", self.name)
            core._host_wait(self._position())

    def query(self) -> bool:
        with _lock:
            return not self._queue

    def record_event(self, event: EmulatedEvent | None = None) -> EmulatedEvent:
        event = event if event is not None else EmulatedEvent()
        event.record(self)
        return event


class EmulatedEvent:
    """A point in a stream's queue, carrying everything that happened before it."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **_: Any):
        self._stream: EmulatedStream | None = None
        self._frontier: dict[EmulatedStream, int] | None = None
        self._time = 0.0

    def record(self, stream: EmulatedStream | None = None) -> None:
        with _lock:
            stream = stream if stream is not None else _core().current_stream()
            _core()._count("record_event", stream.name)
            self._stream = stream
            self._frontier = stream._position()
            self._time = time.perf_counter()

    def query(self) -> bool:
        """True once every write before the event has run (never, for an unforced compute stream)."""
        with _lock:
            if self._frontier is None:
                return True
            return all(not s._queue or s._queue[0].seq >= n for s, n in self._frontier.items())

    def synchronize(self) -> None:
        with _lock:
            if self._frontier is not None:
                assert self._stream is not None  # recorded together with the frontier
                _core()._count("event_synchronize", self._stream.name)
                _core()._host_wait(self._frontier)

    def wait(self, stream: EmulatedStream | None = None) -> None:
        (stream if stream is not None else _core().current_stream()).wait_event(self)

    def elapsed_time(self, end: EmulatedEvent) -> float:
        """Milliseconds of host time between the two ``record()`` calls (DeepSpeed's event timers use it)."""
        return (end._time - self._time) * 1000.0


# ----------------------------------------------------------------------------- the accelerator


def _accelerator_base():
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    return CPU_Accelerator


_AcceleratorBase: Any = _accelerator_base()  # a class the checker cannot see (DeepSpeed ships no types)


class AsyncEmulatorAccelerator(_AcceleratorBase):
    """DeepSpeed's CPU accelerator, reporting (emulated) asynchronous streams."""

    def is_synchronized_device(self) -> bool:
        return False

    def resolves_data_dependency(self) -> bool:
        return False

    def handles_memory_backpressure(self) -> bool:
        return False

    # use_host_timers() is CPU_Accelerator's: is_synchronized_device(), i.e. False -> DeepSpeed's event timers.

    @property
    def Stream(self):
        return EmulatedStream

    @property
    def Event(self):
        return EmulatedEvent

    @contextlib.contextmanager
    def stream(self, stream: EmulatedStream | None) -> Iterator[None]:
        previous = getattr(_tls, "stream", None)
        if stream is not None:  # torch.cuda.stream(None) is a no-op too
            _tls.stream = stream
        try:
            yield
        finally:
            _tls.stream = previous

    def current_stream(self, device_index: Any = None) -> EmulatedStream:
        return _core().current_stream()

    def default_stream(self, device_index: Any = None) -> EmulatedStream:
        return _core().default

    def synchronize(self, device_index: Any = None) -> None:
        with _lock:
            core = _core()
            core._count("device_synchronize", "all")
            core._host_wait({s: s._enqueued for s in list(core._streams)})


# ----------------------------------------------------------------------------- deferred writes


@dataclass(eq=False)
class _DeferredWrite:
    seq: int
    stream: EmulatedStream
    func: Any
    args: tuple
    kwargs: dict
    key: int  # destination storage
    frontier: dict[EmulatedStream, int]  # what had to happen before it (the stream's waits)
    source_param: Callable[[], Any] | None = None  # weakref to the parameter whose gathered data is the source
    source_key: int | None = None
    source_guarded: bool = False  # record_stream(self.stream) on the source after it was enqueued


@dataclass(eq=False)
class _PendingShard:
    """A shard storage with writes not yet visible to everyone."""

    storage: Any  # keeps the memory (and so its address) alive until the writes are visible
    param_id: int | None
    writes: list[_DeferredWrite] = field(default_factory=list)
    pre_image: Any = None  # the storage before its first early-executed write (what a racy read sees)


# Ops whose written argument changes metadata, not data (a view re-pointed, a tensor re-seated).
_METADATA_WRITE_OPS = frozenset({"aten::set_", "aten::resize_", "aten::resize_as_", "aten::detach_"})


@functools.lru_cache(maxsize=None)
def _written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of every argument the op's schema marks as written (``Tensor(a!)``, ``out=``)."""
    if func.namespace != "aten" or torch.Tag.inplace_view in func.tags or func._schema.name in _METADATA_WRITE_OPS:
        return ()
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _argument(args: tuple, kwargs: dict, position: int, name: str) -> Any:
    return args[position] if position < len(args) else kwargs.get(name)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage that ``t`` can touch: [start, end)."""
    if t.numel() == 0:
        return (0, 0)
    start = t.storage_offset() * t.element_size()
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return cast(tuple[int, int], (start, start + extent * t.element_size()))  # ints: no symbolic shapes here


_ALLOC_OPS = frozenset({
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default
})
# Ops that return a host value: on a GPU the host waits for the current stream.
_HOST_SYNC_OPS = frozenset({
    torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default, torch.ops.aten.is_nonzero.default
})
# Ops that read only shape/dtype, never data.
_METADATA_OPS = frozenset({
    torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
    torch.ops.aten.new_zeros.default, torch.ops.aten.new_ones.default, torch.ops.aten.new_full.default,
    torch.ops.aten.zeros_like.default, torch.ops.aten.ones_like.default, torch.ops.aten.full_like.default
})


def _key(t: torch.Tensor) -> int | None:
    """Identity of ``t``'s memory (None for tensors without a plain storage)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


@contextlib.contextmanager
def _executing() -> Iterator[None]:
    """Run the emulator's own tensor work without being intercepted by it."""
    previous = getattr(_tls, "executing", False)
    _tls.executing = True
    try:
        with torch.no_grad():
            yield
    finally:
        _tls.executing = previous


def _fill_poison(t: torch.Tensor, poison: float) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(poison)
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


def _view_of(storage: Any, like: torch.Tensor) -> torch.Tensor:
    out = torch.empty(0, dtype=like.dtype, device=like.device)
    return out.set_(storage, like.storage_offset(), like.size(), like.stride())


class _Emulator:
    """All emulator state; one per install()."""

    def __init__(self, poison: float):
        self.poison = poison
        self._streams: weakref.WeakSet[EmulatedStream] = weakref.WeakSet()
        # storage key -> (weakref to storage, ds_id, byte ranges of shard memory in it; None: all of it)
        self._shards: dict[int, tuple[Any, int | None, list[tuple[int, int]] | None]] = {}
        self._pending: dict[int, _PendingShard] = {}
        self._races: list[Race] = []
        self._counts: collections.Counter = collections.Counter()
        self.phase = "outside engine"
        self.default = EmulatedStream(name="default", _owner=self)

    # -- bookkeeping
    def _count(self, op: str, where: str) -> None:
        self._counts[(op, where)] += 1

    def current_stream(self) -> EmulatedStream:
        return getattr(_tls, "stream", None) or self.default

    def shard_id(self, t: torch.Tensor) -> int | None:
        """The registry key of ``t``'s storage if it is shard memory, else None."""
        key = _key(t)
        entry = self._shards.get(key) if key is not None else None
        if entry is None or entry[0]() is not t.untyped_storage():
            return None
        if entry[2] is not None:
            start, end = _byte_range(t)
            if not any(start < e and s < end for s, e in entry[2]):
                return None
        return key

    def adopt_secondary(self, t: torch.Tensor, param_id: int | None) -> None:
        """Shard memory DeepSpeed did not allocate in this build (a pool, a flat buffer): track its byte range.

        Poisoned like fresh memory -- a recycled block holds stale data on a GPU.
        """
        if t.numel() == 0 or self.shard_id(t) is not None:
            return
        storage = t.untyped_storage()
        key = storage._cdata
        entry = self._shards.get(key)
        if entry is None or entry[0]() is not storage:
            entry = (weakref.ref(storage), param_id, [])
            weakref.finalize(storage, self._forget_shard, key)
        if entry[2] is None:
            return
        self._shards[key] = (entry[0], param_id, [*entry[2], _byte_range(t)])
        with _executing():
            _fill_poison(t, self.poison)
        self._count("adopted_shard", self.current_stream().name)

    def shard_writes(self, func: Any, args: tuple, kwargs: dict) -> int | None:
        """The storage key of the shard ``func`` writes, or None; an error for a write it cannot defer."""
        written = _written_arguments(func)
        if not written:
            return None
        targets = [t for i, name in written for t in _tensors(_argument(args, kwargs, i, name))
                   if t.device.type == "cpu"]
        if getattr(_tls, "building", False):
            secondary = getattr(getattr(_tls, "param", None), "ds_secondary_tensor", None)
            if isinstance(secondary, torch.Tensor) and any(_key(t) == _key(secondary) for t in targets):
                self.adopt_secondary(secondary, getattr(_tls.param, "ds_id", None))
        keys = [self.shard_id(t) for t in targets]
        shard_keys = {k for k in keys if k is not None}
        if not shard_keys:
            return None
        if len(shard_keys) > 1 or None in keys:
            raise EmulatorError(f"{func} writes hpZ shard memory together with other memory in one call; the "
                                f"emulator defers a write into one shard storage only and does not model it")
        if any(r.alias_info is None for r in func._schema.returns):
            raise EmulatorError(f"{func} writes hpZ shard memory and returns a new tensor; the emulator cannot "
                                f"defer it and does not model it")
        return shard_keys.pop()

    def register_shard(self, t: torch.Tensor, param_id: int | None = None) -> None:
        """Fresh shard memory: poison it (it is garbage on a GPU) and watch every write into it."""
        if t.numel() == 0:
            return
        with _executing():
            _fill_poison(t, self.poison)
        storage = t.untyped_storage()
        key = storage._cdata
        self._shards[key] = (weakref.ref(storage), param_id, None)
        weakref.finalize(storage, self._forget_shard, key)
        self._count("poisoned_allocation", self.current_stream().name)

    def _forget_shard(self, key: int) -> None:
        with _lock:
            entry = self._shards.get(key)
            if entry is not None and entry[0]() is None:
                del self._shards[key]

    def label(self, t: torch.Tensor | None, param_id: int) -> None:
        if t is None or not isinstance(t, torch.Tensor):
            return
        key = self.shard_id(t)
        if key is not None:
            self._shards[key] = (self._shards[key][0], param_id, self._shards[key][2])
            if key in self._pending:
                self._pending[key].param_id = param_id

    # -- writes
    def defer(self, func: Any, args: tuple, kwargs: dict, key: int) -> Any:
        """Enqueue the write on the current stream; return what the op would (the written arguments)."""
        stream = self.current_stream()
        write = _DeferredWrite(seq=stream._enqueued, stream=stream, func=func, args=args, kwargs=kwargs, key=key,
                               frontier=dict(stream._frontier))
        param = getattr(_tls, "param", None)
        if func is torch.ops.aten.copy_.default and param is not None and isinstance(args[1], torch.Tensor):
            source_key = _key(args[1])
            if source_key == _key(param.data):  # copying from the gathered parameter
                write.source_param, write.source_key = weakref.ref(param), source_key
        stream._enqueued += 1
        stream._queue.append(write)
        state = self._pending.get(key)
        if state is None:
            state = self._pending[key] = _PendingShard(storage=self._shards[key][0](),
                                                       param_id=self._shards[key][1])
        else:  # a second write into the shard, not ordered after the first: a write-write race on a GPU
            unordered = [w for w in state.writes if not self._ordered(stream, w)]
            if unordered:
                self._record("write", key, stream, unordered[0].stream, func)
        state.writes.append(write)
        self._count("deferred_write", stream.name)
        if getattr(_tls, "building", False):
            self._count("deferred_write_in_shard_build", stream.name)
        return self._deferred_result(func, args, kwargs)

    @staticmethod
    def _deferred_result(func: Any, args: tuple, kwargs: dict) -> Any:
        arguments = func._schema.arguments
        results = []
        for ret in func._schema.returns:
            i = next(i for i, a in enumerate(arguments)
                     if a.alias_info is not None and a.alias_info.before_set == ret.alias_info.before_set)
            results.append(_argument(args, kwargs, i, arguments[i].name))
        if not results:
            return None
        return results[0] if len(results) == 1 else tuple(results)

    def note_record_stream(self, t: torch.Tensor, stream: EmulatedStream) -> None:
        self._count("record_stream", stream.name)
        key = _key(t)
        for other in list(self._streams):
            for write in other._queue:
                if write.source_key == key and write.stream is stream:
                    write.source_guarded = True

    def _ordered(self, reader: EmulatedStream, write: _DeferredWrite) -> bool:
        return (reader is write.stream or reader._frontier.get(write.stream, 0) > write.seq
                or write.stream._completed > write.seq)

    def _flush(self, stream: EmulatedStream, upto: int, reason: str) -> None:
        """Run ``stream``'s queued writes with sequence number < ``upto``, dependencies first."""
        while stream._queue and stream._queue[0].seq < upto:
            write = stream._queue.popleft()
            for other, n in write.frontier.items():
                self._flush(other, n, reason)
            self._execute(write)
            self._count(f"flush_{reason}", stream.name)

    def _execute(self, write: _DeferredWrite) -> None:
        state = self._pending.get(write.key)
        early = write.stream._completed <= write.seq  # run before the host has waited for it
        with _executing():
            if state is not None and early and state.pre_image is None:
                state.pre_image = state.storage.clone()
            if self._source_recycled(write):
                self._record("freed_source", write.key, write.stream, write.stream, write.func)
                for i, name in _written_arguments(write.func):
                    for t in _tensors(_argument(write.args, write.kwargs, i, name)):
                        _fill_poison(t, self.poison)
            else:
                write.func(*write.args, **write.kwargs)

    def _source_recycled(self, write: _DeferredWrite) -> bool:
        if write.source_param is None or write.source_guarded:
            return False
        param = write.source_param()
        return param is not None and _key(param.data) != write.source_key

    def _host_wait(self, frontier: dict[EmulatedStream, int]) -> None:
        """The host waited for everything in ``frontier``: run it; it is now visible to every stream."""
        if getattr(_tls, "building", False):
            self._count("host_wait_in_shard_build", self.current_stream().name)
        for stream, n in frontier.items():
            stream._completed = max(stream._completed, n)
        for stream, n in frontier.items():
            self._flush(stream, n, "host")
        for key in [k for k, s in self._pending.items() if all(w.stream._completed > w.seq for w in s.writes)]:
            del self._pending[key]

    # -- reads
    def access(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Check every tensor argument against pending writes; a racy read gets the pre-write contents."""
        reader = self.current_stream()
        values, kwargs = list(args), dict(kwargs)
        for i, schema in enumerate(func._schema.arguments):
            writes = schema.alias_info is not None and schema.alias_info.is_write
            if i < len(values):
                values[i] = self._access_value(values[i], reader, func, writes)
            elif schema.name in kwargs:
                kwargs[schema.name] = self._access_value(kwargs[schema.name], reader, func, writes)
        return tuple(values), kwargs

    def _access_value(self, value: Any, reader: EmulatedStream, func: Any, writes: bool) -> Any:
        if isinstance(value, torch.Tensor):
            return self._access_tensor(value, reader, func, writes)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._access_value(v, reader, func, writes) for v in value)
        return value

    def _access_tensor(self, t: torch.Tensor, reader: EmulatedStream, func: Any, writes: bool) -> torch.Tensor:
        if t.device.type != "cpu" or not self._pending:
            return t
        key = _key(t)
        state = self._pending.get(key) if key is not None else None
        # not shard memory, or outside a pool shard's byte range
        if key is None or state is None or self.shard_id(t) is None:
            return t
        unordered = [w for w in state.writes if not self._ordered(reader, w)]
        if not unordered:
            for w in state.writes:
                self._flush(w.stream, w.seq + 1, "program_order" if w.stream is reader else "ordered")
            return t
        self._record("write" if writes else "read", key, reader, unordered[0].stream, func)
        if writes or state.pre_image is None:
            return t  # the writes have not run: the live memory is what the read would see
        with _executing():
            return _view_of(state.pre_image, t)

    def freeze_collective_inputs(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """gloo reads a collective's inputs later, on its own thread; snapshot shard inputs now."""
        names = [a.name for a in func._schema.arguments]

        def freeze(value):
            if isinstance(value, torch.Tensor) and self.shard_id(value) is not None:
                with _executing():
                    return value.clone()
            if isinstance(value, (list, tuple)):
                return type(value)(freeze(v) for v in value)
            return value

        args = tuple(freeze(v) if i < len(names) and names[i].startswith("input") else v for i, v in enumerate(args))
        kwargs = {k: freeze(v) if k.startswith("input") else v for k, v in kwargs.items()}
        return args, kwargs

    def _record(self, kind: str, key: int, stream: EmulatedStream, writer: EmulatedStream, func: Any) -> None:
        state = self._pending.get(key)
        param_id = state.param_id if state is not None else self._shards.get(key, (None, None))[1]
        self._races.append(Race(kind, param_id, stream.name, writer.name, self.phase, str(func)))

    # -- results
    def report(self) -> dict[str, Any]:
        by_op: dict[str, dict[str, int]] = collections.defaultdict(dict)
        for (op, where), n in sorted(self._counts.items()):
            by_op[op][where] = n
        unordered = [r for r in self._races if r.kind != "freed_source"]
        return {
            "races": len(unordered),
            "freed_source_races": len(self._races) - len(unordered),
            "races_by_where": dict(collections.Counter(r.where for r in unordered)),
            "races_by_stream": dict(collections.Counter(r.stream for r in unordered)),
            "racy_params": sorted({r.param_id for r in self._races if r.param_id is not None}),
            "pending_writes": sum(len(s._queue) for s in list(self._streams)),
            "shard_storages": len(self._shards),
            "ops": {op: dict(v) for op, v in by_op.items()},
        }

    def reset(self) -> None:
        self._races.clear()
        self._counts.clear()

    def drain(self) -> None:
        self._host_wait({s: s._enqueued for s in list(self._streams)})


class _ShardWriteDeferral(TorchDispatchMode):
    """Sees every aten/c10d op: registers fresh shard memory, defers writes into it, checks reads."""

    def __init__(self, emulator: _Emulator):
        super().__init__()
        self.emulator = emulator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_tls, "executing", False):
            return func(*args, **kwargs)
        em = self.emulator
        if func in _ALLOC_OPS and getattr(_tls, "building", False):
            out = func(*args, **kwargs)
            with _lock:
                em.register_shard(out)
            return out
        with _lock:
            key = em.shard_writes(func, args, kwargs)
            if key is not None:
                return em.defer(func, args, kwargs, key)
            if em._pending and not func.is_view and func not in _METADATA_OPS:
                args, kwargs = em.access(func, args, kwargs)
            if func.namespace == "c10d" and em._shards:
                args, kwargs = em.freeze_collective_inputs(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in _HOST_SYNC_OPS:
            with _lock:
                em._count("host_sync_op", em.current_stream().name)
                em._host_wait(em.current_stream()._position())
        return out


# ----------------------------------------------------------------------------- scopes


@contextlib.contextmanager
def shard_build(param: Any = None) -> Iterator[None]:
    """Treat memory allocated inside as fresh hpZ shard memory (poisoned, writes deferred).

    Installed on ``Init._partition`` automatically (around the secondary partition,
    outside the primary one); use it directly when calling a shard builder by hand.
    ``param``: the parameter being partitioned -- its id labels races, and its data is
    the copy source watched by the ``freed_source`` rule.
    """
    previous = (getattr(_tls, "building", False), getattr(_tls, "param", None))
    _tls.building, _tls.param = True, param
    try:
        yield
    finally:
        _tls.building, _tls.param = previous
        if param is not None and _emulator is not None and hasattr(param, "ds_id"):
            with _lock:
                _emulator.label(getattr(param, "ds_secondary_tensor", None), param.ds_id)


@contextlib.contextmanager
def _outside_shard_build() -> Iterator[None]:
    previous = getattr(_tls, "building", False)
    _tls.building = False
    try:
        yield
    finally:
        _tls.building = previous


@contextlib.contextmanager
def phase(label: str) -> Iterator[None]:
    """Label races recorded inside (the engine's forward/backward/step are labelled automatically)."""
    em = _core()
    previous, em.phase = em.phase, label
    try:
        yield
    finally:
        em.phase = previous


def _engine_phase(engine: Any, what: str) -> str:
    if what == "forward" and not engine.module.training:
        return f"eval forward step {engine.global_steps}"
    micro = engine.micro_steps % max(1, engine.gradient_accumulation_steps())
    if what == "step":
        return f"train step {engine.global_steps} micro {micro}"
    return f"train {what} step {engine.global_steps} micro {micro}"


# ----------------------------------------------------------------------------- install / uninstall

_mode: _ShardWriteDeferral | None = None
_patches: PatchSet | None = None
_previous_accelerator: Any = None
_install_thread: int | None = None


def install(poison: float = DEFAULT_POISON, *, label_engine_phases: bool = True) -> AsyncEmulatorAccelerator:
    """Replace DeepSpeed's CPU accelerator with the emulated asynchronous one.

    Call it first -- before ``deepspeed.init_distributed()``, ``zero.Init`` and
    ``deepspeed.initialize``: DeepSpeed asks the accelerator for streams while it
    builds engines. Installs, and ``uninstall()`` undoes:
    ``deepspeed.accelerator.set_accelerator``; a global ``TorchDispatchMode`` on this
    thread (inherited by autograd's threads); wrappers on ``Init._partition`` /
    ``Init._partition_param`` (to know when a secondary shard is built, whatever
    builder is installed) and on ``DeepSpeedEngine.forward``/``backward``/``step``
    (to label where races happen; ``label_engine_phases=False`` leaves them alone);
    ``torch.Tensor.record_stream`` (the emulated streams are not torch streams).
    Idempotent with the same ``poison``.
    """
    global _mode, _patches, _previous_accelerator, _install_thread, _emulator
    with _lock:
        if _mode is not None:
            assert _emulator is not None  # installed together with _mode
            if _emulator.poison != poison:
                raise EmulatorError(f"already installed with poison={_emulator.poison}; uninstall() first")
            from deepspeed.accelerator import get_accelerator
            return get_accelerator()
        _check_can_install()
        from deepspeed.accelerator import get_accelerator, set_accelerator
        _previous_accelerator = get_accelerator()
        _emulator = _Emulator(poison)
        accelerator = AsyncEmulatorAccelerator()
        _patches = _apply_patches(label_engine_phases)
        set_accelerator(accelerator)
        _mode = _ShardWriteDeferral(_emulator)
        _mode.__enter__()
        _install_thread = threading.get_ident()
        return accelerator


def _check_can_install() -> None:
    import torch.distributed as tdist
    if tdist.is_available() and tdist.is_initialized():
        raise EmulatorError("async_emulator.install() must run before the process group exists (before "
                            "deepspeed.init_distributed()/torch.distributed.init_process_group()): DeepSpeed "
                            "creates its streams with the accelerator it finds then")
    from deepspeed.accelerator import get_accelerator
    found = get_accelerator()
    if getattr(found, "_name", None) != "cpu":
        raise EmulatorError(f"the emulator replaces DeepSpeed's CPU accelerator, but the accelerator is "
                            f"{getattr(found, '_name', found)!r} (DS_ACCELERATOR=cpu selects the CPU one); on a GPU "
                            f"the race is real and needs no emulation (docs/hpz.md)")


def _apply_patches(label_engine_phases: bool) -> PatchSet:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import Init

    patches = PatchSet()
    partition = Init._partition

    @functools.wraps(partition)
    def _partition(self, param_list, force=False, has_been_updated=False, free_data=True):
        # One parameter at a time (DeepSpeed's loop body is per parameter) so that the shard build
        # knows its parameter; the secondary partition is everything outside _partition_param.
        for param in param_list:
            with shard_build(param):
                partition(self, [param], force=force, has_been_updated=has_been_updated, free_data=free_data)

    patches.replace(Init, "_partition", _partition)
    partition_param = Init._partition_param

    @functools.wraps(partition_param)
    def _partition_param(self, *args, **kwargs):
        with _outside_shard_build():
            return partition_param(self, *args, **kwargs)

    patches.replace(Init, "_partition_param", _partition_param)

    original_record_stream = torch.Tensor.record_stream

    def record_stream(tensor, stream):
        if isinstance(stream, EmulatedStream):
            with _lock:
                _core().note_record_stream(tensor, stream)
            return None
        return original_record_stream(tensor, stream)

    patches.replace(torch.Tensor, "record_stream", record_stream)

    if label_engine_phases:
        for what in ("forward", "backward", "step"):
            patches.replace(DeepSpeedEngine, what, _labelled(getattr(DeepSpeedEngine, what), what))
    return patches


def _labelled(method: Callable, what: str) -> Callable:

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        em = _emulator
        if em is None:
            return method(self, *args, **kwargs)
        previous, em.phase = em.phase, _engine_phase(self, what)
        try:
            return method(self, *args, **kwargs)
        finally:
            em.phase = previous

    return wrapper


def uninstall() -> None:
    """Run every pending write, leave the dispatch mode, restore DeepSpeed's accelerator and functions."""
    global _mode, _patches, _previous_accelerator, _install_thread, _emulator
    with _lock:
        if _mode is None:
            return
        if threading.get_ident() != _install_thread:
            raise EmulatorError("uninstall() must run on the thread that called install() (the dispatch mode "
                                "stack is per thread)")
        assert _emulator is not None and _patches is not None  # installed together with _mode
        _emulator.drain()
        _mode.__exit__(None, None, None)
        _patches.restore()
        from deepspeed.accelerator import set_accelerator
        set_accelerator(_previous_accelerator)
        _mode = _patches = _previous_accelerator = _install_thread = None
        _emulator = None


def is_installed() -> bool:
    return _mode is not None


def report() -> dict[str, Any]:
    """What the emulator saw since install()/reset(): a JSON-serialisable summary.

    ``races`` (unordered accesses to pending shard writes), ``freed_source_races``,
    ``races_by_where``, ``races_by_stream``, ``racy_params`` (ds_ids), ``pending_writes``, and ``ops``:
    counts per operation and stream, e.g. ``ops["wait_event"]["stream-1"]``,
    ``ops["wait_stream"]["default<-stream-1"]``, ``ops["host_wait_in_shard_build"]``
    (host syncs issued by a shard builder), ``ops["deferred_write"]``.
    """
    with _lock:
        return _core().report()


def races() -> list[Race]:
    """Every race recorded since install()/reset(), in order."""
    with _lock:
        return list(_core()._races)


def reset() -> None:
    """Forget recorded races and counts (pending writes stay pending)."""
    with _lock:
        _core().reset()
