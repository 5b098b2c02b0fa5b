"""Activation checkpointing and the SFT loss reduction, end to end: 4 CPU ranks (2 emulated nodes of 2, hpZ 2),
real DeepSpeed ZeRO-3, every run through the real Trainer. All runs share ONE launch (tests/workers/train_variants.py).

* ``train.activation_checkpointing``: the same losses, bitwise (train and validation, across a resume), as without
  it, and the recompute really gathers parameters from the hpZ node-local shards (more shard reads per step).
* ``train.param_fetch``: ``layer`` (the default) gathers a decoder layer in one all-gather, with the losses of
  ``module`` (DeepSpeed's per-submodule fetch, the control), which issues several times the all-gathers.
* ``train.loss_reduction``: with gradient accumulation 2 (micro-batch 1) the ``token`` mode gives the losses of the
  same global batch taken in one micro-batch of 2 per rank (hence of one big batch: the loader guarantees the same
  global samples), step after step (i.e. the same gradients too); ``micro_batch`` mode does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.launcher import PYTHON, run, torchrun

STEPS = 4
PRETRAIN = ["recipe=tiny_llama", f"train.steps={STEPS}", "train.log_interval=1", "train.seq_len=64",
            "train.micro_batch_size=2", "train.grad_accum=2", "train.eval_interval=2", "train.eval_batches=2",
            "schedule.warmup_steps=0", "optim.lr=3e-3", "checkpoint.interval=0", "wandb.enabled=false"]
SFT = ["recipe=tiny_llama", "data.kind=sft", "data.packing=false", "train.steps=3", "train.log_interval=1",
       "train.seq_len=64", "train.eval_interval=0", "schedule.warmup_steps=0", "optim.lr=3e-3",
       "checkpoint.interval=0", "checkpoint.save_final=false", "wandb.enabled=false"]
SPLITS = {"micro2": ["train.micro_batch_size=2", "train.grad_accum=1"],
          "accum2": ["train.micro_batch_size=1", "train.grad_accum=2"]}


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def curve(run_dir: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in records(run_dir) if key in r}


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory, shakespeare) -> Path:
    """Examples whose responses run from 1 to ~40 tokens: micro-batches with very different trained-token counts."""
    root = tmp_path_factory.mktemp("sft_skewed")
    rows = [{"prompt": f"Tell me about line {i}.", "response": "To be, or not to be. " * (1 + (i * 7) % 9)}
            for i in range(64)]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run([PYTHON, "data/prepare.py", f"input={root / 'sft.jsonl'}", f"output={root / 'out'}", "kind=sft",
         f"tokenizer={shakespeare}", "valid_fraction=0", "progress=false"], timeout=120)
    return root / "out"


@pytest.fixture(scope="module")
def variants(tmp_path_factory, shakespeare, sft_data) -> Path:
    out = tmp_path_factory.mktemp("variants")
    pretrain = [*PRETRAIN, f"data.train.0.path={shakespeare}", f"run.output_dir={out}"]
    plain = [*pretrain, "run.name=plain", "comm.accounting=true"]  # train.param_fetch=layer, the default
    ckpt = [*plain, "run.name=ckpt", "train.activation_checkpointing=true", "train.exit_interval=2"]
    module = [*plain, "run.name=fetch-module", "train.param_fetch=module"]
    ckpt_module = [*module, "run.name=ckpt-module", "train.activation_checkpointing=true"]
    runs = [plain, ckpt, ckpt, module, ckpt_module]  # the second ckpt launch resumes at step 2
    sft = [*SFT, f"data.train.0.path={sft_data}", f"run.output_dir={out}"]
    for reduction in ("token", "micro_batch"):
        for split, keys in SPLITS.items():
            runs.append([*sft, f"run.name=sft-{reduction}-{split}", f"train.loss_reduction={reduction}", *keys])
    torchrun(4, "tests/workers/train_variants.py", *(" ".join(r) for r in runs), timeout=1200)
    return out


def test_activation_checkpointing_gives_bitwise_the_same_losses_under_hpz_across_resume_and_validation(variants):
    plain, ckpt = variants / "plain", variants / "ckpt"
    assert sorted(curve(ckpt)) == list(range(1, STEPS + 1))
    assert curve(ckpt) == curve(plain)  # the same floats at every step: the recompute is deterministic
    assert curve(ckpt, "val/loss") == curve(plain, "val/loss") and len(curve(plain, "val/loss")) == 2


def test_the_recompute_reads_the_hpz_node_local_shards(variants):
    """Per-module fetch: the recompute re-gathers every submodule in backward, from the secondary (hpZ) shards.
    Layer fetch (the default): the layer is gathered once for its backward, recompute included, as without
    checkpointing (step 1 differs: DeepSpeed records the module order then)."""
    by_run = {name: {r["step"]: r for r in records(variants / name) if "loss" in r}
              for name in ("plain", "ckpt", "fetch-module", "ckpt-module")}
    for step in range(1, STEPS + 1):
        for r in (by_run[name][step] for name in by_run):
            assert r["hpz/shards_read"] > 0 and r["hpz/host_syncs"] == 0
        assert by_run["ckpt-module"][step]["hpz/shards_read"] > by_run["fetch-module"][step]["hpz/shards_read"]
        assert (by_run["ckpt-module"][step]["comm/all_gather/calls"]
                > by_run["fetch-module"][step]["comm/all_gather/calls"]), step
    for step in (2, 4):
        for key in ("hpz/shards_read", "comm/all_gather/calls"):
            assert by_run["ckpt"][step][key] == by_run["plain"][step][key], (step, key)


def test_layer_fetch_gathers_each_layer_at_once_with_the_losses_of_per_module_fetch(variants):
    layer = {r["step"]: r for r in records(variants / "plain") if "loss" in r}
    module = {r["step"]: r for r in records(variants / "fetch-module") if "loss" in r}
    assert sorted(layer) == sorted(module) == list(range(1, STEPS + 1))
    for step in layer:
        # The same arithmetic; only the gradient buckets' summation order may differ (measured: ~1e-7 relative).
        assert layer[step]["loss"] == pytest.approx(module[step]["loss"], rel=1e-5), step
        # One all-gather per decoder layer instead of one per Linear and norm (the control: DeepSpeed's default),
        # forward and backward (the backward one from the hpZ shards, in both).
        gathers_layer, gathers_module = layer[step]["comm/all_gather/calls"], module[step]["comm/all_gather/calls"]
        assert 0 < 3 * gathers_layer < gathers_module, (step, gathers_layer, gathers_module)
        for r in (layer[step], module[step]):
            assert r["hpz/shards_read"] > 0 and r["hpz/host_syncs"] == 0
    assert curve(variants / "plain", "val/loss") == pytest.approx(curve(variants / "fetch-module", "val/loss"),
                                                                   rel=1e-5)


def test_token_loss_reduction_does_not_depend_on_how_the_batch_is_split(variants):
    micro2, accum2 = curve(variants / "sft-token-micro2"), curve(variants / "sft-token-accum2")
    assert sorted(micro2) == sorted(accum2) == [1, 2, 3]
    for step in micro2:  # step 1: the loss; steps 2-3: after updates with the same gradients
        assert accum2[step] == pytest.approx(micro2[step], rel=1e-5, abs=0), step


def test_micro_batch_loss_reduction_depends_on_the_split_negative_control(variants):
    micro2, accum2 = curve(variants / "sft-micro_batch-micro2"), curve(variants / "sft-micro_batch-accum2")
    token = curve(variants / "sft-token-micro2")
    token_accum2 = curve(variants / "sft-token-accum2")
    # Each micro-batch's own mean weighs the tokens of short examples more; how much depends on the split. Measured:
    # ~1e-2 apart after one update (token mode: ~1e-7), 1.5e-3 on the first loss.
    split_gap = max(abs(accum2[step] - micro2[step]) for step in (2, 3))
    token_gap = max(abs(token_accum2[step] - token[step]) for step in (1, 2, 3))
    assert split_gap > 5e-3 and split_gap > 1000 * token_gap, (split_gap, token_gap)
    assert abs(accum2[1] - micro2[1]) > 5e-4
    assert abs(accum2[1] - token[1]) > 1e-3  # and neither split gives the token mean
