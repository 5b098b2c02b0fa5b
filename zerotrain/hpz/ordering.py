"""The hpZ secondary-shard race and its three treatments (``stock``, ``sync``, ``ordered``).

The race (DeepSpeed issue #5059, arXiv 2407.01614). When ZeRO-3 releases a
module's gathered parameters, hpZ copies each parameter's node-local slice into
``param.ds_secondary_tensor`` -- freshly ``torch.empty``-allocated memory -- with
an asynchronous copy enqueued on the *compute* stream of the releasing thread.
Later a prefetching all-gather reads that shard on the coordinator's
*all-gather* stream. Nothing orders the read after the copy, so the all-gather
can ship uninitialised memory (loss 0 / NaN).

* ``stock``   -- the original order (DeepSpeed <= 0.13.4): copy, publish, no
  synchronisation. Exists only to reproduce the failure.
* ``sync``    -- what the paper proposes and DeepSpeed >= 0.13.5 does: the host
  waits for the compute stream after every shard copy. Correct, but one host
  stall per released parameter.
* ``ordered`` -- ours: no host wait. The writer records an accelerator event on
  the copying stream right after the copy and attaches it to the shard; before
  an all-gather that reads secondary shards, the all-gather stream waits on the
  events of exactly the shards it reads, and the shard is ``record_stream``-ed
  onto the all-gather stream so the caching allocator cannot hand its memory to
  the next (post-step) shard while the gather may still read it.

Only the ``get_accelerator()`` API is used. On the CPU accelerator there are no
streams (``Event``/``Stream`` are ``None``, the device is synchronised): all
modes compute the same thing there, but the logical operations are still
counted so it is visible that the code ran.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus, ZeroParamStatus

from . import counting

MODES = ("stock", "sync", "ordered")

_mode: str = "ordered"

# Attribute we hang the copy-completion event on. Living on the shard tensor
# means the event is dropped together with the shard when DeepSpeed
# invalidates it after the optimizer step, and needs no lock-protected table:
# the writer attaches it before publishing the shard to the parameter.
EVENT_ATTR = "_zt_hpz_copy_event"

# Optional debug trace: fn(kind, ds_id, stream). Tests use it to observe where
# copies are enqueued; None (the default) costs one comparison per shard.
_trace: Optional[Callable[[str, int, Any], None]] = None


def set_mode(mode: str) -> None:
    global _mode
    if mode not in MODES:
        raise ValueError(f"unknown hpZ mode {mode!r}; expected one of {MODES}")
    _mode = mode


def get_mode() -> str:
    return _mode


def set_trace(fn: Optional[Callable[[str, int, Any], None]]) -> None:
    global _trace
    _trace = fn


def _has_streams(accel: Any) -> bool:
    """True when the accelerator really runs work asynchronously on streams."""
    return accel.Event is not None and not accel.is_synchronized_device()


# --------------------------------------------------------------------------- writer


def build_secondary_shard(init: Any, param: torch.nn.Parameter, has_been_updated: bool = False,
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
    if shard is not None and not has_been_updated:
        return

    # Quantised shards (ZeRO++ qwZ on frozen weights, or quantised later by the ZeRO-3
    # optimizer) keep DeepSpeed's own path, which host-syncs; rare, and not this module's subject.
    quantised = hasattr(shard, "ds_quant_scale") or (shard is None and not param.requires_grad and getattr(
        init, "quantized_nontrainable_weights", False))
    if quantised:
        if fallback is None:
            raise RuntimeError("quantized non-trainable hpZ shards need DeepSpeed's original builder")
        fallback(init, param, has_been_updated=has_been_updated)
        counting.bump("host_syncs")
        return

    shard_numel = init._aligned_size(param) // init.num_ranks_in_param_group
    fresh = shard is None
    if fresh:
        shard = torch.empty(shard_numel, dtype=param.dtype, device=init.remote_device)
        if init.pin_memory:
            shard = get_accelerator().pin_memory(shard)
        shard.requires_grad = False
        shard.ds_numel = shard_numel
        shard.status = PartitionedParamStatus.AVAILABLE
        shard.final_location = None

    start = shard_numel * init.rank_in_group
    # ds_numel is unpadded: the last slice may be short or empty.
    valid = max(0, min(param.ds_numel - start, shard_numel))
    with torch.no_grad():
        shard.zero_()  # padding must be deterministic (coalesced gathers/quantisers see it)
        if valid > 0:
            shard.narrow(0, 0, valid).copy_(param.contiguous().view(-1).narrow(0, start, valid))
    if _trace is not None:
        _trace("copy", param.ds_id, get_accelerator().current_stream())

    _order_after_copy(shard)
    counting.bump("shards_built" if fresh else "shards_refreshed")
    counting.bump("shard_copies")
    # Publish last: a reader only ever sees a shard whose ordering token is attached.
    param.ds_secondary_tensor = shard


def _order_after_copy(shard: torch.Tensor) -> None:
    """Make the just-enqueued shard copy safe to read, the way the active mode prescribes."""
    accel = get_accelerator()
    if _mode == "stock":
        # DeepSpeed <= 0.13.4: nothing. The all-gather stream may overtake the copy.
        setattr(shard, EVENT_ATTR, None)
        counting.bump("unordered_copies")
    elif _mode == "sync":
        # DeepSpeed >= 0.13.5 / the paper: stall the host until the copy has run.
        stream = accel.current_stream()
        if stream is not None:
            stream.synchronize()
        setattr(shard, EVENT_ATTR, None)
        counting.bump("host_syncs")
    else:
        # Ours: an event marks the copy's completion point on the copying stream; readers
        # make *their* stream wait on it, so the host never blocks.
        event = None
        if _has_streams(accel):
            event = accel.Event()
            event.record()  # on the current (copying) stream of this thread
        # On stream-less devices the copy has already happened; True is a logical token.
        setattr(shard, EVENT_ATTR, event if event is not None else True)
        counting.bump("events_recorded")


# --------------------------------------------------------------------------- reader


def secondary_readers(params: Iterable[torch.nn.Parameter]) -> List[torch.nn.Parameter]:
    """The parameters an all-gather is about to serve from their secondary shard.

    Mirrors the coordinator's split: only NOT_AVAILABLE parameters are gathered,
    and those with a shard are gathered from it over the hpZ group.
    """
    return [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.ds_secondary_tensor is not None]


def before_secondary_read(readers: List[torch.nn.Parameter], allgather_stream: Any, forward: bool = True) -> None:
    """Order the all-gather stream after the copies of exactly the shards in ``readers``.

    Must be called before the all-gather is enqueued. A stream-level wait
    orders everything later enqueued on that stream, so issuing it ahead of the
    ``with stream(allgather_stream)`` block in DeepSpeed is sufficient.
    """
    if not readers:
        return
    counting.bump("secondary_gathers")
    counting.bump("shards_read", len(readers))
    if not forward:
        counting.bump("shards_read_backward", len(readers))
    if _mode != "ordered":
        return
    accel = get_accelerator()
    real = allgather_stream is not None and _has_streams(accel)
    waits = 0
    for param in readers:
        shard = param.ds_secondary_tensor
        event = getattr(shard, EVENT_ATTR, None)
        if event is None:
            # Built by another mode or by DeepSpeed's own (syncing) path: already safe.
            continue
        if real and event is not True:
            allgather_stream.wait_event(event)
            if shard.device.type != "cpu":
                shard.record_stream(allgather_stream)
        waits += 1
    counting.bump("waits_issued", waits)
    counting.bump("record_streams", waits)
