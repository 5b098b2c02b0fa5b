"""Hierarchical gradient reduce-scatter for ZeRO-3 with hpZ (``hpz.grad_reduce=hierarchical``): intra-node first.

hpZ keeps the backward all-gather inside the node, but ZeRO-3's gradient reduce-scatter still runs over the whole
world: with W ranks, k per node, every rank receives its partition's contribution from each of the W-k ranks on
other nodes, (W-k)/W of every gradient bucket per rank across the slow links. With hpZ groups of h consecutive
ranks inside a node (rank r = j*h + i: hpZ group j, hpZ-local rank i; m = W/h groups), the same sum is computed in
two stages, each rank still ending with exactly the partition ZeRO-3 expects:

1. **inside the hpZ group** (fast links): a reduce-scatter over the group hands hpZ-local rank i the sum, over its
   group, of the partitions of every rank whose local rank is i -- m partitions, 1/h of the bucket;
2. **across the groups** (slow links): among the m ranks with local rank i (the "same local rank" group
   {i, h+i, 2h+i, ...}), a reduce-scatter of those m partitions: member j gets partition j*h+i summed over all
   groups. Only 1/h of the bucket crosses between nodes, a factor h less than the flat reduce-scatter.

Stage 1 needs each local rank's m partitions to be contiguous, so the flat buffer (W partitions in rank order, as
DeepSpeed builds it) is **reordered before the collectives**, viewed as (m, h, P) and transposed to (h, m, P);
nothing is reordered after them. Stage 2 is DeepSpeed's ``reduce_scatter_fn`` over the same-local-rank group
where that is a ring (NCCL; gloo with ``cluster.collectives=ring``, :mod:`zerotrain.ring_collectives`), and an
all-to-all plus a local sum on gloo's native collectives, whose ``reduce_scatter_tensor`` (an all-reduce inside)
would send each rank's whole buffer across -- twice the bytes of a 2-node stage 2 (measured, docs/hpz.md).

Inter-node bytes (:mod:`zerotrain.comm_model`, the ring model): per node and B-byte gradient buffer, the flat ring
sends (W-1)/W B, the hierarchical reduction (m-1)/m B with a ring stage 2 -- not a factor h less: with hpZ = the
node (h = k ranks per node, m = N nodes) the ratio is (W-1)/W : (N-1)/N, 1.5x on 2x2, 1.29x on 4x8.
``hpz.grad_reduce=auto`` (:func:`choose`) takes the hierarchical path only where the model says it sends fewer.

How it is installed (over pinned DeepSpeed, by :mod:`zerotrain.hpz`, never copying DeepSpeed's code):

* ``coalesced_collectives._torch_reduce_scatter_fn`` -- the one collective DeepSpeed's ``reduce_scatter_coalesced``
  issues, after it has interleaved, padded and pre-divided the bucket into one flat buffer: replaced by the two
  stages above while a ZeRO-3 optimizer with a plan is reducing (below), DeepSpeed's original otherwise;
* ``DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads`` -- the only caller of ``reduce_scatter_coalesced`` in
  ZeRO-3: makes that optimizer's :class:`ReducePlan` active on this thread for the call;
* ``DeepSpeedZeroOptimizer_Stage3.__init__`` -- checks the configuration and builds the plan (collectively: the
  node layout is gathered and the same-local-rank groups are created), before any training;
* ``DeepSpeedZeroOptimizer_Stage3.step`` -- at the first step of an optimizer with a plan, checks that its
  gradients went through the two stages and fails (:class:`GradReduceBypassedError`) if DeepSpeed's flat path ran
  instead: a DeepSpeed that stops calling one of the functions above would otherwise silently train flat;
* ``DeepSpeedZeroOptimizer.__init__`` (ZeRO stage 1/2) -- refuses: those stages have no hpZ.

Only the DeepSpeed versions these patches were tested on (:data:`TESTED_DEEPSPEED`) are accepted; a constructor
argument we read that DeepSpeed renamed is reported with the installed version.

The plan is fixed per ZeRO-3 optimizer when it is built: switching ``grad_reduce`` later affects new engines only.
Nothing is patched until ``hpz.install(grad_reduce="hierarchical")`` is first called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from zerotrain.errors import ZerotrainError

from . import counting
from .config import GradReduce

GRAD_REDUCE_MODES = tuple(mode.value for mode in GradReduce)  # hpz.grad_reduce's values; auto: resolved by choose()
PLAN_ATTR = "_zt_grad_reduce_plan"
STATS_ATTR = "_zt_grad_reduce_stats"  # per optimizer: [bucket reductions seen, of which hierarchical, checked]
TESTED_DEEPSPEED = ("0.19.8",)  # the versions the patches below were tested with

log = logging.getLogger(__name__)

_mode = "flat"
_applied_to: Any = None  # the hpZ PatchSet our patches were added to (None: not applied)
_active = threading.local()  # .plan: the ReducePlan of the ZeRO-3 optimizer reducing on this thread


class GradReduceConfigError(ZerotrainError, ValueError):
    """``hpz.grad_reduce=hierarchical`` cannot run with this engine's configuration; the message says why."""


class GradReduceBypassedError(ZerotrainError, RuntimeError):
    """The first optimizer step of a hierarchical engine found gradients reduced by DeepSpeed's flat path."""


def deepspeed_version() -> str:
    import deepspeed

    return str(getattr(deepspeed, "__version__", "unknown"))


def check_version() -> None:
    found = deepspeed_version()
    if found not in TESTED_DEEPSPEED:
        raise GradReduceConfigError(
            f"hpz.grad_reduce=hierarchical patches DeepSpeed's ZeRO-3 gradient path and was tested with deepspeed "
            f"{', '.join(TESTED_DEEPSPEED)}; deepspeed {found} is installed. Install deepspeed=="
            f"{TESTED_DEEPSPEED[-1]} or use hpz.grad_reduce=flat.")


@dataclasses.dataclass(frozen=True)
class ReducePlan:
    """Who reduces with whom, for one ZeRO-3 optimizer (this rank's view)."""

    world_size: int  # W: the data-parallel group, which must be the whole world in rank order
    hpz_size: int  # h: ranks per hpZ group (consecutive, inside one node)
    hpz_group: Any  # this rank's hpZ group: ranks [j*h, (j+1)*h)
    peer_group: Any  # this rank's same-local-rank group: ranks {i, h+i, 2h+i, ...}, in that order
    reorder: bool = True  # False only for the tests' negative control: skip the reordering of the flat buffer

    @property
    def num_groups(self) -> int:
        return self.world_size // self.hpz_size

    def check_group(self, group: Any) -> None:
        """The collective must be over the data-parallel world the plan was built for."""
        ranks = group_ranks(group)
        if ranks != list(range(self.world_size)):
            raise GradReduceConfigError(
                f"hpz.grad_reduce=hierarchical: a gradient reduce-scatter over ranks {list(ranks)}, not the whole "
                f"world 0..{self.world_size - 1} the plan was built for (parameters partitioned over a sub-group, "
                f"e.g. expert parallelism). Use hpz.grad_reduce=flat for this model.")


def set_mode(mode: str) -> None:
    global _mode
    if mode == "auto":
        raise ValueError("hpz.grad_reduce=auto must be resolved to flat or hierarchical first (grad_reduce.choose)")
    if mode not in GRAD_REDUCE_MODES:
        raise ValueError(f"unknown hpz.grad_reduce {mode!r}; expected one of {GRAD_REDUCE_MODES}")
    _mode = mode


def get_mode() -> str:
    return _mode


def configure(patches: Any, mode: str) -> None:
    """Called by ``hpz.install``: set the mode; on the first ``hierarchical``, add our patches to hpZ's PatchSet
    (``uninstall`` restores them with the rest and resets the mode to ``flat``)."""
    global _applied_to
    set_mode(mode)
    if mode == "hierarchical" and _applied_to is not patches:
        check_version()
        _apply(patches)
        _applied_to = patches

        def _reset() -> None:
            global _applied_to, _mode
            _applied_to, _mode = None, "flat"

        patches.on_restore(_reset)


def group_ranks(group: Any) -> list[int]:
    """Global ranks of a process group in group-rank order (None: the world)."""
    import torch.distributed as tdist

    if group is None or group is tdist.GroupMember.WORLD:
        return list(range(tdist.get_world_size()))
    return list(tdist.get_process_group_ranks(group))


# ------------------------------------------------------------------------------------------------------------------
# The reduction
# ------------------------------------------------------------------------------------------------------------------


def hierarchical_reduce_scatter(flat: torch.Tensor, output: torch.Tensor, plan: ReducePlan) -> None:
    """Reduce-scatter ``flat`` (W equal partitions, partition r for rank r) into ``output`` (this rank's partition)
    in two stages: over the hpZ group, then across the groups. Same result as a flat reduce-scatter over the world,
    up to the order of the summation."""
    import deepspeed.comm as dist

    h, m = plan.hpz_size, plan.num_groups
    part = output.numel()
    if flat.numel() != part * h * m:
        raise ValueError(f"flat buffer of {flat.numel()} elements is not {h * m} partitions of {part}")
    # Rows i of (h, m, P): the partitions of ranks i, h+i, 2h+i, ... -- what hpZ-local rank i reduces in stage 2.
    grouped = flat.view(m, h, part).transpose(0, 1).contiguous() if plan.reorder else flat
    partial = torch.empty(m * part, dtype=flat.dtype, device=flat.device)
    dist.reduce_scatter_fn(partial, grouped.view(-1), group=plan.hpz_group)
    if m == 1:  # one hpZ group is the whole world: stage 1 was everything
        output.copy_(partial)
        return
    if stage2_algorithm(plan.peer_group) == "ring":  # member j gets block j summed: a ring moves (m-1)/m of it
        dist.reduce_scatter_fn(output, partial, group=plan.peer_group)
        return
    received = torch.empty_like(partial)
    dist.all_to_all_single(received, partial, group=plan.peer_group)  # block j of `partial` goes to member j
    torch.sum(received.view(m, part), dim=0, out=output)


def stage2_algorithm(group: Any = None) -> str:
    """How stage 2 runs on ``group``'s backend: ``ring`` (a reduce-scatter that is a ring: NCCL, or gloo with the
    ring collectives installed) or ``all_to_all`` (gloo's native collectives)."""
    import torch.distributed as tdist

    from zerotrain import ring_collectives

    if ring_collectives.active() or tdist.get_backend(group) != "gloo":
        return "ring"
    return "all_to_all"


def choose(requested: str, num_nodes: int, ranks_per_node: int, hpz_size: int):
    """Resolve ``hpz.grad_reduce`` for this job by the ring model (:func:`zerotrain.comm_model.choose`), with the
    stage-2 algorithm this process group will use. After the process group (and the ring collectives) exist."""
    from zerotrain import comm_model

    if requested != "auto" and requested not in GRAD_REDUCE_MODES:
        raise ValueError(f"unknown hpz.grad_reduce {requested!r}; expected one of {GRAD_REDUCE_MODES}")
    if hpz_size <= 1 or ranks_per_node % hpz_size:  # no (intra-node) hpZ group: nothing hierarchical to weigh
        if requested == "auto":
            return comm_model.Choice("auto", "flat", 1.0, 1.0, "none")
        return comm_model.Choice(requested, requested, 1.0, 1.0, "none")
    shape = comm_model.Shape(num_nodes, ranks_per_node, hpz_size)
    return comm_model.choose(requested, shape, stage2_algorithm())


@contextlib.contextmanager
def reducing_with(plan: ReducePlan | None) -> Iterator[None]:
    """While active, DeepSpeed's coalesced reduce-scatter on this thread reduces by ``plan`` (None: flat)."""
    previous = getattr(_active, "plan", None)
    _active.plan = plan
    try:
        yield
    finally:
        _active.plan = previous


# ------------------------------------------------------------------------------------------------------------------
# Configuration checks and the plan (at optimizer construction, before any training)
# ------------------------------------------------------------------------------------------------------------------


def _offloaded(offload_config: Any) -> bool:
    device = getattr(offload_config, "device", None)
    return offload_config is not None and str(getattr(device, "value", device)) not in ("none", "None")


class _Arguments(dict):
    """The ZeRO-3 optimizer's constructor arguments; one we read that this DeepSpeed does not take is a clear
    error naming the version, not a KeyError."""

    def __missing__(self, name: str) -> Any:
        raise GradReduceConfigError(
            f"hpz.grad_reduce=hierarchical reads DeepSpeedZeroOptimizer_Stage3's argument {name!r}, which deepspeed "
            f"{deepspeed_version()} does not have (renamed or removed; tested with {', '.join(TESTED_DEEPSPEED)}). "
            f"Install deepspeed=={TESTED_DEEPSPEED[-1]} or use hpz.grad_reduce=flat.")


def check_arguments(optimizer_cls: type, arguments: Mapping[str, Any]) -> int:
    """Refuse configurations whose gradients would not go through the reduction we replace, or that we do not
    support; returns the hpZ size. ``arguments``: the ZeRO-3 optimizer's constructor arguments, defaults applied.
    Every rank sees the same configuration, so every rank raises the same error at the same point."""
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    prefix = "hpz.grad_reduce=hierarchical"
    arguments = _Arguments(arguments)
    hpz_size = min(int(arguments["zero_hpz_partition_size"]), dist.get_world_size())
    if hpz_size <= 1:
        raise GradReduceConfigError(
            f"{prefix} reduces inside the hpZ group first, but this ZeRO-3 engine has no hpZ group "
            f"(zero_optimization.zero_hpz_partition_size={arguments['zero_hpz_partition_size']}). Set it to the "
            f"ranks per node (zerotrain: zero=zero3_hpz or zero.zero_hpz_partition_size=auto), or use "
            f"hpz.grad_reduce=flat.")
    offload_device = getattr(arguments["offload_optimizer_config"], "device", "?")
    refusals = [
        (optimizer_cls is not DeepSpeedZeroOptimizer_Stage3,
         (f"the ZeRO-3 optimizer is {optimizer_cls.__name__} (SuperOffload / MiCS), whose gradient path differs; "
          "only DeepSpeedZeroOptimizer_Stage3 is supported")),
        (_offloaded(arguments["offload_optimizer_config"]),
         (f"zero_optimization.offload_optimizer is enabled (device {offload_device}): optimizer offload is not "
          "supported (untested with this reduction); set offload_optimizer.device=none or hpz.grad_reduce=flat")),
        (_offloaded(arguments["offload_param_config"]),
         ("zero_optimization.offload_param is enabled: parameter offload is not supported (untested with this "
          "reduction); set offload_param.device=none or hpz.grad_reduce=flat")),
        (arguments["zenflow_config"] is not None, "zero_optimization.zenflow is set: ZenFlow is not supported"),
        (arguments["all2all_process_group"] is not None,
         ("zero_optimization.zero_quantized_gradients (qgZ) is enabled: qgZ replaces the reduce-scatter with its "
          "own quantised all-to-all, so there would be nothing for the hierarchical reduction to do; choose one")),
        (not arguments["reduce_scatter"],
         ("zero_optimization.reduce_scatter is false: ZeRO-3 then all-reduces gradient buckets instead of "
          "reduce-scattering them, bypassing the hierarchical reduction; set reduce_scatter=true")),
    ]
    for refused, why in refusals:
        if refused:
            raise GradReduceConfigError(f"{prefix}: {why}.")
    world = dist.get_world_size()
    dp_ranks = group_ranks(arguments["dp_process_group"])
    if dp_ranks != list(range(world)):
        raise GradReduceConfigError(
            f"{prefix}: the data-parallel group is ranks {dp_ranks}, not the whole world (sequence or model "
            f"parallelism): not supported.")
    if world % hpz_size:
        raise GradReduceConfigError(f"{prefix}: the world size {world} is not a multiple of the hpZ size "
                                    f"{hpz_size}.")
    return hpz_size


def check_layout(hpz_size: int) -> None:
    """The nodes the reduction assumes are the launch's nodes: every hpZ group must lie inside one node, and the
    world must split into whole nodes. A collective (the ranks exchange their node names)."""
    from zerotrain.launch.layout import LayoutError, gather_layout

    prefix = "hpz.grad_reduce=hierarchical"
    try:
        layout = gather_layout()
    except LayoutError as e:
        raise GradReduceConfigError(f"{prefix} needs a world that splits into whole nodes, each running the same "
                                    f"number of consecutive ranks: {e}") from None
    for start in range(0, layout.world_size, hpz_size):
        group = list(range(start, start + hpz_size))
        if not layout.is_intra_node(group):
            raise GradReduceConfigError(
                f"{prefix}: hpZ group {group} spans nodes {sorted({layout.node_names[r] for r in group})}, so its "
                f"'intra-node' stage would cross the network ({layout.describe()}). Use an hpZ size that divides "
                f"the ranks per node ({layout.ranks_per_node}).")
    if layout.num_nodes == 1:
        log.info("%s on a single node: correct, but there is no inter-node traffic to save", prefix)


def build_plan(hpz_size: int, hpz_group: Any) -> ReducePlan:
    """The plan for this rank; creates (collectively, once per size) the same-local-rank groups."""
    import deepspeed.comm as dist

    from . import groups

    world = dist.get_world_size()
    rank = dist.get_rank()
    expected = list(range(rank - rank % hpz_size, rank - rank % hpz_size + hpz_size))
    found = group_ranks(hpz_group) if hpz_group is not None else None
    if found != expected:
        raise GradReduceConfigError(f"hpz.grad_reduce=hierarchical: rank {rank}'s hpZ group is {found}, expected "
                                    f"the consecutive ranks {expected}")
    return ReducePlan(world_size=world, hpz_size=hpz_size, hpz_group=hpz_group,
                      peer_group=groups.same_local_rank_group(hpz_size))


# ------------------------------------------------------------------------------------------------------------------
# Patches
# ------------------------------------------------------------------------------------------------------------------


def _apply(patches: Any) -> None:
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    # The collective inside DeepSpeed's reduce_scatter_coalesced (looked up as a module global at call time).
    collective_original = coalesced_collectives._torch_reduce_scatter_fn

    @functools.wraps(collective_original)
    def _torch_reduce_scatter_fn(input_tensor, output_tensor, group=None, async_op=False, prof=False):
        plan = getattr(_active, "plan", None)
        if plan is None:
            return collective_original(input_tensor, output_tensor, group=group, async_op=async_op, prof=prof)
        plan.check_group(group)
        hierarchical_reduce_scatter(input_tensor, output_tensor, plan)
        counting.bump("hierarchical_grad_reduces")
        _active.hierarchical = getattr(_active, "hierarchical", 0) + 1
        return None

    patches.replace(coalesced_collectives, "_torch_reduce_scatter_fn", _torch_reduce_scatter_fn)

    # ZeRO-3's reduce-scatter of a gradient bucket: scope the plan of *this* optimizer to the call.
    scatter_name = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
    scatter_original = getattr(DeepSpeedZeroOptimizer_Stage3, scatter_name)

    @functools.wraps(scatter_original)
    def _avg_scatter_grads(self, params_to_reduce, communication_data_type):
        plan = getattr(self, PLAN_ATTR, None)
        before = getattr(_active, "hierarchical", 0)
        with reducing_with(plan):
            result = scatter_original(self, params_to_reduce, communication_data_type)
        if plan is not None:
            stats = getattr(self, STATS_ATTR)
            stats[0] += 1
            stats[1] += getattr(_active, "hierarchical", 0) - before
        return result

    patches.replace(DeepSpeedZeroOptimizer_Stage3, scatter_name, _avg_scatter_grads)

    step_original = DeepSpeedZeroOptimizer_Stage3.step

    @functools.wraps(step_original)
    def step(self, *args, **kwargs):
        if getattr(self, PLAN_ATTR, None) is not None and not getattr(self, STATS_ATTR)[2]:
            check_first_step(self)
        return step_original(self, *args, **kwargs)

    patches.replace(DeepSpeedZeroOptimizer_Stage3, "step", step)

    init_original = DeepSpeedZeroOptimizer_Stage3.__init__
    signature = inspect.signature(init_original)

    @functools.wraps(init_original)
    def __init__(self, *args, **kwargs):
        if _mode != "hierarchical":
            init_original(self, *args, **kwargs)
            return
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        hpz_size = check_arguments(type(self), bound.arguments)
        check_layout(hpz_size)
        init_original(self, *args, **kwargs)
        setattr(self, PLAN_ATTR, build_plan(hpz_size, self.parameter_offload.zero_param_parallel_group))
        setattr(self, STATS_ATTR, [0, 0, False])
        log.info("hpz.grad_reduce=hierarchical: gradients reduce-scattered in hpZ groups of %d, then across %d "
                 "groups", hpz_size, getattr(self, PLAN_ATTR).num_groups)

    patches.replace(DeepSpeedZeroOptimizer_Stage3, "__init__", __init__)

    stage12_original = DeepSpeedZeroOptimizer.__init__

    @functools.wraps(stage12_original)
    def _stage12_init(self, *args, **kwargs):
        if _mode == "hierarchical":
            raise GradReduceConfigError(
                "hpz.grad_reduce=hierarchical needs ZeRO stage 3 with hpZ; this engine uses ZeRO stage 1/2 "
                "(zero_optimization.stage), which has no hpZ group. Use stage 3 or hpz.grad_reduce=flat.")
        stage12_original(self, *args, **kwargs)

    patches.replace(DeepSpeedZeroOptimizer, "__init__", _stage12_init)


def check_first_step(optimizer: Any) -> None:
    """Before the first step of a hierarchical ZeRO-3 optimizer: every gradient bucket reduced so far went through
    the two stages. Nothing seen at all, or fewer hierarchical reductions than buckets, means DeepSpeed reduced
    (some) gradients by a path our patches do not cover: stop rather than train flat under a hierarchical label."""
    import deepspeed.comm as dist

    stats = getattr(optimizer, STATS_ATTR)
    buckets, hierarchical = stats[0], stats[1]
    if buckets == 0 or hierarchical < buckets:
        what = ("no gradient bucket went through DeepSpeedZeroOptimizer_Stage3.__avg_scatter_grads"
                if buckets == 0 else
                f"{buckets - hierarchical} of {buckets} gradient buckets were reduce-scattered by DeepSpeed's "
                f"flat path (coalesced_collectives._torch_reduce_scatter_fn not called, or called without our plan)")
        raise GradReduceBypassedError(
            f"hpz.grad_reduce=hierarchical, rank {dist.get_rank()}, first optimizer step: {what}. The gradient path "
            f"of deepspeed {deepspeed_version()} differs from the one these patches hook (tested with "
            f"{', '.join(TESTED_DEEPSPEED)}); use hpz.grad_reduce=flat or the tested DeepSpeed.")
    stats[2] = True
