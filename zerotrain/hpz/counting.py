"""Process-wide counters for the hpZ module.

Every hook in :mod:`zerotrain.hpz` bumps a named counter for what it did -- a
shard built or read, an event recorded, a stream wait issued, a host sync. The
ordering counters (events, waits, ``record_stream``, host syncs) count only
operations really issued: on an accelerator that orders work itself (the CPU
one) they stay 0 and ``device_ordered_copies`` says why, so a log can never
claim the race was ordered away when no wait was issued. The shard counters
prove the module was exercised, e.g. "secondary shards were read in backward".

Backward hooks run on autograd worker threads, so updates take a lock.
"""

from __future__ import annotations

import threading
from typing import Dict

# The counters every snapshot reports, even when still zero, so that logs and
# tests can index them without `.get`.
COUNTER_NAMES = (
    "shards_built",  # a fresh secondary shard was allocated and filled
    "shards_refreshed",  # an existing shard was overwritten (weights changed; legacy: every release)
    "shard_copies",  # copies into a secondary shard (built + refreshed)
    "shards_read",  # secondary shards consumed by a prefetching all-gather
    "shards_read_backward",  # ... of which during the backward pass (the traffic hpZ exists for)
    "secondary_gathers",  # all-gather calls that read at least one secondary shard
    "events_recorded",  # ordered: copy-completion events recorded on the copying stream
    "waits_issued",  # ordered: all-gather stream waits on a copy event
    "record_streams",  # ordered: shards marked as used by the all-gather stream
    "source_record_streams",  # ordered: gathered parameters marked as used by the copying stream
    "host_syncs",  # sync (and DeepSpeed's quantised-shard path): host blocked on the compute stream
    "device_ordered_copies",  # sync/ordered: copies the accelerator orders itself (CPU): nothing issued
    "unordered_copies",  # stock/legacy: copies published with no ordering at all
    "legacy_unwritten_elements",  # legacy: valid shard elements 0.13's copy rule left unwritten
    "shards_invalidated",  # shards dropped because weights changed outside the optimizer step
    "verify_checks",  # verify mode: shards compared against the primary partitions
    "verify_collectives",  # verify mode: checksum all-gathers issued
    "optimizer_steps",  # ZeRO-3 optimizer steps observed (shards are invalidated after each)
    "hierarchical_grad_reduces",  # grad_reduce=hierarchical: gradient buckets reduce-scattered in two stages
)

_lock = threading.Lock()
_counts: Dict[str, int] = {name: 0 for name in COUNTER_NAMES}


def bump(name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name`` (created on first use if not predeclared)."""
    with _lock:
        _counts[name] = _counts.get(name, 0) + n


def get(name: str) -> int:
    with _lock:
        return _counts.get(name, 0)


def snapshot() -> Dict[str, int]:
    """A copy of all counters; safe to keep, JSON-serialisable."""
    with _lock:
        return dict(_counts)


def reset() -> None:
    with _lock:
        for name in list(_counts):
            _counts[name] = 0
