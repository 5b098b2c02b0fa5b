"""Communication accounting: bytes each rank sends and receives per collective, split intra-node / inter-node.

hpZ's whole point is *where* bytes go: the backward all-gather moves from the world (crossing the slow links between
nodes) to a node-local group. This module counts that on the real job, at the collective layer, from the real
rank-to-node layout (:class:`zerotrain.launch.layout.NodeLayout`).

Where it hooks
--------------
Every ``deepspeed.comm`` entry point ends in exactly one method of the communication backend object
``deepspeed.comm.comm.cdb`` (``TorchBackend`` on gloo/NCCL): ``allgather_fn`` -> ``all_gather_into_tensor`` ->
``cdb.all_gather_into_tensor``; ``reduce_scatter_fn`` -> ``reduce_scatter_tensor`` -> ``cdb.reduce_scatter_tensor``;
``all_reduce``, ``broadcast``, ``all_to_all_single``, ... -> the ``cdb`` method of the same name. :func:`install`
wraps those methods on that one object, so each logical collective is counted once whichever entry point (or
alias: ``deepspeed.comm`` re-exports ``deepspeed.comm.comm`` by value) the caller used. In DeepSpeed 0.19.8
ZeRO-3 (+ hpZ) calls:

* parameter all-gather (forward over the world; hpZ backward over the hpZ group): ``dist.allgather_fn`` ->
  ``all_gather_into_tensor``, one call per coalesced bucket, or per parameter (``_all_gather_sequential``);
* gradient reduce-scatter (``reduce_scatter_coalesced``): ``dist.reduce_scatter_fn`` -> ``reduce_scatter_tensor``,
  over the world (hpZ does not change it); with ``hpz.grad_reduce=hierarchical`` instead a ``reduce_scatter_tensor``
  over the hpZ group, then over the ranks with the same hpZ-local rank another ``reduce_scatter_tensor`` (a ring:
  NCCL, ``cluster.collectives=ring``) or an ``all_to_all_single`` (gloo's native collectives)
  (:mod:`zerotrain.hpz.grad_reduce`);
* ``all_reduce`` (gradient norm, overflow checks), ``broadcast`` (``zero.Init`` initial parameters), ``barrier``;
* with qgZ (``zero_quantized_gradients``): ``all_to_all_single``; other paths ``all_gather``, ``reduce_scatter``.

Calls made directly on ``torch.distributed`` (the trainer's loss all-reduce, ``all_gather_object`` of the layout)
are not DeepSpeed's and are not counted. Nothing is patched until :func:`install`: zero cost otherwise.

The byte model (logical payload, per peer)
------------------------------------------
For each call, rank r in group G (size g) counts the bytes it must *receive from* and *send to* each other member
by the collective's semantics, and attributes each peer's bytes to intra-node (same node as r) or inter-node:

=====================  =========================================================================================
all_gather (N bytes    r receives each peer's N-byte shard and sends its own to each peer: N per peer each way.
in per rank)
reduce_scatter (M      r receives each peer's contribution to r's M-byte output chunk and sends each peer its
bytes out per rank)    contribution to theirs: M per peer each way.
all_reduce (N bytes)   as reduce-scatter + all-gather of N/g chunks (the bandwidth-optimal algorithm): 2N/g per
                       peer each way.
broadcast (N bytes)    the root sends N to every other member; each non-root receives N from the root.
reduce (N bytes)       every non-destination sends N to the destination.
all_to_all             chunk j of the input goes to member j, chunk j of the output comes from member j.
send / recv            N to / from the peer.
gather / scatter       as reduce / broadcast with each member's own chunk.
barrier, *_object      0 bytes (counted as calls only).
=====================  =========================================================================================

Why this model and not the wire bytes of one algorithm: it is exact and independent of the library's algorithm
(gloo rings, NCCL rings/trees, PXN...), so it answers the question hpZ is about — how much data *must* cross
node boundaries for the collective's semantics — and it is what the ZeRO++ paper's volume arithmetic uses. A ring
all-gather over node-contiguous ranks actually crosses each node boundary fewer times than the logical payload
suggests (for 2 nodes x k ranks, 2(g-1)N crossing bytes in total against the logical 2k^2 N = g^2 N / 2), and a
hierarchical algorithm differs again; the wire bytes of one run are what ``tc -s qdisc`` shows on the emulated
cluster (``tools.emulate``). For every rank: sum(recv) over ranks == sum(send) over ranks, per category.

The ring model (bytes out of each node)
---------------------------------------
Beside the logical count, each call is also counted as a bandwidth-optimal ring would run it (NCCL's ring
algorithms; :mod:`zerotrain.ring_collectives` on gloo): the group's ranks in group order form a ring and rank r
sends only to its successor -- all_gather / reduce_scatter (g-1) chunks, all_reduce 2(g-1)/g of the buffer, a
broadcast (reduce) passes the whole buffer along the chain from (to) the root; all_to_all, send/recv, gather and
scatter go straight to their peers as in the logical count. The bytes a rank sends that way to a successor on
another node are ``ring_send_inter``; summed over the ranks and divided by the nodes they are the inter-node bytes
per node under the ring model (``comm/ring_inter_node_bytes_per_node``), which the emulated cluster's wire bytes
per node match (benchmarks/slow_link.py) and :mod:`zerotrain.comm_model` predicts in closed form. For a flat
reduce-scatter over W node-contiguous ranks that is (W-1)/W of the buffer per node, where the logical count says
(W-k)/W per rank, i.e. k(W-k)/W per node.

Counters
--------
:func:`snapshot_and_reset` returns ``{kind: {"calls", "send_intra", "send_inter", "recv_intra", "recv_inter"}}``
for this rank (``all_ranks=True``: summed over every rank of the world, a collective every rank must call) and
zeroes them; :func:`metrics_record` turns a snapshot into per-step averages under the ``comm/*`` keys the trainer
logs. ``inter_node_bytes`` there is bytes *received* from other nodes (summed over ranks: the bytes that crossed
the inter-node network, each byte counted once); ``inter_node_bytes_per_node`` the same divided by the nodes, and
``ring_inter_node_bytes_per_node`` the ring model's (above).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from zerotrain.ds_patches import add_collective_hook, remove_collective_hook, require_supported
from zerotrain.errors import ZerotrainError
from zerotrain.launch.layout import NodeLayout

FIELDS = ("calls", "send_intra", "send_inter", "recv_intra", "recv_inter")
RING_FIELD = "ring_send_inter"  # the ring model's bytes to an off-node successor (module docstring)
_DIRECT = ("all_to_all", "p2p", "gather", "scatter")  # kinds a ring model sends straight to the peers


@dataclass
class CommConfig:
    """The ``comm`` section of the run config."""

    accounting: bool = False
    """Count the bytes of every collective, split intra-/inter-node by the real node layout, logged per step as
    comm/*. Installed once the model and engine exist (start-up traffic is not counted); costs one small all-reduce
    per log interval."""

# cdb method -> (kind reported, byte rule). Kinds group the methods that are the same collective.
_METHODS: dict[str, str] = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_base": "all_gather",
    "all_gather": "all_gather",
    "all_gather_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "inference_all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "all_to_all_single": "all_to_all",
    "all_to_all": "all_to_all",
    "send": "p2p",
    "isend": "p2p",
    "recv": "p2p",
    "irecv": "p2p",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
    "all_gather_object": "object",
    "broadcast_object_list": "object",
}


class AccountingError(ZerotrainError, RuntimeError):
    pass


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def _arg(args: tuple, kwargs: dict, index: int, *names: str, default: Any = None) -> Any:
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return args[index] if len(args) > index else default


class _Accountant:
    def __init__(self, layout: NodeLayout, rank: int):
        self.layout = layout
        self.rank = rank
        self.node = layout.node_index[rank]
        self.lock = threading.Lock()
        self.counters: dict[str, list[float]] = {}
        self.ring: dict[str, float] = {}  # kind -> RING_FIELD bytes
        self._group_ranks: dict[int, tuple[tuple[int, ...], int]] = {}  # id(group) -> (global ranks, my index)

    # -- groups ------------------------------------------------------------------------------------------------
    def group(self, group: Any) -> tuple[tuple[int, ...], int]:
        key = id(group)
        cached = self._group_ranks.get(key)
        if cached is None:
            import torch.distributed as tdist

            if group is None or group is tdist.GroupMember.WORLD:
                ranks = tuple(range(tdist.get_world_size()))
            else:
                ranks = tuple(tdist.get_process_group_ranks(group))
            if self.rank not in ranks:
                raise AccountingError(f"rank {self.rank} called a collective on group {ranks} it is not part of")
            cached = (ranks, ranks.index(self.rank))
            # Keep the group object alive while cached so its id() cannot be reused by another group.
            self._group_ranks[key] = cached
            self._keep = getattr(self, "_keep", [])
            self._keep.append(group)
        return cached

    def _peers(self, ranks: tuple[int, ...]) -> tuple[int, int]:
        """(intra-node peers, inter-node peers) of this rank in ``ranks``."""
        intra = sum(1 for r in ranks if r != self.rank and self.layout.node_index[r] == self.node)
        inter = sum(1 for r in ranks if self.layout.node_index[r] != self.node)
        return intra, inter

    def _is_intra(self, peer: int) -> bool:
        return self.layout.node_index[peer] == self.node

    # -- counting ----------------------------------------------------------------------------------------------
    def add(self, kind: str, send_intra: float = 0, send_inter: float = 0, recv_intra: float = 0,
            recv_inter: float = 0) -> None:
        with self.lock:
            c = self.counters.setdefault(kind, [0, 0, 0, 0, 0])
            c[0] += 1
            c[1] += send_intra
            c[2] += send_inter
            c[3] += recv_intra
            c[4] += recv_inter

    def symmetric(self, kind: str, group: Any, per_peer: float) -> None:
        """Every member exchanges ``per_peer`` bytes with every other member, each way."""
        ranks, _ = self.group(group)
        intra, inter = self._peers(ranks)
        self.add(kind, intra * per_peer, inter * per_peer, intra * per_peer, inter * per_peer)

    def rooted(self, kind: str, group: Any, root_global: int, nbytes: float, to_root: bool) -> None:
        """One root exchanges ``nbytes`` with every other member (broadcast/scatter: from it; reduce/gather: to it)."""
        ranks, _ = self.group(group)
        if root_global == self.rank:
            intra, inter = self._peers(ranks)
            if to_root:
                self.add(kind, recv_intra=intra * nbytes, recv_inter=inter * nbytes)
            else:
                self.add(kind, send_intra=intra * nbytes, send_inter=inter * nbytes)
        else:
            same = self._is_intra(root_global)
            amount = {("send" if to_root else "recv") + ("_intra" if same else "_inter"): nbytes}
            self.add(kind, **amount)

    def peer(self, kind: str, group: Any, peer_group_rank: Optional[int], nbytes: float, sending: bool) -> None:
        if peer_group_rank is None:  # recv from any source: unknown peer, count as inter-node (conservative)
            self.add(kind, **{("send" if sending else "recv") + "_inter": nbytes})
            return
        peer = self.group(group)[0][peer_group_rank] if group is not None else peer_group_rank
        amount = {("send" if sending else "recv") + ("_intra" if self._is_intra(peer) else "_inter"): nbytes}
        self.add(kind, **amount)

    def all_to_all(self, group: Any, out_chunks: list[int], in_chunks: list[int]) -> None:
        ranks, me = self.group(group)
        c = {"send_intra": 0, "send_inter": 0, "recv_intra": 0, "recv_inter": 0}
        for j, r in enumerate(ranks):
            if j == me:
                continue
            where = "_intra" if self._is_intra(r) else "_inter"
            c["send" + where] += in_chunks[j]
            c["recv" + where] += out_chunks[j]
        self.add("all_to_all", **c)

    def _ring_send(self, kind: str, group: Any, nbytes: float, sends: bool = True) -> None:
        """Under the ring model this rank sends ``nbytes`` to its successor in ``group`` (if ``sends``)."""
        ranks, me = self.group(group)
        if not sends or len(ranks) < 2 or self._is_intra(ranks[(me + 1) % len(ranks)]):
            return
        with self.lock:
            self.ring[kind] = self.ring.get(kind, 0.0) + nbytes

    def _ring_model(self, method: str, args: tuple, kwargs: dict) -> None:
        kind = _METHODS[method]
        if method in ("all_gather_into_tensor", "all_gather_base", "all_gather", "all_gather_coalesced"):
            group = _arg(args, kwargs, 2, "group")
            if method == "all_gather_coalesced":
                nbytes = sum(_nbytes(t) for t in _arg(args, kwargs, 1, "input_tensors"))
            else:
                nbytes = _nbytes(_arg(args, kwargs, 1, "input_tensor", "tensor"))
            self._ring_send(kind, group, (len(self.group(group)[0]) - 1) * nbytes)
        elif method in ("reduce_scatter_tensor", "reduce_scatter"):
            group = _arg(args, kwargs, 3, "group")
            nbytes = _nbytes(_arg(args, kwargs, 0, "output_tensor", "output"))
            self._ring_send(kind, group, (len(self.group(group)[0]) - 1) * nbytes)
        elif method in ("all_reduce", "inference_all_reduce", "all_reduce_coalesced"):
            group = _arg(args, kwargs, 2, "group")
            g = len(self.group(group)[0])
            tensors = _arg(args, kwargs, 0, "tensors", "tensor")
            nbytes = sum(_nbytes(t) for t in tensors) if method == "all_reduce_coalesced" else _nbytes(tensors)
            self._ring_send(kind, group, 2 * (g - 1) / g * nbytes)
        elif method in ("broadcast", "reduce"):
            group = _arg(args, kwargs, 2 if method == "broadcast" else 4, "group")
            root = int(_arg(args, kwargs, 1, "src" if method == "broadcast" else "dst"))
            ranks, me = self.group(group)
            successor = ranks[(me + 1) % len(ranks)]
            # The chain starts at the root's successor (reduce) or at the root (broadcast) and ends before it.
            sends = successor != root if method == "broadcast" else self.rank != root
            self._ring_send(kind, group, _nbytes(_arg(args, kwargs, 0, "tensor")), sends)

    # -- the rules per backend method -------------------------------------------------------------------------
    def record(self, method: str, args: tuple, kwargs: dict) -> None:
        kind = _METHODS[method]
        if kind in _DIRECT:  # the ring model's bytes are the logical ones
            before = self.counters.get(kind, [0] * 5)[2]
            self._record_logical(method, args, kwargs)
            sent = self.counters[kind][2] - before
            if sent:
                with self.lock:
                    self.ring[kind] = self.ring.get(kind, 0.0) + sent
            return
        self._record_logical(method, args, kwargs)
        self._ring_model(method, args, kwargs)

    def _record_logical(self, method: str, args: tuple, kwargs: dict) -> None:
        kind = _METHODS[method]
        group = kwargs.get("group")
        if method in ("all_gather_into_tensor", "all_gather_base"):
            group = _arg(args, kwargs, 2, "group")
            self.symmetric(kind, group, _nbytes(_arg(args, kwargs, 1, "input_tensor", "tensor")))
        elif method == "all_gather":
            group = _arg(args, kwargs, 2, "group")
            self.symmetric(kind, group, _nbytes(_arg(args, kwargs, 1, "tensor")))
        elif method == "all_gather_coalesced":
            group = _arg(args, kwargs, 2, "group")
            self.symmetric(kind, group, sum(_nbytes(t) for t in _arg(args, kwargs, 1, "input_tensors")))
        elif method == "reduce_scatter_tensor":
            group = _arg(args, kwargs, 3, "group")
            self.symmetric(kind, group, _nbytes(_arg(args, kwargs, 0, "output_tensor")))
        elif method == "reduce_scatter":
            group = _arg(args, kwargs, 3, "group")
            self.symmetric(kind, group, _nbytes(_arg(args, kwargs, 0, "output")))
        elif method in ("all_reduce", "inference_all_reduce"):
            group = _arg(args, kwargs, 2, "group")
            ranks, _ = self.group(group)
            self.symmetric(kind, group, 2 * _nbytes(_arg(args, kwargs, 0, "tensor")) / len(ranks))
        elif method == "all_reduce_coalesced":
            group = _arg(args, kwargs, 2, "group")
            ranks, _ = self.group(group)
            total = sum(_nbytes(t) for t in _arg(args, kwargs, 0, "tensors"))
            self.symmetric(kind, group, 2 * total / len(ranks))
        elif method == "broadcast":
            group = _arg(args, kwargs, 2, "group")
            # deepspeed.comm passes the *global* rank of the root (torch.distributed semantics).
            self.rooted(kind, group, int(_arg(args, kwargs, 1, "src")), _nbytes(_arg(args, kwargs, 0, "tensor")),
                        to_root=False)
        elif method == "reduce":
            group = _arg(args, kwargs, 4, "group")
            self.rooted(kind, group, int(_arg(args, kwargs, 1, "dst")), _nbytes(_arg(args, kwargs, 0, "tensor")),
                        to_root=True)
        elif method == "gather":
            group = _arg(args, kwargs, 3, "group")
            self.rooted(kind, group, int(_arg(args, kwargs, 2, "dst", default=0)),
                        _nbytes(_arg(args, kwargs, 0, "tensor")), to_root=True)
        elif method == "scatter":
            group = _arg(args, kwargs, 3, "group")
            self.rooted(kind, group, int(_arg(args, kwargs, 2, "src", default=0)),
                        _nbytes(_arg(args, kwargs, 0, "tensor")), to_root=False)
        elif method == "all_to_all_single":
            group = _arg(args, kwargs, 4, "group")
            out, inp = _arg(args, kwargs, 0, "output"), _arg(args, kwargs, 1, "input", "tensor")
            ranks, _ = self.group(group)
            self.all_to_all(group, _splits(out, _arg(args, kwargs, 2, "output_split_sizes"), len(ranks)),
                            _splits(inp, _arg(args, kwargs, 3, "input_split_sizes"), len(ranks)))
        elif method == "all_to_all":
            group = _arg(args, kwargs, 2, "group")
            outs, ins = _arg(args, kwargs, 0, "output_tensor_list"), _arg(args, kwargs, 1, "input_tensor_list")
            self.all_to_all(group, [_nbytes(t) for t in outs], [_nbytes(t) for t in ins])
        elif method in ("send", "isend"):
            # Backend p2p takes global ranks; count against the world group.
            self.peer(kind, None, int(_arg(args, kwargs, 1, "dst")), _nbytes(_arg(args, kwargs, 0, "tensor")), True)
        elif method in ("recv", "irecv"):
            src = _arg(args, kwargs, 1, "src")
            self.peer(kind, None, None if src is None else int(src), _nbytes(_arg(args, kwargs, 0, "tensor")),
                      False)
        else:  # barrier, objects: calls only
            self.add(kind)


def _splits(t: Any, sizes: Optional[list[int]], g: int) -> list[int]:
    """Bytes of each of the g chunks of an all_to_all_single buffer (split along dim 0)."""
    row = _nbytes(t) // max(1, int(t.shape[0])) if t.dim() else _nbytes(t)
    if sizes:
        return [int(s) * row for s in sizes]
    return [_nbytes(t) // g] * g


_active: Optional[_Accountant] = None
_HOOK = "comm_accounting"  # its name among the hooks on deepspeed.comm's backend (zerotrain.ds_patches)


def installed() -> bool:
    return _active is not None


def install(layout: NodeLayout, rank: Optional[int] = None) -> None:
    """Start counting on this rank (after the process group exists). Idempotent for the same layout."""
    global _active
    import torch.distributed as tdist

    if _active is not None:
        if _active.layout == layout:
            return
        raise AccountingError("comm accounting is already installed with another layout; uninstall() first")
    rank = tdist.get_rank() if rank is None else rank
    if len(layout.node_index) != tdist.get_world_size():
        raise AccountingError(f"layout has {len(layout.node_index)} ranks, the world {tdist.get_world_size()}")
    require_supported("zerotrain.comm_accounting", "deepspeed.comm backend's collective methods and their arguments",
                      "set comm.accounting=false")
    accountant = _Accountant(layout, rank)

    def count(method: str, call: Callable, *args, **kwargs):
        accountant.record(method, args, kwargs)
        return call(*args, **kwargs)

    try:
        add_collective_hook(_HOOK, count, _METHODS)
    except RuntimeError as e:  # deepspeed.comm not initialised
        raise AccountingError(str(e)) from None
    _active = accountant


def uninstall() -> None:
    """Stop counting and restore the backend's methods. Safe to call when not installed."""
    global _active
    remove_collective_hook(_HOOK)
    _active = None


def snapshot_and_reset(all_ranks: bool = False) -> dict[str, dict[str, float]]:
    """This rank's counters since the last call, ``{kind: {calls, send_intra, send_inter, recv_intra,
    recv_inter}}``, and zero them. ``all_ranks=True`` sums them over the world (every rank must call it: one small
    all-reduce straight on torch.distributed, itself not counted). Empty when not installed."""
    if _active is None:
        return {}
    with _active.lock:
        counters, _active.counters = _active.counters, {}
        ring, _active.ring = _active.ring, {}
    if not all_ranks:
        return {k: {**dict(zip(FIELDS, map(float, v))), RING_FIELD: float(ring.get(k, 0.0))}
                for k, v in sorted(counters.items())}
    import torch
    import torch.distributed as tdist
    from deepspeed.accelerator import get_accelerator

    kinds = sorted(set(_METHODS.values()))
    fields = (*FIELDS, RING_FIELD)
    flat = torch.zeros(len(kinds) * len(fields), dtype=torch.float64)
    for i, kind in enumerate(kinds):
        if kind in counters:
            row = [*counters[kind], ring.get(kind, 0.0)]
            flat[i * len(fields):(i + 1) * len(fields)] = torch.tensor(row, dtype=torch.float64)
    device = get_accelerator().current_device_name()
    flat = flat.to(device)
    tdist.all_reduce(flat)  # torch.distributed directly: not through deepspeed.comm, so not counted
    summed = flat.cpu().tolist()
    out = {}
    for i, kind in enumerate(kinds):
        values = summed[i * len(fields):(i + 1) * len(fields)]
        if values[0]:
            out[kind] = dict(zip(fields, values))
    return out


def interval_metrics(steps: int) -> dict[str, float]:
    """The trainer's metric source: the counters since the last call, summed over ranks, as per-step averages over
    ``steps`` (:func:`metrics_record`). Collective."""
    return metrics_record(snapshot_and_reset(all_ranks=True), steps)


def metrics_record(snapshot: dict[str, dict[str, float]], steps: int, nodes: Optional[int] = None) -> dict[str, float]:
    """Per-step averages of a snapshot under the keys the trainer logs:

    ``comm/inter_node_bytes``, ``comm/intra_node_bytes`` (bytes received, all kinds), and per kind
    ``comm/<kind>/inter_node_bytes``, ``comm/<kind>/intra_node_bytes``, ``comm/<kind>/calls``. With ``nodes``
    (default: the installed layout's; a job-wide snapshot), also per node: ``comm/inter_node_bytes_per_node``
    (logical) and ``comm/ring_inter_node_bytes_per_node`` (the ring model), and per kind
    ``comm/<kind>/ring_inter_node_bytes_per_node``.
    """
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    if nodes is None and _active is not None:
        nodes = _active.layout.num_nodes
    out: dict[str, float] = {}
    inter = intra = ring = 0.0
    for kind, c in sorted(snapshot.items()):
        out[f"comm/{kind}/inter_node_bytes"] = c["recv_inter"] / steps
        out[f"comm/{kind}/intra_node_bytes"] = c["recv_intra"] / steps
        out[f"comm/{kind}/calls"] = c["calls"] / steps
        if nodes:
            out[f"comm/{kind}/ring_inter_node_bytes_per_node"] = c.get(RING_FIELD, 0.0) / steps / nodes
        inter += c["recv_inter"]
        intra += c["recv_intra"]
        ring += c.get(RING_FIELD, 0.0)
    out["comm/inter_node_bytes"] = inter / steps
    out["comm/intra_node_bytes"] = intra / steps
    if nodes:
        out["comm/inter_node_bytes_per_node"] = inter / steps / nodes
        out["comm/ring_inter_node_bytes_per_node"] = ring / steps / nodes
    return out
