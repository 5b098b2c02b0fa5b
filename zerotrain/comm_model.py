"""The ring model: inter-node bytes per node and step that bandwidth-optimal ring collectives (NCCL's, or
:mod:`zerotrain.ring_collectives` on gloo) send, for ZeRO-3, hpZ and hpZ + hierarchical gradients.

A ring collective over g ranks moves (g-1)/g of the buffer through every hop of the ring. With node-contiguous
ranks (rank r on node r // k) and the ring in rank order, each node has exactly one outgoing hop that leaves it, so
an all-gather of a B-byte result, or a reduce-scatter of a B-byte input, over the world (W = N*k ranks) sends

    flat:          (W-1)/W * B   bytes out of every node.

The hierarchical reduce-scatter (:mod:`zerotrain.hpz.grad_reduce`, hpZ groups of h ranks, m = W/h groups) sends
nothing between nodes in stage 1 and, in stage 2, h rings (one per hpZ-local rank) over the m ranks with that local
rank, each B/h bytes; each of those rings leaves every node once:

    hierarchical:  (m-1)/m * B   (stage 2 a ring reduce-scatter: NCCL, or ring_collectives on gloo)
                   (k/h) * (1 - 1/N) * B   (stage 2 an all-to-all: gloo's native collectives; each rank sends its
                   chunk straight to every peer of another node)

so with h = k (hpZ = the node) the ratio flat : hierarchical is (W-1)/W : (N-1)/N, not the factor h a logical
count suggests. Per step, with P the bytes of the parameters (the all-gathers' dtype) and G the bytes of the
gradients (the reduce-scatter's dtype): ZeRO-3 = 2 all-gathers (forward, backward) + 1 reduce-scatter; hpZ = 1
all-gather (the backward one stays inside the node) + 1 reduce-scatter; hpZ + hierarchical = 1 all-gather + the
hierarchical reduce-scatter. ``python -m zerotrain.comm_model`` prints the table of docs/hpz.md.
"""

from __future__ import annotations

import dataclasses
import sys

STAGE2 = ("ring", "all_to_all")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A job: ``nodes`` x ``ranks_per_node`` (node-contiguous ranks), hpZ groups of ``hpz_size`` inside a node."""

    nodes: int
    ranks_per_node: int
    hpz_size: int = 1

    def __post_init__(self):
        if self.nodes < 1 or self.ranks_per_node < 1 or self.hpz_size < 1:
            raise ValueError(f"bad shape {self}: every size must be >= 1")
        if self.ranks_per_node % self.hpz_size:
            raise ValueError(f"hpZ size {self.hpz_size} does not divide the ranks per node {self.ranks_per_node}")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def groups(self) -> int:
        return self.world // self.hpz_size

    def __str__(self) -> str:
        return f"{self.nodes}x{self.ranks_per_node} hpZ {self.hpz_size}"


def flat(shape: Shape, nbytes: float) -> float:
    """Bytes out of each node for a ring all-gather (``nbytes``: the gathered result) or ring reduce-scatter
    (``nbytes``: each rank's input) over the whole world."""
    if shape.nodes == 1:
        return 0.0
    return (shape.world - 1) / shape.world * nbytes


def hierarchical(shape: Shape, nbytes: float, stage2: str = "ring") -> float:
    """Bytes out of each node for the hierarchical reduce-scatter of an ``nbytes`` input per rank."""
    if stage2 not in STAGE2:
        raise ValueError(f"stage2 must be one of {STAGE2}, got {stage2!r}")
    if shape.nodes == 1:
        return 0.0
    if stage2 == "ring":
        m = shape.groups
        return (m - 1) / m * nbytes
    return shape.ranks_per_node / shape.hpz_size * (1 - 1 / shape.nodes) * nbytes


def step(shape: Shape, variant: str, param_bytes: float, grad_bytes: float | None = None,
         stage2: str = "ring") -> float:
    """Inter-node bytes out of each node per optimizer step (one micro-batch) of ``variant``: zero3 | hpz |
    hpz-hier."""
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    if variant == "zero3":
        return 2 * flat(shape, param_bytes) + flat(shape, grad_bytes)
    if variant == "hpz":
        return flat(shape, param_bytes) + flat(shape, grad_bytes)
    if variant == "hpz-hier":
        return flat(shape, param_bytes) + hierarchical(shape, grad_bytes, stage2)
    raise ValueError(f"unknown variant {variant!r}; expected zero3, hpz or hpz-hier")


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``hpz.grad_reduce`` resolves to for a shape, with the model's numbers (fractions of the gradient
    bytes out of each node per reduce-scatter)."""

    requested: str
    mode: str  # flat | hierarchical
    flat: float
    hierarchical: float
    stage2: str
    warning: str | None = None

    @property
    def saving(self) -> float:
        """Flat over hierarchical inter-node bytes (>1: hierarchical sends fewer); inf/nan without traffic."""
        if self.hierarchical == 0:
            return float("inf") if self.flat else float("nan")
        return self.flat / self.hierarchical

    def describe(self) -> str:
        return (f"hpz.grad_reduce={self.requested} -> {self.mode}: ring model, inter-node bytes per node and "
                f"gradient byte: flat {self.flat:.4f}, hierarchical {self.hierarchical:.4f} (stage 2 {self.stage2}), "
                f"hierarchical/flat saving {self.saving:.3g}x")


def choose(requested: str, shape: Shape, stage2: str = "ring") -> Choice:
    """Resolve ``hpz.grad_reduce``: ``auto`` is hierarchical only where the model says it sends fewer inter-node
    bytes per node than the flat ring; an explicit ``hierarchical`` that sends as many or more gets a warning."""
    if requested not in ("flat", "hierarchical", "auto"):
        raise ValueError(f"unknown hpz.grad_reduce {requested!r}; expected flat, hierarchical or auto")
    f = flat(shape, 1.0)
    h = hierarchical(shape, 1.0, stage2) if shape.hpz_size > 1 else f
    better = shape.hpz_size > 1 and h < f
    if requested == "auto":
        return Choice(requested, "hierarchical" if better else "flat", f, h, stage2)
    warning = None
    if requested == "hierarchical" and not better:
        warning = (f"hpz.grad_reduce=hierarchical on {shape.nodes} node(s) x {shape.ranks_per_node} ranks with hpZ "
                   f"{shape.hpz_size} sends no fewer inter-node bytes than the flat ring reduce-scatter: per node "
                   f"{h:.4f} vs {f:.4f} of the gradient bytes (stage 2 {stage2}); hpz.grad_reduce=flat or auto "
                   f"would do as well or better")
    return Choice(requested, requested, f, h, stage2, warning)


def table(layouts=((2, 8), (4, 8), (8, 8), (16, 8)), hpz_sizes=(8, 4)) -> str:
    """The docs' table: per layout and hpZ size, the flat and hierarchical gradient bytes per node and the
    saving, and the fp32 step totals (P = G) of ZeRO-3, hpZ and hpZ + hierarchical with their ratios."""
    lines = ["| layout | hpZ | grad RS flat | hier. (ring) | saving | hier. (all-to-all) | saving | "
             "step: ZeRO-3 | hpZ | hpZ+hier | hpZ vs ZeRO-3 | hpZ+hier vs ZeRO-3 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for nodes, k in layouts:
        for h in hpz_sizes:
            if k % h:
                continue
            s = Shape(nodes, k, h)
            f, r, a = flat(s, 1), hierarchical(s, 1, "ring"), hierarchical(s, 1, "all_to_all")
            z3, hz, hh = (step(s, v, 1.0) for v in ("zero3", "hpz", "hpz-hier"))
            lines.append(f"| {nodes}x{k} | {h} | {f:.3f} B | {r:.3f} B | {f / r:.2f}x | {a:.3f} B | {f / a:.2f}x | "
                         f"{z3:.3f} S | {hz:.3f} S | {hh:.3f} S | {z3 / hz:.2f}x | {z3 / hh:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(((2, 2), (2, 8), (4, 8), (8, 8), (16, 8)), (8, 4, 2)) if "--all" in sys.argv else table())
