"""hpZ through DeepSpeed's real ZeRO-3 engine under the emulated asynchronous accelerator.

One 4-process launch (worker_emulator.py; 2 emulated nodes x 2 ranks, hpZ 2, gloo):
tiny Llama and Falcon, fp32 and bf16, 4 optimizer steps (6 with HPZ_MATRIX_FULL=1) of 2
accumulated micro-batches with an evaluation pass half-way. Under the emulator DeepSpeed
takes its GPU stream code paths and shard copies are really deferred, so -- unlike
on the CPU accelerator (test_hpz_parity.py) -- the racy modes race and the fixes
are observed to order the race away:

* ``stock`` and ``legacy``: races on every rank, training differs from plain ZeRO-3;
* ``sync``, ``ordered`` and DeepSpeed's own builder: no race, losses bitwise equal
  to plain ZeRO-3; ``ordered`` waits on the all-gather stream without host syncs;
* broken variants of ``ordered`` are caught (negative controls);
* the leaf-module fast path: ``ordered`` keeps the copy source alive, as ``sync`` does.
"""

from __future__ import annotations

import math

import pytest
from hpz_results import emulated_run as run
from hpz_results import races

MODELS = [(k, d) for k in ("llama", "falcon") for d in ("fp32", "bf16")]
CONTROLS = ("event_before_copy", "event_wrong_stream", "skip_one_wait")


def differs_from(r: dict, reference: dict) -> bool:
    return r["losses"] != reference["losses"] or any(r["skipped_steps"])


def test_launch_ran_every_configuration(hpz_emulated):
    assert hpz_emulated.get("complete"), hpz_emulated.get("output_tail")
    expected = {f"{k}:{d}:{arm}" for k, d in MODELS for arm in ("plain", "legacy", "stock", "sync", "ordered",
                                                                 "deepspeed")}
    expected |= {f"llama:fp32:ordered:{c}" for c in CONTROLS}
    expected |= {f"llama:fp32:{arm}:leaf" for arm in ("sync", "ordered", "ordered_unprotected")}
    assert expected <= set(hpz_emulated["runs"])
    for kind, dtype in MODELS:
        plain = run(hpz_emulated, f"{kind}:{dtype}:plain")
        assert len(plain["losses"]) == 4 and len(plain["losses"][0]["train"]) == 2 * hpz_emulated["steps"]
        assert all(math.isfinite(x) for rank in plain["losses"] for x in rank["train"] + rank["eval"])


@pytest.mark.parametrize("kind,dtype", MODELS)
@pytest.mark.parametrize("arm", ["stock", "legacy"])
def test_racy_modes_race_on_every_rank_and_train_differently_from_plain(hpz_emulated, kind, dtype, arm):
    r, plain = run(hpz_emulated, f"{kind}:{dtype}:{arm}"), run(hpz_emulated, f"{kind}:{dtype}:plain")
    assert all(n > 0 for n in races(r)), f"races per rank: {races(r)}"
    assert all(set(e["races_by_stream"]) == {r["streams"]["allgather"]} for e in r["emulator"])
    assert all("wait_event" not in e["ops"] for e in r["emulator"])  # nothing ordered the reads
    # Shards built in forward are read by the backward all-gather (Falcon's tied embedding also races in
    # forward: the lm_head gathers the shard the embedding's release has just built).
    assert all(any("backward" in where for where in e["races_by_where"]) for e in r["emulator"])
    assert differs_from(r, plain), "the race never reached a recorded loss: run more steps"


@pytest.mark.parametrize("kind,dtype", MODELS)
@pytest.mark.parametrize("arm", ["sync", "ordered", "deepspeed"])
def test_fixed_modes_and_deepspeeds_builder_have_no_race_and_match_plain_bitwise(hpz_emulated, kind, dtype, arm):
    r, plain = run(hpz_emulated, f"{kind}:{dtype}:{arm}"), run(hpz_emulated, f"{kind}:{dtype}:plain")
    assert races(r) == [0, 0, 0, 0] and all(e["freed_source_races"] == 0 for e in r["emulator"])
    assert all(e["ops"]["deferred_write"] for e in r["emulator"])  # shards were built, their copies deferred
    assert r["losses"] == plain["losses"] and r["skipped_steps"] == [0, 0, 0, 0]  # exact, every rank, train + eval
    if arm != "deepspeed":
        assert all(c["shards_read_backward"] > 0 for c in r["counters"])


@pytest.mark.parametrize("kind,dtype", MODELS)
def test_ordered_waits_on_the_allgather_stream_and_never_stalls_the_host(hpz_emulated, kind, dtype):
    r = run(hpz_emulated, f"{kind}:{dtype}:ordered")
    allgather = r["streams"]["allgather"]
    for c, e in zip(r["counters"], r["emulator"]):
        assert c["waits_issued"] > 0 and e["ops"]["wait_event"][allgather] == c["waits_issued"]
        assert c["host_syncs"] == 0 and "host_wait_in_shard_build" not in e["ops"]
        assert c["events_recorded"] == c["shard_copies"] > 0


@pytest.mark.parametrize("kind,dtype", MODELS)
@pytest.mark.parametrize("arm", ["sync", "deepspeed"])
def test_sync_and_deepspeeds_builder_stall_the_host_after_every_shard_copy(hpz_emulated, kind, dtype, arm):
    r = run(hpz_emulated, f"{kind}:{dtype}:{arm}")
    for c, e in zip(r["counters"], r["emulator"]):
        host_waits = sum(e["ops"]["host_wait_in_shard_build"].values())
        assert host_waits == sum(e["ops"]["poisoned_allocation"].values()) > 0  # one per (fresh) shard built
        if arm == "sync":
            assert host_waits == c["host_syncs"] == c["shard_copies"] > 0


@pytest.mark.parametrize("control", CONTROLS)
def test_each_broken_ordered_variant_is_caught_on_every_rank(hpz_emulated, control):
    r = run(hpz_emulated, f"llama:fp32:ordered:{control}")
    assert all(n > 0 for n in races(r)), f"{control} not caught: races per rank {races(r)}"


def test_leaf_fast_path_ordered_keeps_the_copy_source_alive_like_sync(hpz_emulated):
    plain = run(hpz_emulated, "llama:fp32:plain")  # the fast path does not change plain ZeRO-3's losses
    for arm in ("sync", "ordered"):
        r = run(hpz_emulated, f"llama:fp32:{arm}:leaf")
        assert races(r) == [0, 0, 0, 0] and [e["freed_source_races"] for e in r["emulator"]] == [0, 0, 0, 0], arm
        assert r["losses"] == plain["losses"], arm
    assert all(c["source_record_streams"] > 0 for c in run(hpz_emulated, "llama:fp32:ordered:leaf")["counters"])
    broken = run(hpz_emulated, "llama:fp32:ordered_unprotected:leaf")  # negative control: no source record_stream
    assert all(e["freed_source_races"] > 0 for e in broken["emulator"])


def test_deepspeed_takes_its_gpu_stream_branches_under_the_emulator(hpz_emulated):
    """The branch points listed in docs/hpz.md ran as on CUDA (counted by the emulator, every rank)."""
    r = run(hpz_emulated, "llama:fp32:ordered")
    names = r["streams"]
    default, allgather, reduce = names["default"], names["allgather"], names["reduce"]
    assert allgather and reduce and len({default, allgather, reduce}) == 3  # two streams of its own
    for e in r["emulator"]:
        ops = e["ops"]
        assert ops["record_event"][allgather] > 0  # coordinator: fetch events (no memory backpressure)
        assert ops["wait_stream"][f"{default}<-{allgather}"] > 0  # coordinator: compute waits for the gather
        assert ops["wait_stream"][f"{reduce}<-{default}"] > 0  # stage3: reduction waits for the gradients
        assert ops["record_event"][reduce] > 0  # stage3: reduce events
        assert ops["record_stream"][default] > 0 and ops["record_stream"][reduce] > 0  # free_param, grads
        assert ops["stream_synchronize"][reduce] > 0  # stage3: epilogue waits for the reduce stream
        assert ops["device_synchronize"]["all"] > 0  # throughput timer
