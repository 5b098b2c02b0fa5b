"""Worker: loss parity of plain ZeRO-3, stock, sync and ordered hpZ on tiny models.

Run under torchrun (4 ranks = 2 emulated nodes x 2, hpZ size 2, CPU accelerator, gloo).
Usage: worker_parity.py OUT.json STEPS KIND:DTYPE:MODE[:prefetch] [...]
  KIND in {llama, falcon}, DTYPE in {fp32, bf16}, MODE in {plain, stock, sync, ordered}.
Each configuration: same seed, same data, gradient accumulation 2, an evaluation
pass (engine.eval() + no_grad) half-way; losses of every rank and hpZ counters
are written to OUT.json.
"""

from __future__ import annotations

import sys
import time
import warnings

import _common as C
import torch

C.init_dist()
import deepspeed  # noqa: E402

from zerotrain import hpz  # noqa: E402


def run(kind: str, dtype: str, mode: str, steps: int, prefetch: bool = False) -> dict:
    """One configuration. ``prefetch``: a small prefetch bucket, so shards are also read by
    prefetching all-gathers issued ahead of the module that needs them."""
    bf16 = dtype == "bf16"
    t_build = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the loud 'stock' warning, once per config
        hpz.install(mode="ordered" if mode == "plain" else mode)
    extra = {"stage3_prefetch_bucket_size": 20000} if prefetch else {}
    cfg = C.ds_config(hpz=1 if mode == "plain" else 2, bf16=bf16, **extra)
    model = C.build_zero3_model(kind, cfg, seed=0, dtype=torch.bfloat16 if bf16 else torch.float32)
    if kind == "falcon":  # exercise a frozen parameter: its shard is never invalidated by DeepSpeed
        model.transformer.h[0].mlp.dense_h_to_4h.weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    hpz.reset_counters()
    build_seconds = time.time() - t_build
    reads_before_step1 = None
    t0 = time.time()

    def note_reads(step, micro):
        nonlocal reads_before_step1
        if step == 1 and micro == 0:
            reads_before_step1 = hpz.counters()["shards_read_backward"]

    losses = C.train(engine, steps, gas=2, eval_at=steps // 2, before_backward=note_reads)
    seconds = time.time() - t0
    counters = hpz.counters()
    return {
        "losses": C.all_gather_obj(losses),  # per rank
        "counters": counters,
        "active_mode": hpz.active_mode(),
        # Backward reads from step 1 on: shards rebuilt after step 0's invalidation really got used.
        "backward_shard_reads_after_step0": counters["shards_read_backward"] - (reads_before_step1 or 0),
        "seconds": round(seconds, 2),
        "build_seconds": round(build_seconds, 2),
    }


if __name__ == "__main__":
    out_path, steps, specs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    results = {}
    for spec in specs:
        kind, dtype, mode, *flags = spec.split(":")
        results[spec] = run(kind, dtype, mode, steps, prefetch="prefetch" in flags)
        C.write_json(out_path, results)
