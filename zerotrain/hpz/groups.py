"""Per-engine hpZ process groups, and the eval-only engine crash.

DeepSpeed keeps the hpZ intra-node group in one module global
(``deepspeed.utils.groups._ZERO_PARAM_INTRA_PARALLEL_GROUP``):

* ``_create_zero_param_parallel_group`` asserts the global is unset, so a
  second ``zero.Init`` with hpZ in the same process fails;
* the engine (and the ZeRO-3 optimizer) only create a group when
  ``_get_zero_param_intra_parallel_group()`` returns None, so a second engine
  silently inherits whatever group the first one made -- an engine configured
  without hpZ gets hpZ, one configured with size 4 gets size 2.

Fix: a cache of groups keyed by size, and a per-thread "configured size" scope
entered while an engine builds its ZeRO optimizer. Inside the scope the getter
answers for that engine's size (None when hpZ is off); outside it behaves as
DeepSpeed's (the most recently created group), which is what ``zero.Init``
relies on right after it creates one.

Separately, the optimizer-less (evaluation) engine path in
``DeepSpeedEngine._configure_zero_optimizer`` calls
``self._set_zero_group_parallelism()``, a method only the ZeRO-3 optimizer has:
``deepspeed.initialize(model=..., config=<hpZ>)`` without an optimizer raises
AttributeError. We give the engine that method.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, Optional

import deepspeed.comm as dist
from deepspeed.utils import groups as ds_groups

from zerotrain import ring_collectives
from zerotrain.ds_patches import PatchSet

_cache: Dict[int, Any] = {}  # hpZ size -> this rank's intra-node group
# hpZ size -> this rank's "same local rank" group across the hpZ groups (hierarchical gradient reduction).
_peer_cache: Dict[int, Any] = {}
_cache_world: Optional[int] = None  # id of the WORLD group the cache belongs to
_scope = threading.local()


def _sync_cache_with_world() -> None:
    """Forget cached groups after the process group was destroyed and re-created."""
    global _cache_world
    import torch.distributed as tdist
    world = id(tdist.group.WORLD)
    if world != _cache_world:
        _cache.clear()
        _peer_cache.clear()
        _cache_world = world


def _effective_size(group_size: int) -> int:
    return min(int(group_size), dist.get_world_size())


def create_group(group_size: int) -> None:
    """Cache-aware replacement for ``groups._create_zero_param_parallel_group``.

    Creates the groups of one size once (``new_group`` is collective: every rank
    must make the same calls in the same order, which holds because engine and
    ``zero.Init`` construction are themselves collective), then makes that size
    the current one.
    """
    assert dist.is_initialized()
    _sync_cache_with_world()
    size = _effective_size(group_size)
    if size not in _cache:
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % size != 0:
            raise ValueError(f"hpZ partition size {size} does not divide world size {world}")
        mine = None
        for i in range(world // size):
            group = ring_collectives.new_group(list(range(i * size, (i + 1) * size)))
            if i == rank // size:
                mine = group
        _cache[size] = mine
    ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = _cache[size]


def same_local_rank_group(group_size: int) -> Any:
    """This rank's group of the ranks holding the same hpZ-local rank in every hpZ group of ``group_size``:
    ``{i, h+i, 2h+i, ...}`` for local rank i, in that order (its group rank is the hpZ group's index). Used by
    :mod:`.grad_reduce` for the inter-node stage. Created once per size, collectively like :func:`create_group`."""
    assert dist.is_initialized()
    _sync_cache_with_world()
    size = _effective_size(group_size)
    if size not in _peer_cache:
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % size != 0:
            raise ValueError(f"hpZ partition size {size} does not divide world size {world}")
        mine = None
        for local in range(size):
            group = ring_collectives.new_group(list(range(local, world, size)))
            if local == rank % size:
                mine = group
        _peer_cache[size] = mine
    return _peer_cache[size]


def get_group() -> Optional[Any]:
    """Replacement for ``groups._get_zero_param_intra_parallel_group``."""
    size = getattr(_scope, "size", None)
    if size is None:  # not building an engine: DeepSpeed's behaviour
        return ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP
    if size <= 1:
        return None
    _sync_cache_with_world()
    return _cache.get(_effective_size(size))


@contextlib.contextmanager
def configured_size(size: int) -> Iterator[None]:
    """While active, hpZ group lookups on this thread answer for ``size``."""
    previous = getattr(_scope, "size", None)
    _scope.size = int(size)
    try:
        yield
    finally:
        _scope.size = previous


def set_zero_group_parallelism(engine: Any) -> None:
    """The method the optimizer-less engine path expects (see module docstring)."""
    create_group(engine.zero_hpz_partition_size())


def install(patches: PatchSet, engine_cls: Any, fix_groups: bool = True, fix_eval_engine: bool = True) -> None:
    """Swap DeepSpeed's single-global group helpers for the per-size ones.

    The engine-side scope (:func:`configured_size`) is entered by
    :mod:`zerotrain.hpz.engine_hooks` around ``_configure_zero_optimizer``.
    """
    if fix_groups:
        patches.replace(ds_groups, "_create_zero_param_parallel_group", create_group)
        patches.replace(ds_groups, "_get_zero_param_intra_parallel_group", get_group)
    if fix_eval_engine and "_set_zero_group_parallelism" not in vars(engine_cls):
        patches.replace(engine_cls, "_set_zero_group_parallelism", set_zero_group_parallelism)
