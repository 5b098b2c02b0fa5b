"""The emulated asynchronous accelerator's rules, one process, no process group (fast).

Each test builds a tiny situation -- fresh shard memory, a write enqueued on one
stream, a read on another -- and checks the emulator applies CUDA's visibility
rules: program order on one stream, ``wait_event`` on an event recorded after the
write, ``wait_stream``, host synchronisation; worst-case scheduling otherwise.
"""

from __future__ import annotations

import threading

import deepspeed.accelerator as ds_accelerator
import pytest
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.partition_parameters import Init

from zerotrain.hpz import async_emulator as emu

POISON = emu.DEFAULT_POISON


@pytest.fixture
def accel():
    previous = get_accelerator()
    accelerator = emu.install()
    yield accelerator
    emu.uninstall()
    assert get_accelerator() is previous


def fresh_shard(n: int = 6, param=None) -> torch.Tensor:
    with emu.shard_build(param):
        return torch.empty(n)


def read_on(stream, shard: torch.Tensor) -> torch.Tensor:
    """What DeepSpeed's all-gather does with a shard: torch.cat(..., out=buffer) under its stream."""
    out = torch.empty(shard.numel())
    with get_accelerator().stream(stream):
        torch.cat([shard], out=out)
    return out


DATA = torch.arange(6.0)


def test_accelerator_reports_asynchronous_streams_and_uninstall_restores_deepspeed():
    previous = get_accelerator()
    originals = {name: vars(Init)[name] for name in ("_partition", "_partition_param")}
    forward = vars(DeepSpeedEngine)["forward"]
    accelerator = emu.install()
    try:
        assert get_accelerator() is accelerator and emu.install() is accelerator  # idempotent
        assert not accelerator.is_synchronized_device()
        assert not accelerator.resolves_data_dependency() and not accelerator.handles_memory_backpressure()
        assert not accelerator.use_host_timers()  # DeepSpeed's event timers, as on CUDA
        assert isinstance(accelerator.Stream(), emu.EmulatedStream)
        assert isinstance(accelerator.Event(), emu.EmulatedEvent)
        assert accelerator.current_stream() is accelerator.default_stream()
        assert vars(Init)["_partition"] is not originals["_partition"]
    finally:
        emu.uninstall()
    assert get_accelerator() is previous and not emu.is_installed()
    assert {name: vars(Init)[name] for name in originals} == originals
    assert vars(DeepSpeedEngine)["forward"] is forward and "record_stream" not in vars(torch.Tensor)


def test_install_refuses_once_the_process_group_exists(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(emu.EmulatorError, match="before the process group exists"):
        emu.install()
    assert not emu.is_installed()


def test_install_refuses_a_non_cpu_accelerator(monkeypatch):
    class Cuda:
        _name = "cuda"

    monkeypatch.setattr(ds_accelerator, "get_accelerator", lambda: Cuda())
    with pytest.raises(emu.EmulatorError, match="replaces DeepSpeed's CPU accelerator.*'cuda'"):
        emu.install()
    assert not emu.is_installed()


def test_current_stream_is_per_thread(accel):
    side = accel.Stream()
    seen = {}
    with accel.stream(side):
        worker = threading.Thread(target=lambda: seen.setdefault("worker", accel.current_stream()))
        worker.start()
        worker.join()
        seen["main"] = accel.current_stream()
    assert seen == {"worker": accel.default_stream(), "main": side}
    assert accel.current_stream() is accel.default_stream()


def test_fresh_shard_memory_is_poisoned_and_only_shard_memory_is_deferred(accel):
    shard, other = fresh_shard(), torch.empty(6)
    assert torch.all(shard == POISON)
    shard.copy_(DATA)
    other.copy_(DATA)
    assert emu.report()["pending_writes"] == 1  # only the shard write waits in the queue
    assert torch.equal(read_on(accel.Stream(), other), DATA)


def test_same_stream_reads_see_the_write_in_program_order(accel):
    shard = fresh_shard()
    shard.copy_(DATA)
    assert torch.equal(read_on(accel.default_stream(), shard), DATA)
    assert emu.report()["races"] == 0


def test_unordered_read_on_another_stream_is_a_race_with_param_stream_and_where(accel):
    param = torch.nn.Parameter(DATA.clone())
    param.ds_id = 42
    with emu.shard_build(param):
        shard = torch.empty(6)
        param.ds_secondary_tensor = shard
    shard.copy_(DATA)
    allgather = accel.Stream(name="allgather")
    with emu.phase("train backward step 1 micro 0"):
        got = read_on(allgather, shard)
    assert torch.all(got == POISON)  # the copy has not run: the read ships garbage
    (race, ) = emu.races()
    assert (race.kind, race.param_id, race.stream, race.writer_stream) == ("read", 42, "allgather", "default")
    assert race.where == "train backward step 1 micro 0" and race.op == "aten.cat.out"
    assert emu.report()["racy_params"] == [42]


def test_wait_event_on_an_event_recorded_after_the_write_orders_the_read(accel):
    shard = fresh_shard()
    shard.copy_(DATA)
    event = accel.Event()
    event.record()
    allgather = accel.Stream()
    allgather.wait_event(event)
    assert torch.equal(read_on(allgather, shard), DATA) and emu.report()["races"] == 0


@pytest.mark.parametrize("bug", ["event_before_write", "event_on_wrong_stream", "no_wait"])
def test_waits_that_do_not_cover_the_write_leave_the_race(accel, bug):
    shard = fresh_shard()
    event = accel.Event()
    if bug == "event_before_write":
        event.record()
    shard.copy_(DATA)
    if bug == "event_on_wrong_stream":
        event.record(accel.Stream())
    allgather = accel.Stream()
    if bug != "no_wait":
        allgather.wait_event(event)
    assert torch.all(read_on(allgather, shard) == POISON) and emu.report()["races"] == 1


def test_wait_stream_orders_the_read(accel):
    shard = fresh_shard()
    shard.copy_(DATA)
    allgather = accel.Stream()
    allgather.wait_stream(accel.default_stream())
    assert torch.equal(read_on(allgather, shard), DATA) and emu.report()["races"] == 0


def test_ordering_is_transitive_through_a_chain_of_events(accel):
    a, b, c = accel.Stream(), accel.Stream(), accel.Stream()
    shard = fresh_shard()
    with accel.stream(a):
        shard.copy_(DATA)
    ev_a = a.record_event()
    b.wait_event(ev_a)
    ev_b = b.record_event()  # records nothing new of b, but carries a's write
    c.wait_event(ev_b)
    assert torch.equal(read_on(c, shard), DATA) and emu.report()["races"] == 0


@pytest.mark.parametrize("sync", ["stream", "device", "event", "item_on_writer_stream"])
def test_host_synchronisation_makes_the_write_visible_to_every_stream(accel, sync):
    shard = fresh_shard()
    shard.copy_(DATA)
    event = accel.Event()
    event.record()
    {"stream": lambda: accel.default_stream().synchronize(), "device": accel.synchronize,
     "event": event.synchronize, "item_on_writer_stream": lambda: torch.ones(1).sum().item()}[sync]()
    assert torch.equal(read_on(accel.Stream(), shard), DATA) and emu.report()["races"] == 0
    assert emu.report()["pending_writes"] == 0


def test_host_sync_on_another_stream_does_not_complete_the_write(accel):
    shard = fresh_shard()
    shard.copy_(DATA)
    side = accel.Stream()
    with accel.stream(side):
        torch.ones(1).sum().item()
    side.synchronize()
    assert torch.all(read_on(side, shard) == POISON) and emu.report()["races"] == 1


def test_the_copying_stream_never_runs_unless_forced(accel):
    shard = fresh_shard()
    shard.copy_(DATA)
    event = accel.Event()
    event.record()
    assert not event.query() and not accel.default_stream().query()
    accel.default_stream().synchronize()
    assert event.query() and accel.default_stream().query()


def test_a_racy_read_after_an_ordered_one_still_sees_the_pre_write_contents(accel):
    shard = fresh_shard()
    shard.copy_(DATA)
    ordered, unordered = accel.Stream(), accel.Stream()
    ordered.wait_stream(accel.default_stream())
    first = read_on(ordered, shard)  # runs the copy early, for this reader only
    second = read_on(unordered, shard)
    # (Compared only now: torch.equal is a host sync of the default -- the copying -- stream.)
    assert torch.equal(first, DATA) and torch.all(second == POISON) and emu.report()["races"] == 1


def test_in_place_write_from_another_stream_is_a_write_race(accel):
    shard = fresh_shard()
    shard.copy_(DATA)
    with accel.stream(accel.Stream()):
        shard.add_(1.0)
    assert [r.kind for r in emu.races()] == ["write"]


def test_copy_source_dropped_without_record_stream_is_a_freed_source_race(accel):
    param = torch.nn.Parameter(DATA.clone(), requires_grad=False)
    with emu.shard_build(param):
        shard = torch.empty(6)
        shard.copy_(param.data)
    param.data = torch.empty(1)  # DeepSpeed's leaf fast path: the gathered block goes back, unmarked
    accel.synchronize()
    assert torch.all(shard == POISON) and emu.report()["freed_source_races"] == 1


def test_record_stream_with_the_copying_stream_protects_the_source(accel):
    param = torch.nn.Parameter(DATA.clone(), requires_grad=False)
    with emu.shard_build(param):
        shard = torch.empty(6)
        shard.copy_(param.data)
    param.data.record_stream(accel.current_stream())  # what DeepSpeed's free_param does
    param.data = torch.empty(0)
    accel.synchronize()
    assert torch.equal(shard, DATA) and emu.report()["freed_source_races"] == 0
    assert emu.report()["ops"]["record_stream"] == {"default": 1}


def test_report_counts_stream_operations(accel):
    side = accel.Stream(name="side")
    event = side.record_event()
    accel.default_stream().wait_event(event)
    side.wait_stream(accel.default_stream())
    side.synchronize()
    ops = emu.report()["ops"]
    assert ops["record_event"] == {"side": 1} and ops["wait_event"] == {"default": 1}
    assert ops["wait_stream"] == {"side<-default": 1} and ops["stream_synchronize"] == {"side": 1}
    emu.reset()
    assert emu.report()["ops"] == {} and emu.races() == []


# ----------------------------------------------------------------------------- every form of a write (issue 17)


def _pool_shard(param) -> torch.Tensor:
    """A shard carved from a flat buffer allocated before the build (DeepSpeed's pool/flat-buffer builders)."""
    pool = torch.zeros(18)
    with emu.shard_build(param):
        param.ds_secondary_tensor = pool.narrow(0, 6, 6)
        param.ds_secondary_tensor.copy_(DATA)
    param._pool = pool
    return param.ds_secondary_tensor


WRITE_FORMS = {
    "copy_": lambda s: s.copy_(DATA),
    "slice_assignment": lambda s: s.__setitem__(slice(None), DATA),
    "fill_": lambda s: s.fill_(2.0),
    "zero_": lambda s: s.zero_(),
    "cat_out": lambda s: torch.cat([DATA[:3], DATA[3:]], out=s),
    "index_copy_": lambda s: s.index_copy_(0, torch.arange(6), DATA),
    "add_out": lambda s: torch.add(DATA, 1.0, out=s),
    "foreach_copy_": lambda s: torch._foreach_copy_([s], [DATA]),
}


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
@pytest.mark.parametrize("form", [*WRITE_FORMS, "pool_shard"])
def test_every_form_of_a_shard_write_is_deferred_and_ordered_only_by_an_event(accel, form, ordered):
    param = torch.nn.Parameter(DATA.clone(), requires_grad=False)
    param.ds_id = 7
    allgather = accel.Stream(name="allgather")
    if form == "pool_shard":
        shard = _pool_shard(param)
    else:
        with emu.shard_build(param):
            shard = param.ds_secondary_tensor = torch.empty(6)
            WRITE_FORMS[form](shard)
    event = accel.Event()
    event.record()  # after the write, on the writing stream
    if ordered:
        allgather.wait_event(event)
    got = read_on(allgather, shard)
    report = emu.report()
    accel.synchronize()
    expected = shard.clone()
    if ordered:
        assert report["races"] == 0 and torch.equal(got, expected)
    else:
        assert report["races"] == 1 and torch.all(got == POISON) and report["racy_params"] == [7]
    assert report["ops"]["deferred_write"] == {"default": 1}


def test_a_pool_shard_is_tracked_by_byte_range_not_the_whole_pool(accel):
    param = torch.nn.Parameter(DATA.clone(), requires_grad=False)
    shard = _pool_shard(param)
    param._pool[:6].copy_(DATA)  # the pool outside the shard: not shard memory, runs at once
    assert emu.report()["ops"]["deferred_write"] == {"default": 1}
    outside, inside = read_on(accel.Stream(), param._pool[:6]), read_on(accel.Stream(), shard)
    assert emu.report()["races"] == 1  # the shard read only
    # (Compared only now: torch.equal is a host sync of the writing stream.)
    assert torch.equal(outside, DATA) and torch.all(inside == POISON)


def test_a_write_into_shard_and_other_memory_at_once_is_refused_naming_the_op(accel):
    shard, other = fresh_shard(), torch.empty(6)
    with pytest.raises(emu.EmulatorError, match="_foreach_copy_.*does not model it"):
        torch._foreach_copy_([shard, other], [DATA, DATA])
