"""Our fixed ZeRO++ hierarchical partitioning (hpZ), installed at run time over pinned DeepSpeed.

Usage (before ``deepspeed.zero.Init`` / ``deepspeed.initialize``)::

    from zerotrain import hpz
    hpz.install(mode="ordered", verify=False)   # idempotent
    ...
    hpz.counters()      # what it did: shards built/read, events, waits, host syncs, ...
    hpz.uninstall()     # DeepSpeed exactly as it was

What is patched and why (see docs/hpz.md):

* ``Init._partition_param_sec`` -- builds the node-local (secondary) shard;
  replaced by :func:`ordering.build_secondary_shard`, whose ordering after
  the copy depends on the mode (``legacy`` / ``stock`` / ``sync`` / ``ordered``).
* ``PartitionedParameterCoordinator.__all_gather_params_`` -- the prefetching
  all-gather, the only reader of shards; before it runs, the all-gather stream
  waits for the shards it reads (``ordered``) and then, with ``verify``, shards
  are checked against the primary partitions on that stream.
* ``deepspeed.utils.groups`` hpZ group helpers, and
  ``DeepSpeedEngine._configure_zero_optimizer`` / ``_set_zero_group_parallelism``
  -- per-engine hpZ groups and the optimizer-less engine crash.
* ``DeepSpeedEngine.load_checkpoint`` / ``load_module_state_dict``,
  ``PreTrainedModel.resize_token_embeddings`` and a per-engine
  ``load_state_dict`` hook -- drop shards made stale by weights changing
  outside the optimizer step.
* ``DeepSpeedZeroOptimizer_Stage3._post_step`` -- counts optimizer steps.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import warnings
from typing import Collection, Dict

from zerotrain.ds_patches import SUPPORTED_DEEPSPEED, DeepSpeedVersionError, PatchSet, require_supported

from . import counting as _counters
from . import grad_reduce as _grad_reduce
from . import ordering
from .ordering import HpzOrderingError
from .verify import HpzVerificationError

__all__ = [
    "install", "uninstall", "active_mode", "counters", "reset_counters", "is_installed", "MODES",
    "SUPPORTED_DEEPSPEED", "HpzVersionError", "HpzVerificationError", "HpzOrderingError", "patched_attributes"
]

MODES = ordering.MODES
FIXES = ("groups", "eval_engine", "stale")
# The coordinator's all-gather stream (a name-mangled private attribute).
ALLGATHER_STREAM_ATTR = "_PartitionedParameterCoordinator__allgather_stream"

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_patches = None  # PatchSet while installed
_verify = False
_fixes: frozenset = frozenset()


class HpzVersionError(DeepSpeedVersionError):
    """The installed DeepSpeed is outside the range this module was written against."""


def _check_version() -> str:
    return require_supported("zerotrain.hpz", "hpZ internals (Init._partition_param_sec, the parameter coordinator's "
                             "all-gather)", "do not call zerotrain.hpz.install()", error=HpzVersionError)


def install(mode: str = "ordered", verify: bool = False, *, grad_reduce: str = "flat",
            disable_fixes: Collection[str] = ()) -> None:
    """Install (or re-configure) the hpZ fixes. Call before ``zero.Init`` / ``deepspeed.initialize``.

    ``mode``: ``"ordered"`` (default, ours), ``"sync"`` (host waits after each
    shard copy, = DeepSpeed today), ``"stock"`` (DeepSpeed today minus that wait:
    racy) or ``"legacy"`` (DeepSpeed <= 0.13.4, the paper's baseline: racy, and its
    copy rule leaves parts of some shards unwritten). The racy two reproduce the
    failure; never train with them.
    ``verify``: check every shard against the primary partitions before it is
    read (costs one small all-gather per shard-reading all-gather).
    ``grad_reduce``: ``"flat"`` (default, DeepSpeed's reduce-scatter over the world) or ``"hierarchical"``
    (inside the hpZ group first, then across nodes: :mod:`zerotrain.hpz.grad_reduce`).
    ``disable_fixes``: names from :data:`FIXES` to leave unfixed -- for tests
    that demonstrate a defect, never for training.
    Installing again with the same fixes only updates mode/verify.
    """
    global _patches, _verify, _fixes
    if mode not in MODES:
        raise ValueError(f"unknown hpZ mode {mode!r}; expected one of {MODES}")
    if grad_reduce not in _grad_reduce.GRAD_REDUCE_MODES:
        raise ValueError(f"unknown hpz grad_reduce {grad_reduce!r}; expected one of {_grad_reduce.GRAD_REDUCE_MODES}")
    unknown = set(disable_fixes) - set(FIXES)
    if unknown:
        raise ValueError(f"unknown fixes {sorted(unknown)}; known: {FIXES}")
    _check_version()
    fixes = frozenset(FIXES) - frozenset(disable_fixes)
    with _lock:
        if _patches is not None and fixes != _fixes:
            _restore_locked()
        if _patches is None:
            _patches = _apply(fixes)
            _fixes = fixes
        ordering.set_mode(mode)
        _verify = bool(verify)
        _grad_reduce.configure(_patches, grad_reduce)
    if mode in ordering.RACY_MODES:
        msg = (f"zerotrain.hpz: mode {mode!r} restores DeepSpeed's RACY hpZ ordering (DeepSpeed issue #5059"
               f"{', and 0.13.x copy rule' if mode == 'legacy' else ''}): the all-gather may read secondary "
               f"shards before they are written -> loss 0/NaN on GPUs. Use it only to reproduce that failure.")
        logger.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    logger.info("zerotrain.hpz installed: mode=%s verify=%s fixes=%s", mode, _verify, sorted(fixes))


def uninstall() -> None:
    """Restore every patched attribute to DeepSpeed's original object, verification off. Harmless when not
    installed."""
    global _verify
    with _lock:
        _restore_locked()
        _verify = False


def _restore_locked() -> None:
    global _patches, _fixes
    if _patches is not None:
        _patches.restore()
    _patches = None
    _fixes = frozenset()


def is_installed() -> bool:
    return _patches is not None


def active_mode() -> str:
    """The active mode, or ``"off"`` when not installed."""
    return ordering.get_mode() if _patches is not None else "off"


def verify_enabled() -> bool:
    return _patches is not None and _verify


def counters() -> Dict[str, int]:
    """Cumulative counts of what the module did (see :mod:`zerotrain.hpz.counting`)."""
    return _counters.snapshot()


def reset_counters() -> None:
    _counters.reset()


def interval_metrics(steps: int) -> Dict[str, int]:
    """This rank's counters since the last call, under ``hpz/<name>`` (the trainer's metric source), then reset.
    ``steps``: the steps they cover (the counts are totals over them)."""
    out = {f"hpz/{k}": v for k, v in counters().items()}
    reset_counters()
    return out


def patched_attributes() -> list:
    """(owner, name, original) for every attribute currently replaced; original None = was absent."""
    return _patches.records() if _patches is not None else []


def _apply(fixes: frozenset):
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import Init
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from . import engine_hooks, groups

    patches = PatchSet()

    # Writer: the secondary shard build, with mode-dependent ordering.
    build_original = Init._partition_param_sec

    @functools.wraps(build_original)
    def _partition_param_sec(self, param, buffer=None, has_been_updated=False):
        ordering.build_secondary_shard(self, param, has_been_updated=has_been_updated, fallback=build_original)

    patches.replace(Init, "_partition_param_sec", _partition_param_sec)

    # Reader: the coordinator's all-gather (name-mangled private method).
    gather_name = "_PartitionedParameterCoordinator__all_gather_params_"
    gather_original = getattr(PartitionedParameterCoordinator, gather_name)

    @functools.wraps(gather_original)
    def _all_gather_params_(self, params, forward, quantize=False):
        _before_secondary_gather(self, params, forward)
        return gather_original(self, params, forward, quantize)

    patches.replace(PartitionedParameterCoordinator, gather_name, _all_gather_params_)

    post_step_original = DeepSpeedZeroOptimizer_Stage3._post_step

    @functools.wraps(post_step_original)
    def _post_step(self, timer_names):
        _counters.bump("optimizer_steps")
        return post_step_original(self, timer_names)

    patches.replace(DeepSpeedZeroOptimizer_Stage3, "_post_step", _post_step)

    groups.install(patches, DeepSpeedEngine, fix_groups="groups" in fixes, fix_eval_engine="eval_engine" in fixes)
    engine_hooks.install(patches, DeepSpeedEngine, fix_groups="groups" in fixes, fix_stale="stale" in fixes)
    return patches


def _before_secondary_gather(coordinator, params, forward: bool) -> None:
    """Run before DeepSpeed's all-gather: order it after the shard copies, then (verify) check the shards.

    Verify reads the shards on the all-gather stream after the waits, i.e. under
    exactly the ordering the all-gather itself gets: read before the wait (or on
    another stream) they could still be being written, and verify would report
    corruption that is not there.
    """
    readers = ordering.secondary_readers(params)
    if not readers:
        return
    stream = getattr(coordinator, ALLGATHER_STREAM_ATTR, None)
    ordering.before_secondary_read(readers, stream, forward=forward)
    if _verify:
        from deepspeed.accelerator import get_accelerator

        from . import verify
        with get_accelerator().stream(stream) if stream is not None else contextlib.nullcontext():
            verify.check_shards(readers)
