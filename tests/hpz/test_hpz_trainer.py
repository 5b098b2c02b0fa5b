"""A Hugging Face Trainer fine-tunes the tiny Llama with ZeRO-3 + hpZ 2 and zerotrain.hpz installed."""

from __future__ import annotations

from hpz_results import stage


def test_hf_trainer_with_hpz(hpz_suite):
    t = stage(hpz_suite, "trainer")
    assert t.get("ok", True), t.get("error")
    assert t["world_size"] == 4 and t["hpz_group_size"] == [2]
    assert t["active_mode"] == "ordered"
    assert t["global_step"] == 4 and t["counters"]["optimizer_steps"] == 4
    assert t["finite"] and len(t["losses"]) == 4
    c = t["counters"]
    assert c["shards_built"] > 0 and c["shards_read_backward"] > 0
    # The CPU accelerator orders work itself: ordered issues (and counts) no event, wait or host sync.
    assert c["device_ordered_copies"] == c["shard_copies"] > 0
    assert c["events_recorded"] == c["waits_issued"] == c["host_syncs"] == 0
