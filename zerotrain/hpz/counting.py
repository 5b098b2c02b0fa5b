"""Process-wide counters for the hpZ module.

Every hook in :mod:`zerotrain.hpz` bumps a named counter for each *logical*
operation it performs -- an event recorded, a stream wait issued, a host sync,
a shard built or read -- even on accelerators (the CPU one) where the physical
operation is a no-op. That is what lets tests and training logs prove the
module was really exercised, e.g. "secondary shards were read in backward".

Backward hooks run on autograd worker threads, so updates take a lock.
"""

from __future__ import annotations

import threading
from typing import Dict

# The counters every snapshot reports, even when still zero, so that logs and
# tests can index them without `.get`.
COUNTER_NAMES = (
    "shards_built",  # a fresh secondary shard was allocated and filled
    "shards_refreshed",  # an existing shard was overwritten (weights changed under GatheredParameters)
    "shard_copies",  # copies into a secondary shard (built + refreshed)
    "shards_read",  # secondary shards consumed by a prefetching all-gather
    "shards_read_backward",  # ... of which during the backward pass (the traffic hpZ exists for)
    "secondary_gathers",  # all-gather calls that read at least one secondary shard
    "events_recorded",  # ordered mode: copy-completion events recorded
    "waits_issued",  # ordered mode: all-gather stream waits on a copy event
    "record_streams",  # ordered mode: shards marked as used by the all-gather stream
    "host_syncs",  # sync mode: host blocked on the compute stream
    "unordered_copies",  # stock mode: copies published with no ordering at all
    "shards_invalidated",  # shards dropped because weights changed outside the optimizer step
    "verify_checks",  # verify mode: shards compared against the primary partitions
    "verify_collectives",  # verify mode: checksum all-gathers issued
    "optimizer_steps",  # ZeRO-3 optimizer steps observed (shards are invalidated after each)
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
