"""Which rank runs on which node, checked once the process group exists; resolves ``zero_hpz_partition_size: auto``.

ZeRO++ hpZ keeps a secondary copy of the parameters sharded over ``zero_hpz_partition_size`` consecutive ranks
(DeepSpeed's ``_create_zero_param_parallel_group`` groups ranks ``[j*h, (j+1)*h)``) so that the backward
all-gather stays inside a node, on fast intra-node links instead of the slow Ethernet between nodes. That only
holds if (a) ranks are node-contiguous — node i runs ranks ``[i*k, (i+1)*k)`` — and (b) h divides k. Both are
facts about the launch, not the config, so they are checked here on the real job before any model is built:
a wrong layout would not crash, it would silently send hpZ's traffic across the slow network.

:class:`NodeLayout` is also the one description of the job's shape other code (communication accounting) reuses.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zerotrain.errors import LayoutError

HPZ_KEY = "zero_hpz_partition_size"
# One machine-readable line on rank 0 (tests and log scrapers read it): LAYOUT_LOG_PREFIX + JSON.
LAYOUT_LOG_PREFIX = "node layout: "

log = logging.getLogger("zerotrain")


@dataclass(frozen=True)
class NodeLayout:
    """The job's shape: rank r runs on node ``node_index[r]`` (named ``node_names[r]``), ``ranks_per_node`` each."""

    node_names: tuple[str, ...]  # per rank
    node_index: tuple[int, ...]  # per rank: 0 for the node holding rank 0, 1 for the next, ...
    ranks_per_node: int
    hpz_size: int = 1  # resolved zero_hpz_partition_size (1: plain ZeRO-3), set by resolve_layout

    @property
    def world_size(self) -> int:
        return len(self.node_names)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def nodes(self) -> list[str]:
        """Node names in node-index order."""
        return [self.node_names[i * self.ranks_per_node] for i in range(self.num_nodes)]

    def ranks_on_node(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def same_node(self, a: int, b: int) -> bool:
        return self.node_index[a] == self.node_index[b]

    def is_intra_node(self, ranks: Sequence[int]) -> bool:
        return len({self.node_index[r] for r in ranks}) <= 1

    @property
    def hpz_groups(self) -> list[list[int]]:
        return hpz_groups(self.hpz_size, self)

    def describe(self) -> str:
        spans = (self.ranks_on_node(i) for i in range(self.num_nodes))
        return ", ".join(f"{name}: ranks {r.start}-{r.stop - 1}" for name, r in zip(self.nodes, spans))


def local_node_name(environ: Mapping[str, str] = os.environ) -> str:
    """This process's node: ``ZEROTRAIN_NODE_NAME``, then ``SLURMD_NODENAME``, then the hostname.

    ``ZEROTRAIN_NODE_NAME`` names the node explicitly, for nodes emulated on one host (separate
    ``torchrun --nnodes N --node_rank i`` launches, or the network namespaces of ``python -m tools.emulate``),
    which all share one hostname. SLURMD_NODENAME next: some clusters share one hostname too.
    """
    return environ.get("ZEROTRAIN_NODE_NAME") or environ.get("SLURMD_NODENAME") or socket.gethostname()


def layout_from_node_names(names: Sequence[str]) -> NodeLayout:
    """Build and check a layout from each rank's node name (index = rank). Pure: tests pass fake lists."""
    if not names:
        raise LayoutError("empty rank list")
    order: list[str] = []  # nodes in order of their first rank
    for name in names:
        if name not in order:
            order.append(name)
    counts = Counter(names)
    if len(set(counts.values())) != 1:
        raise LayoutError(
            "nodes run different numbers of ranks: "
            + ", ".join(f"{n}: {counts[n]}" for n in order)
            + ". Launch the same number of tasks (one per device) on every node."
        )
    per_node = counts[order[0]]
    expected = [order[r // per_node] for r in range(len(names))]
    if list(names) != expected:
        first_bad = next(r for r, (got, want) in enumerate(zip(names, expected)) if got != want)
        raise LayoutError(
            f"ranks are not node-contiguous (rank {first_bad} runs on {names[first_bad]}, expected "
            f"{expected[first_bad]}): node i must run ranks [i*{per_node}, (i+1)*{per_node}). "
            "Use srun's default block distribution (no --distribution=cyclic). Layout: "
            + ", ".join(f"{r}:{n}" for r, n in enumerate(names))
        )
    return NodeLayout(
        node_names=tuple(names), node_index=tuple(r // per_node for r in range(len(names))), ranks_per_node=per_node
    )


def gather_layout(environ: Mapping[str, str] = os.environ, group: Any = None) -> NodeLayout:
    """All ranks exchange their node names (a collective: every rank must call it) and check the layout."""
    import torch.distributed as dist

    names: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, local_node_name(environ), group=group)
    return layout_from_node_names([str(n) for n in names])


def resolve_hpz_partition_size(value: Any, layout: NodeLayout) -> int:
    """``auto`` -> ranks per node; an explicit size must divide ranks per node (so it divides the world size)."""
    if value is None:
        return 1
    if value == "auto":
        return layout.ranks_per_node
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise LayoutError(f"zero.{HPZ_KEY}={value!r}: expected a positive integer or 'auto'") from None
    if size < 1:
        raise LayoutError(f"zero.{HPZ_KEY}={size}: must be >= 1 (1 disables hpZ)")
    if size > layout.world_size and layout.num_nodes == 1:
        # A debugging run smaller than one hpZ group (e.g. one process): DeepSpeed would clamp to the world, and
        # one group holding every rank of a single node is still intra-node. Say so rather than fail.
        log.warning("zero.%s=%d exceeds the world size %d on one node: using %d", HPZ_KEY, size,
                    layout.world_size, layout.world_size)
        return layout.world_size
    if layout.world_size % size:
        raise LayoutError(
            f"zero.{HPZ_KEY}={size} does not divide the world size {layout.world_size} "
            f"({layout.num_nodes} nodes x {layout.ranks_per_node} ranks). Use 'auto' ({layout.ranks_per_node}) "
            f"or a divisor of {layout.ranks_per_node}."
        )
    if layout.ranks_per_node % size:
        raise LayoutError(
            f"zero.{HPZ_KEY}={size} makes hpZ groups cross node boundaries ({layout.ranks_per_node} ranks per "
            f"node): its secondary all-gathers would go over the inter-node network. Use 'auto' "
            f"({layout.ranks_per_node}) or a divisor of {layout.ranks_per_node}."
        )
    return size


def hpz_groups(size: int, layout: NodeLayout) -> list[list[int]]:
    """The hpZ groups DeepSpeed will form for ``size`` (consecutive ranks), for logs and checks."""
    return [list(range(start, start + size)) for start in range(0, layout.world_size, size)]


def resolve_zero_config(zero: Mapping[str, Any], layout: NodeLayout) -> dict[str, Any]:
    """A copy of the ``zero`` section with ``zero_hpz_partition_size`` resolved and checked against the layout."""
    resolved = dict(zero)
    if HPZ_KEY in resolved:
        resolved[HPZ_KEY] = resolve_hpz_partition_size(resolved[HPZ_KEY], layout)
    return resolved


def resolve_layout(
    hpz_partition_size: Any = 1, environ: Mapping[str, str] = os.environ, group: Any = None
) -> NodeLayout:
    """The trainer's entry point, right after the process group exists (a collective: all ranks call it).

    Gathers every rank's node, checks contiguity, resolves and checks ``zero_hpz_partition_size`` (``auto`` ->
    ranks per node) and logs the layout once, on rank 0. Raises :class:`LayoutError` before any model is built.
    """
    import torch.distributed as dist

    layout = gather_layout(environ, group)
    layout = dataclasses.replace(layout, hpz_size=resolve_hpz_partition_size(hpz_partition_size, layout))
    if dist.get_rank() == 0:
        log.info("%s%s", LAYOUT_LOG_PREFIX, json.dumps(layout_summary(layout)))
    return layout


def layout_summary(layout: NodeLayout) -> dict[str, Any]:
    return {
        "nodes": layout.nodes,
        "ranks_per_node": layout.ranks_per_node,
        "node_of_rank": list(layout.node_names),
        "hpz_size": layout.hpz_size,
        "hpz_groups": layout.hpz_groups,
    }


def deepspeed_hpz_group_ranks() -> list[int] | None:
    """This rank's hpZ group as DeepSpeed actually built it (after ``deepspeed.initialize``); None without hpZ."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    group = groups._get_zero_param_intra_parallel_group()  # None unless zero_hpz_partition_size > 1
    if group is None:
        return None
    return list(dist.get_process_group_ranks(group))


def verify_deepspeed_hpz_groups(layout: NodeLayout) -> list[int] | None:
    """Check DeepSpeed's real hpZ group for this rank is intra-node (guards against DeepSpeed changing its rule)."""
    ranks = deepspeed_hpz_group_ranks()
    if ranks is not None and not layout.is_intra_node(ranks):
        raise LayoutError(
            f"DeepSpeed's hpZ group {ranks} spans nodes {sorted({layout.node_names[r] for r in ranks})}; "
            f"expected groups within one node ({layout.describe()})"
        )
    return ranks
