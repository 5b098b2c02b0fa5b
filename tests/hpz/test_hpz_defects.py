"""hpZ defects: each is reproduced in the same launch with its fix disabled, then shown fixed.

The "unfixed" runs use ``hpz.install(disable_fixes=(...))``, i.e. DeepSpeed's
own code for that defect, so these tests also prove each test would fail
without its fix.
"""

from __future__ import annotations

import math

from hpz_results import stage


def test_eval_only_engine_with_hpz(hpz_suite):
    broken = stage(hpz_suite, "defects", "eval_engine_unfixed")
    assert broken["ok"] is False and "_set_zero_group_parallelism" in broken["error"]
    fixed = stage(hpz_suite, "defects", "eval_engine_fixed")
    assert fixed["ok"], fixed.get("error")
    assert fixed["group_size"] == [4] and fixed["has_hpz_group"] == [True]
    assert all(math.isfinite(x) for x in fixed["losses"])
    assert fixed["counters"]["shards_read"] > 0  # evaluation reads hpZ shards too


def test_each_engine_gets_its_configured_hpz_size(hpz_suite):
    broken = stage(hpz_suite, "defects", "groups_unfixed")
    # DeepSpeed: a later engine silently inherits the first group (or zero.Init asserts).
    assert broken["second_hpz1_plain"]["ok"] and broken["second_hpz1_plain"]["group_size"] == [2]
    assert broken["third_hpz4_plain"]["ok"] and broken["third_hpz4_plain"]["group_size"] == [2]
    assert "already initialized" in broken["fourth_hpz4_zero_init"]["error"]

    fixed = stage(hpz_suite, "defects", "groups_fixed")
    expected = {
        "first_hpz2_zero_init": ([2], [True]),
        "second_hpz1_plain": ([4], [False]),  # hpZ off: the shard group is the whole partition group
        "third_hpz4_plain": ([4], [True]),
        "fourth_hpz4_zero_init": ([4], [True]),
    }
    for name, (size, has_group) in expected.items():
        assert fixed[name]["ok"], f"{name}: {fixed[name].get('error')}"
        assert (fixed[name]["group_size"], fixed[name]["has_hpz_group"]) == (size, has_group), name


def test_frozen_shards_not_stale_after_load_checkpoint(hpz_suite):
    broken = stage(hpz_suite, "defects", "stale_unfixed")
    assert broken["ok"], broken.get("error")
    assert set(broken["stale_after_load"]) == {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"}
    assert broken["resumed"] != broken["reference"]  # resuming trains on the wrong frozen weights

    fixed = stage(hpz_suite, "defects", "stale_fixed")
    assert fixed["ok"], fixed.get("error")
    assert fixed["stale_after_load"] == []
    assert fixed["resumed"] == fixed["reference"]  # bitwise: resume == uninterrupted run


def test_shards_consistent_after_resize_token_embeddings(hpz_suite):
    # Regression guard: in DeepSpeed 0.19.8 the HF resize path re-partitions with
    # has_been_updated=True, so the unfixed run is consistent too (see docs/hpz.md).
    for name in ("resize_unfixed", "resize_fixed"):
        result = stage(hpz_suite, "defects", name)
        assert result["ok"], f"{name}: {result.get('error')}"
        assert result["stale_before_init"] == [] and result["stale_after_init"] == [], name
    assert stage(hpz_suite, "defects", "resize_fixed")["invalidated"] > 0


def test_verify_off_costs_no_collectives_and_verify_on_only_checksums(hpz_suite):
    v = stage(hpz_suite, "defects", "verify")
    off, on, none = v["verify_off"], v["verify_on"], v["uninstalled"]
    assert off["collectives"] == none["collectives"]
    assert off["counters"]["verify_checks"] == 0 and off["counters"]["verify_collectives"] == 0
    assert on["counters"]["verify_checks"] > 0
    assert on["collectives"] == off["collectives"] + on["counters"]["verify_collectives"]
    assert none["losses"] == off["losses"] == on["losses"]


def test_verify_names_corrupted_shard_param_rank_and_step(hpz_suite):
    c = stage(hpz_suite, "defects", "verify")["corrupted"]
    assert c["raised"] and c["type"] == "HpzVerificationError"
    msg = c["message"]
    assert f"ds_id={c['ds_id']}" in msg and c["name"] in msg
    assert "on rank 1 " in msg and "at step 1" in msg
