"""Ordering unit tests: the three modes against a recording stand-in for streams and events.

Like DeepSpeed's own tests with a fake accelerator, we swap ``get_accelerator``
(in :mod:`zerotrain.hpz.ordering`) for a recorder that models asynchronous
streams: every operation is appended to one log, and a checker replays it to
decide whether each read of a shard on the all-gather stream is ordered after
that shard's copy -- by running on the same stream, by a stream wait on an
event recorded after the copy, or by a host synchronisation of the copying
stream before the read was enqueued. Copies are observed through the
module's debug trace hook, which fires right after the copy is enqueued.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Dict, List, Tuple

import pytest
import torch

from zerotrain.hpz import counting, ordering
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


class FakeStream:
    def __init__(self, acc: "FakeAccelerator", name: str):
        self.acc, self.name = acc, name

    def wait_event(self, event: "FakeEvent") -> None:
        self.acc.log.append(("wait", self, event))

    def synchronize(self) -> None:
        self.acc.log.append(("host_sync", self))

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeEvent:
    def __init__(self, acc: "FakeAccelerator"):
        self.acc, self.stream = acc, None

    def record(self, stream=None) -> None:
        self.stream = stream or self.acc.current_stream()
        self.acc.log.append(("record", self.stream, self))


class FakeAccelerator:
    """Streams exist (not a synchronised device); current stream is per thread, like CUDA's."""

    def __init__(self):
        self.log: List[Tuple] = []
        self.compute = FakeStream(self, "compute")
        self.allgather = FakeStream(self, "allgather")
        self._tls = threading.local()
        self.lock = threading.Lock()

    @property
    def Event(self):
        return lambda: FakeEvent(self)

    def is_synchronized_device(self) -> bool:
        return False

    def resolves_data_dependency(self) -> bool:
        return False

    def current_stream(self, device_index=None) -> FakeStream:
        return getattr(self._tls, "stream", self.compute)

    def set_current_stream(self, stream: FakeStream) -> None:
        self._tls.stream = stream

    def pin_memory(self, t):
        return t


def unordered_reads(log: List[Tuple]) -> List[int]:
    """Replay the log; return ds_ids read on some stream before their copy was ordered."""
    enqueued: Dict[FakeStream, int] = {}
    event_pos: Dict[FakeEvent, Tuple[FakeStream, int]] = {}
    waited: Dict[Tuple[FakeStream, FakeStream], int] = {}  # (waiter, source) -> ops covered
    synced: Dict[FakeStream, int] = {}
    last_copy: Dict[int, Tuple[FakeStream, int]] = {}
    bad = []
    for entry in log:
        kind = entry[0]
        if kind == "copy":
            _, ds_id, stream = entry
            last_copy[ds_id] = (stream, enqueued.get(stream, 0))
            enqueued[stream] = enqueued.get(stream, 0) + 1
        elif kind == "record":
            _, stream, event = entry
            event_pos[event] = (stream, enqueued.get(stream, 0))
        elif kind == "wait":
            _, waiter, event = entry
            source, pos = event_pos[event]
            waited[(waiter, source)] = max(waited.get((waiter, source), 0), pos)
        elif kind == "host_sync":
            _, stream = entry
            synced[stream] = enqueued.get(stream, 0)
        elif kind == "read":
            _, ds_id, stream = entry
            src, index = last_copy[ds_id]
            ordered = (src is stream or waited.get((stream, src), 0) > index or synced.get(src, 0) > index)
            if not ordered:
                bad.append(ds_id)
            enqueued[stream] = enqueued.get(stream, 0) + 1
    return bad


@pytest.fixture
def fake(monkeypatch):
    acc = FakeAccelerator()
    monkeypatch.setattr(ordering, "get_accelerator", lambda: acc)
    ordering.set_trace(lambda kind, ds_id, stream: acc.log.append((kind, ds_id, stream)))
    previous = ordering.get_mode()
    counting.reset()
    yield acc
    ordering.set_trace(None)
    ordering.set_mode(previous)


def make_param(ds_id: int, numel: int = 10, requires_grad: bool = True) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.arange(numel, dtype=torch.float32) + 100 * ds_id, requires_grad=requires_grad)
    p.ds_id, p.ds_numel, p.ds_status, p.ds_secondary_tensor = ds_id, numel, ZeroParamStatus.AVAILABLE, None
    return p


def make_init(rank_in_group: int = 0, group: int = 2) -> SimpleNamespace:
    align = lambda p: -(-p.ds_numel // 4) * 4  # noqa: E731 (pad to the dp world size, 4)
    return SimpleNamespace(_aligned_size=align, num_ranks_in_param_group=group, rank_in_group=rank_in_group,
                           remote_device="cpu", pin_memory=False, quantized_nontrainable_weights=False)


def release_then_gather(acc: FakeAccelerator, mode: str, n_params: int = 6, threads: int = 2) -> List[int]:
    """Release (shard build) on several autograd-like threads with their own current stream,
    then prefetch-gather a subset on the all-gather stream. Returns the unordered reads."""
    ordering.set_mode(mode)
    params = [make_param(i) for i in range(n_params)]
    init = make_init()
    streams = [acc.compute] + [FakeStream(acc, f"autograd{t}") for t in range(1, threads)]

    def writer(t):
        acc.set_current_stream(streams[t])
        for p in params[t::threads]:
            ordering.build_secondary_shard(init, p)
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE

    workers = [threading.Thread(target=writer, args=(t, )) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    readers = ordering.secondary_readers(params[1:5])  # what one prefetch bucket reads
    ordering.before_secondary_read(readers, acc.allgather)
    for p in readers:
        acc.log.append(("read", p.ds_id, acc.allgather))
    return unordered_reads(acc.log)


def test_ordered_every_read_waits_on_its_copy_event_and_host_never_syncs(fake):
    assert release_then_gather(fake, "ordered") == []
    waits = [e for e in fake.log if e[0] == "wait"]
    assert all(stream is fake.allgather for _, stream, _ in waits)
    # Exactly the shards read: one wait per reader, on that shard's own event.
    assert len(waits) == 4 and len({id(ev) for _, _, ev in waits}) == 4
    assert not [e for e in fake.log if e[0] == "host_sync"]
    c = counting.snapshot()
    assert c["host_syncs"] == 0 and c["events_recorded"] == 6 and c["waits_issued"] == 4 and c["shards_read"] == 4


def test_stock_reads_before_copy_is_ordered(fake):
    bad = release_then_gather(fake, "stock")
    assert sorted(bad) == [1, 2, 3, 4]  # every read of a shard copied on another stream races
    assert not [e for e in fake.log if e[0] in ("wait", "host_sync", "record")]
    assert counting.get("unordered_copies") == 6


def test_sync_host_waits_after_every_copy(fake):
    assert release_then_gather(fake, "sync") == []
    assert len([e for e in fake.log if e[0] == "host_sync"]) == 6
    assert not [e for e in fake.log if e[0] == "wait"]
    assert counting.get("host_syncs") == 6


def test_ordered_single_stream_on_stream_less_device_counts_logical_ops(fake, monkeypatch):
    """CPU accelerator: no streams, no events; the logic still runs and is counted."""
    cpu_like = SimpleNamespace(Event=None, is_synchronized_device=lambda: True, current_stream=lambda: None,
                               pin_memory=lambda t: t)
    monkeypatch.setattr(ordering, "get_accelerator", lambda: cpu_like)
    ordering.set_mode("ordered")
    p = make_param(7)
    ordering.build_secondary_shard(make_init(), p)
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
    ordering.before_secondary_read(ordering.secondary_readers([p]), None)
    c = counting.snapshot()
    assert (c["events_recorded"], c["waits_issued"], c["shards_read"], c["host_syncs"]) == (1, 1, 1, 0)


def test_shard_content_padding_and_refresh(fake):
    ordering.set_mode("ordered")
    p = make_param(3, numel=10)  # aligned 12, hpZ group 2 -> shard of 6; rank 1 holds [6, 12)
    init = make_init(rank_in_group=1)
    ordering.build_secondary_shard(init, p)
    shard = p.ds_secondary_tensor
    assert torch.equal(shard, torch.tensor([306., 307., 308., 309., 0., 0.]))
    first_event = getattr(shard, ordering.EVENT_ATTR)
    ordering.build_secondary_shard(init, p)  # unchanged weights: kept as is
    assert p.ds_secondary_tensor is shard and getattr(shard, ordering.EVENT_ATTR) is first_event
    with torch.no_grad():
        p.add_(1)
    ordering.build_secondary_shard(init, p, has_been_updated=True)  # GatheredParameters(modifier_rank=..)
    assert torch.equal(p.ds_secondary_tensor, torch.tensor([307., 308., 309., 310., 0., 0.]))
    assert getattr(p.ds_secondary_tensor, ordering.EVENT_ATTR) is not first_event
    assert counting.get("shards_built") == 1 and counting.get("shards_refreshed") == 1


def test_reader_ignores_available_and_unsharded_params(fake):
    ordering.set_mode("ordered")
    a, b, c = make_param(1), make_param(2), make_param(3)
    ordering.build_secondary_shard(make_init(), a)
    a.ds_status = ZeroParamStatus.NOT_AVAILABLE
    c.ds_status = ZeroParamStatus.NOT_AVAILABLE  # no shard: gathered from the primary partitions
    assert ordering.secondary_readers([a, b, c]) == [a]
