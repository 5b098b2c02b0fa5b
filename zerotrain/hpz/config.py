"""The ``hpz`` section of the run config: hpZ's shard-race treatment, verification, gradient reduce, emulation.

``mode`` and ``verify`` only matter when ``zero.zero_hpz_partition_size`` > 1; the trainer then calls
``zerotrain.hpz.install(mode=..., verify=...)`` before the model is built. ``emulate_async`` applies to any run on
the CPU, plain ZeRO-3 included (the reference curve): the trainer installs the emulated asynchronous accelerator
(:mod:`zerotrain.hpz.emulated_run`) before the process group exists. See docs/hpz.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class HpzMode(StrEnum):
    """The ``hpz.mode`` values; :data:`zerotrain.hpz.MODES` is derived from them."""

    legacy = "legacy"  # DeepSpeed <= 0.13.4, the paper's baseline: racy, and 0.13's copy rule (see docs/hpz.md)
    stock = "stock"  # DeepSpeed 0.19.8 minus its host sync: racy, reproduces the failure (DeepSpeed issue #5059)
    sync = "sync"  # the host waits after every shard copy: the paper's fix, DeepSpeed today
    ordered = "ordered"  # ours: the all-gather stream waits on an event recorded after each copy


class GradReduce(StrEnum):
    """The ``hpz.grad_reduce`` values; :data:`zerotrain.hpz.grad_reduce.GRAD_REDUCE_MODES` is derived from them."""

    flat = "flat"  # DeepSpeed's reduce-scatter over the world
    hierarchical = "hierarchical"  # inside the hpZ group first, then across nodes over 1/hpZ of the data
    auto = "auto"  # hierarchical where the ring model says it sends fewer inter-node bytes, flat otherwise


@dataclass
class HpzConfig:
    """The ``hpz`` section."""

    mode: HpzMode = HpzMode.ordered
    """legacy | stock | sync | ordered."""
    verify: bool = False
    """Check every secondary shard against the primary partitions before it is read (costs one small all-gather
    per shard-reading all-gather); a mismatch stops the run with exit code 4."""
    grad_reduce: GradReduce = GradReduce.flat
    """Gradient reduce-scatter: flat (DeepSpeed's, over the world) | hierarchical (inside the node over the hpZ group
    first, then across nodes over 1/hpZ of the data: :mod:`zerotrain.hpz.grad_reduce`; needs hpZ > 1) | auto
    (hierarchical only where the ring model, :mod:`zerotrain.comm_model`, says it sends fewer inter-node bytes per
    node than the flat ring; the choice and the predicted saving are logged at start-up)."""
    emulate_async: bool = False
    """CPU only: run under the emulated asynchronous accelerator (zerotrain.hpz.async_emulator), so that hpZ's shard
    race happens as it would on a GPU (the copy deferred on its stream, fresh shards poisoned) and every racy read is
    recorded: ``hpz/races`` etc. per logged step, all ranks summed, and a per-rank report in
    <run dir>/hpz_emulator/. It models ordering, not timing (docs/hpz.md). Needs zero.overlap_comm=true for the race
    to be possible (otherwise DeepSpeed gathers on the compute stream). A GPU run is refused (exit 2): there the
    race is real."""
