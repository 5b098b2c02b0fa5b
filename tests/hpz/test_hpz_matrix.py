"""The option matrix's working rows (issue 17): every option with hpZ under the emulator, Llama and Falcon.

Read from the emulator launch (conftest.py's ``hpz_emulated``; the runs are worker_matrix.py's, 4 ranks = 2
emulated nodes x 2, hpZ 2, gloo). For each option and model:

* ``ordered``: no race on any rank, shard writes deferred (the emulator was at work), no skipped step, and every
  rank's training and evaluation losses bitwise equal to plain ZeRO-3 with the same option (``sync`` with the same
  option where plain ZeRO-3 cannot take it: hierarchical gradients need an hpZ group);
* ``stock``: races on every rank, and the race reaches training (losses differ or a step is skipped); Llama
  always, Falcon with ``HPZ_MATRIX_FULL=1`` (the suite's time budget);
* the option really was in effect (its evidence: clipping clipped, the loss scale moved, the weights came from the
  file, the resumed engine continued DeepSpeed's step count, ...).

The refused rows are tests/hpz/test_hpz_options.py's; docs/hpz.md's table is benchmarks/hpz_matrix.py's.
"""

from __future__ import annotations

import math

import pytest
import worker_matrix as M
from hpz_results import emulated_run, races

ROWS = [(option, kind) for option in M.OPTIONS for kind in M.KINDS]


def run(results: dict, option: str, kind: str, arm: str) -> dict:
    return emulated_run(results, f"matrix:{option}:{kind}:{arm}")


def test_every_matrix_run_is_in_the_launch(hpz_emulated):
    assert set(M.specs()) <= set(hpz_emulated["runs"]), sorted(set(M.specs()) - set(hpz_emulated["runs"]))


@pytest.mark.parametrize("option,kind", ROWS)
def test_ordered_has_no_race_and_matches_the_reference_bitwise(hpz_emulated, option, kind):
    r = run(hpz_emulated, option, kind, "ordered")
    ref = run(hpz_emulated, option, kind, M.REFERENCE_ARM.get(option, "plain"))
    assert races(r) == [0, 0, 0, 0] and [e["freed_source_races"] for e in r["emulator"]] == [0, 0, 0, 0]
    assert all(e["ops"]["deferred_write"] for e in r["emulator"])  # shards were built and their copies deferred
    assert all(c["shards_read_backward"] > 0 for c in r["counters"])  # and read by the backward all-gather
    assert r["losses"] == ref["losses"] and r["skipped_steps"] == ref["skipped_steps"] == [0, 0, 0, 0]
    assert all(math.isfinite(x) for rank in ref["losses"] for x in rank["train"] + rank["eval"])
    assert all(rank["eval"] for rank in r["losses"])  # the validation pass ran (eval() + no_grad)


@pytest.mark.parametrize("option,kind", ROWS)
def test_stock_races_on_every_rank_and_the_race_reaches_training(hpz_emulated, option, kind):
    if f"matrix:{option}:{kind}:stock" not in M.specs() and f"matrix:{option}:{kind}:stock" not in \
            hpz_emulated["runs"]:
        pytest.skip("Falcon's stock arms run with HPZ_MATRIX_FULL=1 (worker_matrix.specs)")
    r = run(hpz_emulated, option, kind, "stock")
    ref = run(hpz_emulated, option, kind, M.REFERENCE_ARM.get(option, "plain"))
    assert all(n > 0 for n in races(r)), f"races per rank: {races(r)}"
    assert r["losses"] != ref["losses"] or any(r["skipped_steps"])


@pytest.mark.parametrize("kind", M.KINDS)
def test_each_option_was_in_effect(hpz_emulated, kind):
    def evidence(option, arm="ordered"):
        return run(hpz_emulated, option, kind, arm)["evidence"]

    for arm in ("plain", "ordered"):
        assert all(e["offload_optimizer"] for e in evidence("offload_optimizer", arm))
        # dynamic scaling moved the scale (from 2**12) and both arms ended on the same one
        assert {e["loss_scale"] for e in evidence("fp16_dynamic", arm)} != {2.0 ** 12}
        assert all(e["grad_norm"] > e["clip"] for e in evidence("clip_grad_accum", arm))  # every step clipped
        assert all(e["loaded_weights_match_file"] for e in evidence("pretrained_load", arm))
        assert all(e["global_steps_after_load"] == M.STEPS for e in evidence("resume", arm))
    assert evidence("fp16_dynamic") == evidence("fp16_dynamic", "plain")
    assert evidence("mmlu_hook") == evidence("mmlu_hook", "plain")  # the same log-likelihoods, every rank
    assert all(e["frozen_has_secondary_shard"] for e in evidence("frozen_embeddings"))  # the frozen shard is read
    assert all(e["hierarchical_grad_reduces"] > 0 for e in evidence("grad_reduce_hierarchical"))
    assert all(e["hierarchical_grad_reduces"] > 0 for e in evidence("grad_reduce_hierarchical", "sync"))
    # Layer fetch: an all-gather reads a whole layer's shards; per-module fetch (every other row; the offload one is
    # the control) one module's weight (and bias: Falcon's norms have one).
    per_layer = [e["shards_per_gather"] for e in evidence("layer_fetch")]
    per_module = [e["shards_per_gather"] for e in evidence("offload_optimizer")]
    assert 1 <= max(per_module) <= 2 and min(per_layer) > 2 * max(per_module), (per_layer, per_module)
