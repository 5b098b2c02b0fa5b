"""hpZ's shard builders and reader hook under the emulated asynchronous accelerator (one process, fast).

The writer is a real builder -- zerotrain's ``ordering.build_secondary_shard`` in
each mode, or DeepSpeed 0.19.8's own ``Init._partition_param_sec`` -- called the
way ``Init._partition`` calls it, on the releasing thread's stream. The reader is
zerotrain's hook followed by the read DeepSpeed's all-gather does
(``_all_gather_dtype``: ``torch.cat`` of the shards into the flat buffer, under the
all-gather stream). The emulator decides, by CUDA's rules, whether each read was
ordered after its copy and what it saw. The 4-rank real-engine version of these
checks is test_hpz_emulated.py.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import _emulator_controls as controls
import pytest
import torch
from deepspeed.runtime.zero import partition_parameters
from deepspeed.runtime.zero.partition_parameters import Init, ZeroParamStatus

from zerotrain import hpz
from zerotrain.hpz import async_emulator as emu
from zerotrain.hpz import counting, ordering, verify

POISON = emu.DEFAULT_POISON
DP, GROUP = 4, 2  # data-parallel world and hpZ group of the layout under test
DEEPSPEED_BUILDER = Init._partition_param_sec  # DeepSpeed's own (hpz is not installed at import)


@pytest.fixture
def accel(monkeypatch):
    monkeypatch.setattr(partition_parameters, "print_rank_0", lambda *a, **k: None)  # logs through dist
    previous = ordering.get_mode()
    accelerator = emu.install()
    counting.reset()
    yield accelerator
    hpz.uninstall()
    ordering.set_mode(previous)
    emu.uninstall()


def make_param(ds_id: int, numel: int = 10, requires_grad: bool = True) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.arange(numel, dtype=torch.float32) + 100 * ds_id, requires_grad=requires_grad)
    p.ds_id, p.ds_numel, p.ds_status, p.ds_secondary_tensor = ds_id, numel, ZeroParamStatus.AVAILABLE, None
    p.ds_secondary_tensor_num_of_groups = DP // GROUP
    return p


def make_init(rank: int = 0, dp: int = DP, group: int = GROUP) -> SimpleNamespace:
    def align(p):  # padded to a multiple of the data-parallel world size
        return -(-p.ds_numel // dp) * dp

    return SimpleNamespace(_aligned_size=align, num_ranks_in_param_group=group, rank_in_group=rank % group,
                           rank=rank, dp_world_size=dp, remote_device="cpu", pin_memory=False,
                           quantized_nontrainable_weights=False)


def builder(arm: str):
    if arm == "deepspeed":
        return DEEPSPEED_BUILDER
    ordering.set_mode(arm)
    return ordering.build_secondary_shard


def release(init, params, build) -> None:
    """What Init._partition does for each released parameter (the emulator's shard-build scope included)."""
    for p in params:
        with emu.shard_build(p):
            build(init, p)
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def gather(accel, readers, allgather, hook: bool = True) -> torch.Tensor:
    if hook:
        ordering.before_secondary_read(readers, allgather)
    out = torch.empty(sum(p.ds_secondary_tensor.numel() for p in readers))
    with accel.stream(allgather):
        torch.cat([p.ds_secondary_tensor for p in readers], out=out)
    return out


def expected(params, init) -> torch.Tensor:
    """The shards as they must be: this rank's slice of each parameter, zero padding."""
    parts = []
    for p in params:
        size = init._aligned_size(p) // init.num_ranks_in_param_group
        start = size * init.rank_in_group
        part = torch.zeros(size)
        valid = max(0, min(p.ds_numel - start, size))
        part[:valid] = p.detach()[start:start + valid]
        parts.append(part)
    return torch.cat(parts)


def release_then_gather(accel, arm: str, n_params: int = 6, hook: bool = True):
    params, init = [make_param(i) for i in range(n_params)], make_init()
    release(init, params, builder(arm))
    readers = ordering.secondary_readers(params[1:5])  # what one prefetch bucket reads
    got = gather(accel, readers, accel.Stream(name="allgather"), hook=hook)
    return got, expected(readers, init)


@pytest.mark.parametrize("arm", ["stock", "legacy"])
def test_racy_modes_read_every_shard_before_its_copy_and_gather_garbage(accel, arm):
    got, _ = release_then_gather(accel, arm)
    report = emu.report()
    assert report["races"] == 4 and report["racy_params"] == [1, 2, 3, 4]
    assert {r.stream for r in emu.races()} == {"allgather"} and torch.all(got == POISON)
    assert counting.get("unordered_copies") == 6 and counting.get("host_syncs") == 0


@pytest.mark.parametrize("arm", ["sync", "ordered", "deepspeed"])
def test_fixed_modes_and_deepspeeds_builder_gather_exactly_the_shards(accel, arm):
    got, want = release_then_gather(accel, arm, hook=arm != "deepspeed")
    assert emu.report()["races"] == 0 and torch.equal(got, want)


def test_ordered_waits_on_the_allgather_stream_and_never_stalls_the_host(accel):
    release_then_gather(accel, "ordered")
    ops, c = emu.report()["ops"], counting.snapshot()
    assert ops["wait_event"] == {"allgather": 4} and ops["record_event"] == {"default": 6}
    assert "host_wait_in_shard_build" not in ops and "stream_synchronize" not in ops
    assert (c["events_recorded"], c["waits_issued"], c["record_streams"], c["host_syncs"]) == (6, 4, 4, 0)


@pytest.mark.parametrize("arm", ["sync", "deepspeed"])
def test_sync_and_deepspeeds_builder_stall_the_host_after_every_copy(accel, arm):
    release_then_gather(accel, arm, hook=arm != "deepspeed")
    assert emu.report()["ops"]["host_wait_in_shard_build"] == {"default": 6}
    assert counting.get("host_syncs") == (6 if arm == "sync" else 0)  # DeepSpeed's own builder counts nothing


def test_ordered_with_writers_on_several_streams_orders_every_read(accel):
    ordering.set_mode("ordered")
    params, init = [make_param(i) for i in range(6)], make_init()
    streams = [accel.default_stream(), accel.Stream(name="autograd")]

    def writer(t):
        with accel.stream(streams[t]):
            release(init, params[t::2], ordering.build_secondary_shard)

    workers = [threading.Thread(target=writer, args=(t, )) for t in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    got = gather(accel, params, accel.Stream(name="allgather"))
    assert emu.report()["races"] == 0 and torch.equal(got, expected(params, init))


@pytest.mark.parametrize("control", controls.CONTROLS)
def test_each_broken_ordered_variant_is_caught(accel, monkeypatch, control):
    name = controls.target(control)
    monkeypatch.setattr(ordering, name, controls.wrap(control, getattr(ordering, name)))
    got, want = release_then_gather(accel, "ordered")
    assert emu.report()["races"] >= 1 and not torch.equal(got, want)


def test_ordered_refuses_to_read_unordered_when_no_allgather_stream_is_found(accel):
    ordering.set_mode("ordered")
    params = [make_param(i) for i in range(2)]
    release(make_init(), params, ordering.build_secondary_shard)
    coordinator_without_stream = SimpleNamespace()  # e.g. a future DeepSpeed renamed the private attribute
    with pytest.raises(hpz.HpzOrderingError, match="no all-gather stream was found"):
        hpz._before_secondary_gather(coordinator_without_stream, params, forward=False)
    assert counting.get("waits_issued") == 0 and counting.get("record_streams") == 0


def test_on_a_synchronous_device_nothing_is_issued_or_counted_as_issued():
    """The CPU accelerator orders everything itself: no event, wait or host sync -- and none counted."""
    counting.reset()
    previous = ordering.get_mode()
    try:
        for mode in ("ordered", "sync"):
            ordering.set_mode(mode)
            params = [make_param(i) for i in range(3)]
            release(make_init(), params, ordering.build_secondary_shard)
            hpz._before_secondary_gather(SimpleNamespace(), params, forward=False)  # no stream needed
    finally:
        ordering.set_mode(previous)
    c = counting.snapshot()
    assert (c["events_recorded"], c["waits_issued"], c["record_streams"], c["host_syncs"]) == (0, 0, 0, 0)
    assert c["device_ordered_copies"] == c["shard_copies"] == 6 and c["shards_read"] == 6


@pytest.mark.parametrize("resolves", [False, True])
def test_sync_skips_the_host_wait_where_the_device_resolves_data_dependencies(accel, monkeypatch, resolves):
    monkeypatch.setattr(accel, "resolves_data_dependency", lambda: resolves)  # e.g. HPU: streams, but ordered
    ordering.set_mode("sync")
    release(make_init(), [make_param(i) for i in range(3)], ordering.build_secondary_shard)
    host_waits = emu.report()["ops"].get("host_wait_in_shard_build", {})
    assert host_waits == ({} if resolves else {"default": 3})
    assert counting.get("host_syncs") == (0 if resolves else 3)


class LoopbackComm:
    """deepspeed.comm for a 2-rank group whose other rank holds the same data (so dp = hpZ size = 2)."""

    def get_world_size(self, group=None):
        return 2

    def get_rank(self, group=None):
        return 0

    def all_gather(self, out, tensor, group=None):
        for o in out:
            o.copy_(tensor)


@pytest.mark.parametrize("order", ["wait_then_verify", "verify_then_wait"])
def test_verify_reads_the_shards_after_the_ordering_wait(accel, monkeypatch, order):
    monkeypatch.setattr(verify, "dist", LoopbackComm())
    hpz.install(mode="ordered", verify=True)
    init = make_init(rank=0, dp=2, group=2)
    param = make_param(7, numel=8)
    param.ds_tensor = param.detach()[:4].clone()  # rank 0's primary partition == its shard (dp = hpZ size)
    param.ds_tensor.ds_numel = 4
    param.ds_secondary_tensor_group_size, param.ds_process_group = 2, None
    with accel.stream(accel.Stream(name="releasing")):  # the shard is written on another stream
        release(init, [param], ordering.build_secondary_shard)
    coordinator = SimpleNamespace(**{hpz.ALLGATHER_STREAM_ATTR: accel.Stream(name="allgather")})
    if order == "wait_then_verify":  # what the reader hook does
        hpz._before_secondary_gather(coordinator, [param], forward=False)
        assert emu.races() == [] and counting.get("verify_checks") == 1
    else:  # the order before the fix: verify on the caller's stream, then the wait -> false corruption
        with pytest.raises(hpz.HpzVerificationError, match="ds_id=7"):
            verify.check_shards([param])
        assert emu.report()["races"] >= 1


@pytest.mark.parametrize("arm", ["sync", "ordered", "ordered_unprotected", "stock"])
def test_ordered_keeps_the_copy_source_alive_on_the_leaf_fast_path(accel, monkeypatch, arm):
    """DeepSpeed's leaf-module fast path drops the gathered parameter (param.data = empty_buffer) without
    record_stream while the shard copy may still be queued; ordered must be as safe as sync there."""
    if arm == "ordered_unprotected":
        monkeypatch.setattr(ordering, "_protect_copy_source", lambda param, stream: None)
    params, init = [make_param(i) for i in range(3)], make_init()
    build = builder(arm.split("_")[0])
    empty_buffer = torch.empty(1)
    for p in params:
        with emu.shard_build(p):
            build(init, p)
        p.data = empty_buffer  # partition(free_data=False), then the coordinator drops the gathered block
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE
    accel.synchronize()  # run every queued copy
    recycled = emu.report()["freed_source_races"]
    assert recycled == (0 if arm in ("sync", "ordered") else 3)
    if arm == "ordered":
        assert counting.get("source_record_streams") == 3


@pytest.mark.parametrize("rank", range(DP))
def test_legacy_copy_rule_leaves_shards_unwritten_when_numel_is_not_a_multiple_of_dp(accel, rank):
    """0.13.x keyed the copy on the rank's primary partition: with numel 10 on 4 ranks (aligned 12,
    primary 3, shard 6) rank 1 copies nothing and rank 3 copies 2 of its 4 valid elements."""
    init = make_init(rank=rank)
    shards = {}
    for arm in ("legacy", "ordered"):
        param = make_param(5)
        release(init, [param], builder(arm))
        accel.synchronize()
        shards[arm] = param.ds_secondary_tensor
    correct = expected([make_param(5)], init)
    assert torch.equal(shards["ordered"], correct)
    written = {0: 6, 1: 0, 2: 6, 3: 2}[rank]
    assert torch.equal(shards["legacy"][:written], correct[:written])
    assert torch.all(shards["legacy"][written:] == POISON)  # unwritten elements and unzeroed padding
    assert counting.get("legacy_unwritten_elements") == {0: 0, 1: 4, 2: 0, 3: 2}[rank]


def test_legacy_copies_every_shard_completely_when_numel_is_a_multiple_of_dp(accel):
    for rank in range(DP):
        init, param = make_init(rank=rank), make_param(5, numel=12)
        release(init, [param], builder("legacy"))
        accel.synchronize()
        assert torch.equal(param.ds_secondary_tensor, expected([param], init)), rank
    assert counting.get("legacy_unwritten_elements") == 0


@pytest.mark.parametrize("arm", ["legacy", "stock"])
def test_legacy_recopies_on_every_release_stock_builds_once(accel, arm):
    param, init = make_param(3), make_init()
    for _ in range(3):
        param.ds_status = ZeroParamStatus.AVAILABLE  # gathered again, then released again
        release(init, [param], builder(arm))
    assert counting.get("shards_built") == 1
    assert counting.get("shards_refreshed") == (2 if arm == "legacy" else 0)


def test_shard_content_padding_and_refresh(accel):
    ordering.set_mode("ordered")
    p = make_param(3, numel=10)  # aligned 12, hpZ group 2 -> shard of 6; rank 1 holds [6, 12)
    init = make_init(rank=1)
    release(init, [p], ordering.build_secondary_shard)
    shard = p.ds_secondary_tensor
    assert torch.equal(shard, torch.tensor([306., 307., 308., 309., 0., 0.]))
    first_event = getattr(shard, ordering.EVENT_ATTR)
    p.ds_status = ZeroParamStatus.AVAILABLE
    release(init, [p], ordering.build_secondary_shard)  # unchanged weights: kept as is
    assert p.ds_secondary_tensor is shard and getattr(shard, ordering.EVENT_ATTR) is first_event
    p.ds_status = ZeroParamStatus.AVAILABLE
    with torch.no_grad():
        p.add_(1)
    with emu.shard_build(p):
        ordering.build_secondary_shard(init, p, has_been_updated=True)  # GatheredParameters(modifier_rank=..)
    assert torch.equal(p.ds_secondary_tensor, torch.tensor([307., 308., 309., 310., 0., 0.]))
    assert getattr(p.ds_secondary_tensor, ordering.EVENT_ATTR) is not first_event
    assert counting.get("shards_built") == 1 and counting.get("shards_refreshed") == 1


def test_reader_ignores_available_and_unsharded_params(accel):
    ordering.set_mode("ordered")
    a, b, c = make_param(1), make_param(2), make_param(3)
    release(make_init(), [a], ordering.build_secondary_shard)
    c.ds_status = ZeroParamStatus.NOT_AVAILABLE  # no shard: gathered from the primary partitions
    assert ordering.secondary_readers([a, b, c]) == [a]
