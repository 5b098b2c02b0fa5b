"""Ring reduce-scatter and all-gather over gloo point-to-point, as the collectives DeepSpeed issues
(``cluster.collectives``): on the CPU test cluster, the bytes NCCL's ring algorithms would move.

gloo's ``reduce_scatter_tensor`` is an all-reduce followed by a copy: every rank sends about twice its buffer where
a ring reduce-scatter sends (g-1)/g of it, so a ZeRO-3 baseline measured on gloo pays for gradients a GPU user never
pays (docs/hpz.md). With ``cluster.collectives=ring`` (the default on the emulated cluster, ``tools.emulate``) the
two collectives ZeRO-3 and hpZ move their data with are replaced, for gloo process groups only, by the textbook
rings (each rank exchanges with its ring neighbours, group-rank order, through ``torch.distributed``'s
``batch_isend_irecv``: a send and a receive in flight together each step):

* reduce-scatter (g ranks, chunk c of every input goes to group rank c): g-1 steps; at step s rank r sends the
  running sum of chunk (r-s-1) mod g to r+1 and adds its own contribution to the sum it receives from r-1. Rank r's
  result is ``((x[r+1] + x[r+2]) + ...) + x[r]`` (ranks mod g, left to right): bitwise equal to gloo's native
  result for g = 2 (a + b == b + a), equal up to the order of summation (fp32: a few ulp) for g > 2, and bitwise
  equal to that left-to-right sum computed on one rank (the launch test checks both). Only ``ReduceOp.SUM``; any
  other op goes to gloo's collective.
* all-gather: g-1 steps; at step s rank r forwards chunk (r-s) mod g to r+1. A copy: bitwise equal to gloo's.

Each rank sends (g-1) chunks to its successor and nothing to anyone else. In a group of two the successor is also
the predecessor, and gloo runs the two directions of one pair's connection one after the other (measured on the
emulated cluster: 4 MB each way at once took 2.05x the byte time of one direction; 1.05-1.29x with each direction
on its own process group), where NCCL's send and receive use separate connections. So groups of two made through
:func:`new_group` while the rings are installed get a twin of the same ranks, and the exchange sends on one and
receives on the other (the lower rank sends on the group itself): one connection per direction, as NCCL.

The rings run synchronously on the caller's thread (an ``async_op`` caller gets a completed handle): no overlap of
these collectives with computation, which on CPU ranks share the cores with it anyway. NCCL groups are left alone
(NCCL's rings are the real thing).

Installed on DeepSpeed's communication backend object (``deepspeed.comm.comm.cdb``), as the functions its
``reduce_scatter_tensor`` / ``all_gather_into_tensor`` call (``cdb.reduce_scatter_function``,
``cdb.all_gather_function``): beneath :mod:`zerotrain.comm_accounting`, which wraps the methods, so each logical
collective is still counted once and the point-to-point steps are not counted again. ``native`` restores gloo's.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from zerotrain.errors import ZerotrainError

MODES = ("auto", "ring", "native")
EMULATED_ENV = "ZT_EMULATED_NNODES"  # set by tools.emulate for every process of an emulated cluster

_lock = threading.Lock()
_installed: dict[str, Callable] = {}  # attribute of cdb -> gloo's original function, while installed
_backend: Any = None
_sent: dict[int, int] = defaultdict(int)  # global destination rank -> bytes this rank's rings sent it
_twins: dict[Any, Any] = {}  # a 2-rank gloo group made by new_group() -> its twin (same ranks, own connections)
_exchanges: dict[str, int] = defaultdict(int)  # exchanges made on "one_group" / split over "two_groups"


class RingCollectivesError(ZerotrainError, RuntimeError):
    pass


def resolve(mode: str, environ=os.environ) -> str:
    """``auto``: ring on the emulated cluster (where the gloo baseline stands in for NCCL), native elsewhere."""
    if mode not in MODES:
        raise ValueError(f"cluster.collectives must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return "ring" if environ.get(EMULATED_ENV) else "native"
    return mode


def active() -> bool:
    """True while the ring collectives replace gloo's."""
    return bool(_installed)


def _read(counter: dict, reset: bool) -> dict:
    with _lock:
        out = dict(counter)
        if reset:
            counter.clear()
    return out


def bytes_sent(reset: bool = False) -> dict[int, int]:
    """Bytes the ring collectives sent from this rank, per global destination rank, since the last reset."""
    return _read(_sent, reset)


def exchanges(reset: bool = False) -> dict[str, int]:
    """Point-to-point exchanges made on one group / split over a 2-rank group and its twin, since the last reset."""
    return _read(_exchanges, reset)


def new_group(ranks: list[int]) -> Any:
    """``torch.distributed.new_group(ranks)``, plus, while the rings are installed on gloo and ``ranks`` are two, its
    twin (see the module docstring). Collective like ``new_group``: every rank calls it for every group, in the same
    order. Returns the group (torch's non-member sentinel on ranks outside it)."""
    import torch.distributed as tdist

    group = tdist.new_group(ranks)
    if active() and len(ranks) == 2 and tdist.get_backend() == "gloo":
        twin = tdist.new_group(ranks)
        if tdist.get_rank() in ranks:
            _twins[group] = twin
    return group


class _Done:
    """The handle of a collective that has already completed (``async_op=True`` callers wait on it)."""

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 -- the torch Work signature
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def _is_gloo(group: Any) -> bool:
    import torch.distributed as tdist

    return tdist.get_backend(group) == "gloo"


def _neighbours(group: Any) -> tuple[int, int, int, int]:
    """(group size, my group rank, successor's global rank, predecessor's global rank)."""
    import torch.distributed as tdist

    g = tdist.get_world_size(group)
    me = tdist.get_rank(group)
    nxt = tdist.get_global_rank(group, (me + 1) % g) if group is not None else (me + 1) % g
    prv = tdist.get_global_rank(group, (me - 1) % g) if group is not None else (me - 1) % g
    return g, me, nxt, prv


def _exchange(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, group: Any) -> None:
    import torch.distributed as tdist

    twin = _twins.get(group) if nxt == prv else None
    if twin is None:
        works = tdist.batch_isend_irecv([tdist.P2POp(tdist.isend, send, nxt, group),
                                         tdist.P2POp(tdist.irecv, recv, prv, group)])
    else:  # one direction per connection: the lower rank sends on the group, the higher on its twin
        out, into = (group, twin) if tdist.get_rank() < nxt else (twin, group)
        pending = (tdist.isend(send, nxt, group=out), tdist.irecv(recv, prv, group=into))
        works = [w for w in pending if w is not None]  # None only on a rank outside the group: not the case here
    for w in works:
        w.wait()
    with _lock:
        _sent[nxt] += send.numel() * send.element_size()
        _exchanges["one_group" if twin is None else "two_groups"] += 1


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Any = None) -> None:
    """Sum over the group of chunk ``group rank`` of every rank's ``input`` into ``output`` (ring algorithm)."""
    g, me, nxt, prv = _neighbours(group)
    if input.numel() != g * output.numel():
        raise ValueError(f"reduce-scatter input of {input.numel()} elements is not {g} chunks of {output.numel()}")
    chunks = input.view(g, -1)
    if g == 1:
        output.view(-1).copy_(chunks[0])
        return
    send = chunks[(me - 1) % g].clone()
    recv = torch.empty_like(send)
    for s in range(g - 1):
        _exchange(send, recv, nxt, prv, group)
        own = chunks[(me - s - 2) % g]  # the chunk whose running sum just arrived; the last one is mine
        if s == g - 2:
            torch.add(recv, own, out=output.view(-1))  # output may alias chunks[me]: read and written in place
        else:
            torch.add(recv, own, out=send)


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group: Any = None) -> None:
    """Every rank's ``input`` into chunk ``group rank`` of every rank's ``output`` (ring algorithm)."""
    g, me, nxt, prv = _neighbours(group)
    if output.numel() != g * input.numel():
        raise ValueError(f"all-gather output of {output.numel()} elements is not {g} chunks of {input.numel()}")
    chunks = output.view(g, -1)
    if chunks[me].data_ptr() != input.data_ptr():  # DeepSpeed often passes its own slice of the output
        chunks[me].copy_(input.reshape(-1))
    for s in range(g - 1):
        _exchange(chunks[(me - s) % g], chunks[(me - s - 1) % g], nxt, prv, group)


def _ring_reduce_scatter_function(native: Callable) -> Callable:
    def reduce_scatter_tensor(output_tensor, input_tensor, op=None, group=None, async_op=False):
        import torch.distributed as tdist

        sum_op = op is None or op == tdist.ReduceOp.SUM
        if not (sum_op and _is_gloo(group) and input_tensor.is_contiguous() and output_tensor.is_contiguous()):
            kwargs = {} if op is None else {"op": op}
            return native(output_tensor, input_tensor, group=group, async_op=async_op, **kwargs)
        ring_reduce_scatter(output_tensor, input_tensor, group)
        return _Done() if async_op else None

    setattr(reduce_scatter_tensor, "__zerotrain_ring__", True)  # noqa: B010 -- a marker the checker cannot type
    return reduce_scatter_tensor


def _ring_all_gather_function(native: Callable) -> Callable:
    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if not (_is_gloo(group) and output_tensor.is_contiguous()):
            return native(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)
        ring_all_gather(output_tensor, input_tensor, group)
        return _Done() if async_op else None

    setattr(all_gather_into_tensor, "__zerotrain_ring__", True)  # noqa: B010 -- a marker the checker cannot type
    return all_gather_into_tensor


_FACTORIES = {"reduce_scatter_function": _ring_reduce_scatter_function,
              "all_gather_function": _ring_all_gather_function}


def install(mode: str) -> str:
    """Make DeepSpeed's reduce-scatter and all-gather on gloo groups the rings (``ring``) or gloo's own
    (``native``; ``auto``: see :func:`resolve`). After ``deepspeed.init_distributed``; returns the mode used."""
    global _backend
    import deepspeed.comm.comm as ds_comm

    mode = resolve(mode)
    uninstall()
    if mode == "native":
        return mode
    backend = ds_comm.cdb
    if backend is None:
        raise RingCollectivesError("deepspeed.comm is not initialised: call deepspeed.init_distributed first")
    missing = [name for name in _FACTORIES if getattr(backend, name, None) is None]
    if missing:
        raise RingCollectivesError(
            f"cluster.collectives=ring: DeepSpeed's communication backend {type(backend).__name__} has no "
            f"{', '.join(missing)} (DeepSpeed changed how it calls torch's collectives); use cluster.collectives="
            f"native")
    for name, factory in _FACTORIES.items():
        native = getattr(backend, name)
        _installed[name] = native
        setattr(backend, name, factory(native))
    _backend = backend
    return mode


def uninstall() -> None:
    """Give DeepSpeed back gloo's collectives. Harmless when not installed."""
    global _backend
    for name, native in _installed.items():
        setattr(_backend, name, native)
    _installed.clear()
    _backend = None
