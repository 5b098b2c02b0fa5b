"""The hpZ secondary-shard race and its treatments (``legacy``, ``stock``, ``sync``, ``ordered``).

The race (DeepSpeed issue #5059, arXiv 2407.01614). When ZeRO-3 releases a
module's gathered parameters, hpZ copies each parameter's node-local slice into
``param.ds_secondary_tensor`` -- freshly ``torch.empty``-allocated memory -- with
an asynchronous copy enqueued on the *compute* stream of the releasing thread.
Later a prefetching all-gather reads that shard on the coordinator's
*all-gather* stream. Nothing orders the read after the copy, so the all-gather
can ship uninitialised memory (loss 0 / NaN).

* ``legacy``  -- DeepSpeed <= 0.13.4 as the paper measured it: the shard is
  published before it is filled, re-copied on every release, its padding never
  zeroed, and filled by 0.13's copy rule, which leaves parts of it unwritten when
  a parameter's size is not a multiple of the data-parallel world size (PR #5216
  replaced the rule and added the sync). No synchronisation. Reproduction only.
* ``stock``   -- DeepSpeed 0.19.8's shard build minus its host sync: today's
  layout (zeroed padding, built once per release cycle), the race alone.
  Reproduction only.
* ``sync``    -- what the paper proposes and DeepSpeed >= 0.13.5 does: the host
  waits for the compute stream after every shard copy (skipped, as upstream,
  where the device resolves data dependencies itself). Correct, but one host
  stall per released parameter.
* ``ordered`` -- ours: no host wait. The writer records an accelerator event on
  the copying stream right after the copy and attaches it to the shard; before
  an all-gather that reads secondary shards, the all-gather stream waits on the
  events of exactly the shards it reads. Two ``record_stream`` calls keep memory
  from being recycled under an unfinished access (see :func:`_protect_copy_source`
  and :func:`before_secondary_read`).

Only the ``get_accelerator()`` API is used. Where the accelerator orders work
itself (the CPU one is synchronous; ``resolves_data_dependency()``) no event,
wait or host sync is issued, and the counters say so (``device_ordered_copies``):
they count only operations really issued.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, cast

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus, ZeroParamStatus

from zerotrain.errors import ZerotrainError
from zerotrain.profiling import trace_range

from . import counting
from .config import HpzMode
from .zero_param import ZeroParam, ZeroShard

MODES = tuple(mode.value for mode in HpzMode)  # the hpz.mode values, as plain strings
RACY_MODES = (HpzMode.legacy.value, HpzMode.stock.value)

_mode: str = "ordered"

# Attribute we hang the copy-completion event on. Living on the shard tensor
# means the event is dropped together with the shard when DeepSpeed
# invalidates it after the optimizer step, and needs no lock-protected table:
# the writer attaches it before publishing the shard to the parameter.
EVENT_ATTR = "_zt_hpz_copy_event"


class HpzOrderingError(ZerotrainError, RuntimeError):
    """``ordered`` cannot order the all-gather after the shard copies (no all-gather stream found)."""


def set_mode(mode: str) -> None:
    global _mode
    if mode not in MODES:
        raise ValueError(f"unknown hpZ mode {mode!r}; expected one of {MODES}")
    _mode = mode


def get_mode() -> str:
    return _mode


def needs_ordering(accel: Any) -> bool:
    """True when work on different streams can overlap, so a shard copy must be ordered before its readers."""
    return not accel.resolves_data_dependency()


# --------------------------------------------------------------------------- writer


def build_secondary_shard(init: Any, param: ZeroParam, has_been_updated: bool = False,
                          fallback: Optional[Callable[..., None]] = None) -> None:
    """Replacement for ``Init._partition_param_sec`` (same contract, mode-aware ordering).

    Called by ``Init._partition`` while the full parameter is still gathered
    (status AVAILABLE). Builds this rank's node-local slice of the parameter:
    with hpZ group size ``g`` the aligned flat parameter is cut into ``g``
    slices and rank ``rank_in_group`` keeps slice ``rank_in_group``; the tail
    past ``ds_numel`` is zero padding. An existing shard is kept as is unless
    the caller says the weights changed (``has_been_updated``).
    """
    assert param.ds_status is not ZeroParamStatus.INFLIGHT, f"{param.ds_id}: cannot partition a param in flight"
    if param.ds_status is not ZeroParamStatus.AVAILABLE:
        return
    shard = param.ds_secondary_tensor

    # Quantised shards (ZeRO++ qwZ on frozen weights) keep DeepSpeed's own path, which host-syncs
    # (unless the device resolves data dependencies); rare, and not this module's subject.
    quantised = hasattr(shard, "ds_quant_scale") or (shard is None and not param.requires_grad and getattr(
        init, "quantized_nontrainable_weights", False))
    if _mode == "legacy" and not quantised:
        _build_legacy(init, param)
        return
    if shard is not None and not has_been_updated:
        return
    if quantised:
        if fallback is None:
            raise RuntimeError("quantized non-trainable hpZ shards need DeepSpeed's original builder")
        fallback(init, param, has_been_updated=has_been_updated)
        if needs_ordering(get_accelerator()):
            counting.bump("host_syncs")
        return

    shard_numel = init._aligned_size(param) // init.num_ranks_in_param_group
    fresh = shard is None
    if shard is None:
        shard = _new_shard(init, param, shard_numel)

    start = shard_numel * init.rank_in_group
    # ds_numel is unpadded: the last slice may be short or empty.
    valid = max(0, min(param.ds_numel - start, shard_numel))
    with torch.no_grad(), trace_range("zerotrain/hpz/shard_copy"):
        shard.zero_()  # padding must be deterministic (coalesced gathers/quantisers see it)
        if valid > 0:
            shard.narrow(0, 0, valid).copy_(param.contiguous().view(-1).narrow(0, start, valid))

    _order_after_copy(shard, param)
    counting.bump("shards_built" if fresh else "shards_refreshed")
    counting.bump("shard_copies")
    # Publish last: a reader only ever sees a shard whose ordering token is attached.
    param.ds_secondary_tensor = shard


def _new_shard(init: Any, param: ZeroParam, shard_numel: int) -> ZeroShard:
    shard = cast(ZeroShard, torch.empty(shard_numel, dtype=param.dtype, device=init.remote_device))
    if init.pin_memory:
        shard = get_accelerator().pin_memory(shard)
    shard.requires_grad = False
    shard.ds_numel = shard_numel
    shard.status = PartitionedParamStatus.AVAILABLE
    shard.final_location = None
    return shard


def _build_legacy(init: Any, param: ZeroParam) -> None:
    """DeepSpeed <= 0.13.4's secondary partition, reproduced (not copied) for the paper's baseline.

    What differs from today: the shard is published before it is written; it is
    re-copied on every release (no "already partitioned" check, ``has_been_updated``
    ignored); its padding is never zeroed; and the copy is decided by this rank's
    *primary* partition ``[rank*P, (rank+1)*P)`` instead of the shard's own range:

    * primary partition inside the parameter: the whole shard is copied if the
      shard's range is inside too -- otherwise nothing is;
    * primary partition straddling the end: ``(numel - rank*P) * groups`` elements
      are copied (``groups`` = dp size / hpZ size), which is not the shard's valid
      length in general;
    * primary partition past the end: nothing.

    So when ``ds_numel`` is not a multiple of the data-parallel size, parts of some
    ranks' shards keep whatever the memory held. No ordering, no host sync.
    """
    aligned = init._aligned_size(param)
    primary = aligned // init.dp_world_size
    shard_numel = aligned // init.num_ranks_in_param_group
    fresh = param.ds_secondary_tensor is None
    if fresh:
        param.ds_secondary_tensor = _new_shard(init, param, shard_numel)  # published before it holds data
    shard = param.ds_secondary_tensor
    assert shard is not None  # built just above when missing

    numel = param.ds_numel
    sec_start = shard_numel * init.rank_in_group
    start = primary * init.rank
    copied = 0
    flat = param.contiguous().view(-1)
    with torch.no_grad(), trace_range("zerotrain/hpz/shard_copy"):
        if start < numel and start + primary <= numel:
            if sec_start + shard_numel <= numel:
                copied = shard_numel
        elif start < numel:
            copied = (numel - start) * param.ds_secondary_tensor_num_of_groups
        if copied > 0:
            shard.narrow(0, 0, copied).copy_(flat.narrow(0, sec_start, copied))

    setattr(shard, EVENT_ATTR, None)
    valid = max(0, min(numel - sec_start, shard_numel))
    counting.bump("legacy_unwritten_elements", max(0, valid - copied))
    counting.bump("unordered_copies")
    counting.bump("shards_built" if fresh else "shards_refreshed")
    counting.bump("shard_copies")


def _order_after_copy(shard: torch.Tensor, param: ZeroParam) -> None:
    """Make the just-enqueued shard copy safe to read, the way the active mode prescribes."""
    accel = get_accelerator()
    setattr(shard, EVENT_ATTR, None)
    if _mode == "stock":
        # DeepSpeed 0.19.8 minus its sync: the all-gather stream may overtake the copy.
        counting.bump("unordered_copies")
        return
    if not needs_ordering(accel):
        counting.bump("device_ordered_copies")
        return
    stream = accel.current_stream()
    if _mode == "sync":
        # DeepSpeed >= 0.13.5 / the paper: stall the host until the copy has run.
        stream.synchronize()
        counting.bump("host_syncs")
        return
    # Ours: an event marks the copy's completion point on the copying stream; readers make
    # *their* stream wait on it, so the host never blocks.
    event = accel.Event()
    event.record()  # on the current (copying) stream of this thread
    setattr(shard, EVENT_ATTR, event)
    counting.bump("events_recorded")
    _protect_copy_source(param, stream)


def _protect_copy_source(param: ZeroParam, stream: Any) -> None:
    """Keep the gathered parameter's memory from being recycled before the copy on ``stream`` has read it.

    The gathered parameter is allocated on the all-gather stream. DeepSpeed's
    ``free_param`` marks it used by the compute stream (``record_stream``) before
    dropping it, but the leaf-module fast path (``stage3_module_granularity_threshold
    > 0``) drops it with ``param.data = empty_buffer`` and no ``record_stream``: the
    caching allocator could then hand the block to the next all-gather while our
    copy -- enqueued, not yet run, since we do not stall the host -- still has to
    read it. ``sync`` is safe there because the copy has finished when the host
    returns; this keeps ``ordered`` as safe.
    """
    data = param.data
    if get_accelerator().on_accelerator(data):
        data.record_stream(stream)
        counting.bump("source_record_streams")


# --------------------------------------------------------------------------- reader


def secondary_readers(params: Iterable[ZeroParam]) -> List[ZeroParam]:
    """The parameters an all-gather is about to serve from their secondary shard.

    Mirrors the coordinator's split: only NOT_AVAILABLE parameters are gathered,
    and those with a shard are gathered from it over the hpZ group.
    """
    return [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.ds_secondary_tensor is not None]


def before_secondary_read(readers: List[ZeroParam], allgather_stream: Any, forward: bool = True) -> None:
    """Order the all-gather stream after the copies of exactly the shards in ``readers``.

    Must be called before the all-gather is enqueued. A stream-level wait
    orders everything later enqueued on that stream, so issuing it ahead of the
    ``with stream(allgather_stream)`` block in DeepSpeed is sufficient.

    Raises :class:`HpzOrderingError` in ``ordered`` mode when the device needs
    ordering but ``allgather_stream`` is None: issuing no wait would bring the race
    back silently.
    """
    if not readers:
        return
    counting.bump("secondary_gathers")
    counting.bump("shards_read", len(readers))
    if not forward:
        counting.bump("shards_read_backward", len(readers))
    accel = get_accelerator()
    if _mode != "ordered" or not needs_ordering(accel):
        return
    if allgather_stream is None:
        raise HpzOrderingError(
            "zerotrain.hpz mode 'ordered': the accelerator runs work asynchronously on streams, but no all-gather "
            "stream was found on DeepSpeed's parameter coordinator (PartitionedParameterCoordinator."
            "__allgather_stream is missing or None -- a DeepSpeed outside the supported range?). Without it the "
            "all-gather cannot be ordered after the shard copies and would read them unordered (DeepSpeed issue "
            "#5059). Use hpz mode 'sync', or the pinned deepspeed==0.19.8.")
    waits = 0
    for param in readers:
        shard = param.ds_secondary_tensor
        event = getattr(shard, EVENT_ATTR, None)
        if event is None:
            # Built by another mode, by DeepSpeed's own (syncing) path, or quantised in place by the
            # ZeRO-3 optimizer at start-up (which synchronises the device afterwards): already safe.
            continue
        assert shard is not None  # it carries the event
        allgather_stream.wait_event(event)
        waits += 1
        # The shard lives in the compute stream's pool; without this a shard dropped while a read
        # by an all-gather is still unfinished could be recycled by the compute stream.
        if accel.on_accelerator(shard):
            shard.record_stream(allgather_stream)
            counting.bump("record_streams")
    counting.bump("waits_issued", waits)
