"""GPU benchmark of zerotrain.hpz: the cost of the hpZ release path, and the race in training.

One GPU (``python benchmarks/hpz_release_path.py``): the ``stall`` section of
``benchmarks/gpu_check.py`` -- host stall in the release path and step time of
8 Llama-2-7B-shaped layers under ``sync``, ``ordered`` and DeepSpeed's own
builder, through DeepSpeed's real ZeRO-3 coordinator (one table, JSON in
``runs/hpz_release_path.json``). ``gpu_check.py`` runs it with the race checks
and a training-step benchmark.

2+ GPUs (``torchrun --nproc_per_node N benchmarks/hpz_release_path.py``): a
small Llama trained with DeepSpeed ZeRO-3 + hpZ under ``stock`` and
``ordered``; prints both loss curves (stock may show 0/NaN: issue #5059).

Needs CUDA; exits with an error otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def die(msg: str) -> None:
    print(f"hpz_release_path.py: {msg}", file=sys.stderr)
    sys.exit(2)


def race(args) -> None:
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from zerotrain import hpz

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # before NCCL comes up
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    hpz_size = args.hpz if world % args.hpz == 0 and args.hpz <= world else world
    cfg = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": hpz_size, "stage3_prefetch_bucket_size": 0,
                              "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0},
    }
    model_cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2752, num_hidden_layers=8,
                            num_attention_heads=16, max_position_embeddings=512)
    g = torch.Generator().manual_seed(1000 + rank)
    data = [torch.randint(0, 32000, (4, 256), generator=g).cuda() for _ in range(args.steps)]
    curves = {}
    for mode in ("stock", "ordered"):
        hpz.install(mode=mode)
        keep = HfDeepSpeedConfig(cfg)
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(model_cfg, dtype=torch.bfloat16)
        del keep
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        losses = []
        for x in data:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.float().item())
        curves[mode] = losses
        engine.destroy()
    if rank == 0:
        print(f"\nZeRO-3 + hpZ {hpz_size} on {world} GPUs, stock vs ordered (rank 0 losses)")
        print(f"{'step':>4} {'stock':>10} {'ordered':>10}")
        for i, (a, b) in enumerate(zip(curves["stock"], curves["ordered"])):
            print(f"{i:4d} {a:10.4f} {b:10.4f}{'   <-- differs' if a != b else ''}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hpz", type=int, default=8, help="2+ GPUs: hpZ group size (GPUs per node)")
    ap.add_argument("--steps", type=int, default=10, help="2+ GPUs: training steps per mode")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        die("needs CUDA GPUs (streams are what this measures; the CPU accelerator has none)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        race(args)
    else:
        import gpu_check
        sys.exit(gpu_check.main(["--sections", "stall", "--json", "runs/hpz_release_path.json"]))


if __name__ == "__main__":
    main()
