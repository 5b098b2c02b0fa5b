"""GPU benchmark of zerotrain.hpz: the cost of the hpZ release path, and the race itself.

One GPU (``python benchmarks/hpz_release_path.py``): a Llama-2-7B-shaped layer
stack (hidden 4096, MLP 11008; --layers of them) goes through an emulated
backward pass: per layer, compute is enqueued on the compute stream, then the
layer is *released* -- every weight's hpZ secondary shard is built by
zerotrain.hpz's shard builder (hpZ group of --hpz ranks, this rank = 0) --
and the next layer's shards are read on a separate all-gather stream, as the
prefetching all-gather does. Modes ``sync`` (host waits after every shard
copy, = DeepSpeed >= 0.13.5) and ``ordered`` (ours: events + stream waits) are
timed: host stall in the release path per step, and step time. The gathered
bytes are checked against the source weights.

2+ GPUs (``torchrun --nproc_per_node N benchmarks/hpz_release_path.py``): a
small Llama trained with DeepSpeed ZeRO-3 + hpZ under ``stock`` and
``ordered``; prints both loss curves (stock may show 0/NaN: issue #5059).

Needs CUDA; exits with an error otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import torch


def die(msg: str) -> None:
    print(f"hpz_release_path.py: {msg}", file=sys.stderr)
    sys.exit(2)


def release_path(args) -> None:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from zerotrain import hpz
    from zerotrain.hpz import ordering

    dev = torch.device("cuda")
    dtype = torch.bfloat16
    shapes = [(4096, 4096)] * 4 + [(11008, 4096)] * 3 + [(4096, )] * 2  # q k v o, gate up down, 2 norms
    layers = []
    for _ in range(args.layers):
        params = []
        for shape in shapes:
            p = torch.nn.Parameter(torch.randn(shape, device=dev, dtype=dtype), requires_grad=False)
            p.ds_id, p.ds_numel = len(layers) * 100 + len(params), p.numel()
            params.append(p)
        layers.append(params)
    init = SimpleNamespace(_aligned_size=lambda p: -(-p.ds_numel // args.hpz) * args.hpz,
                           num_ranks_in_param_group=args.hpz, rank_in_group=0, remote_device=dev,
                           pin_memory=False, quantized_nontrainable_weights=False)
    x = torch.randn(args.tokens, 4096, device=dev, dtype=dtype)
    allgather = torch.cuda.Stream()

    def step():
        stall = 0.0
        gathered = []
        for i in reversed(range(len(layers))):
            for p in layers[i]:  # enqueue this layer's "backward" compute
                if p.dim() == 2:
                    torch.matmul(x[:, :p.shape[1]], p.t())
            t0 = time.perf_counter()
            for p in layers[i]:  # release: build secondary shards (drops the gathered weight in DeepSpeed)
                p.ds_status, p.ds_secondary_tensor = ZeroParamStatus.AVAILABLE, None
                ordering.build_secondary_shard(init, p)
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE
            stall += time.perf_counter() - t0
            readers = ordering.secondary_readers(layers[i])
            ordering.before_secondary_read(readers, allgather)
            with torch.cuda.stream(allgather):  # the all-gather reads the shards on its own stream
                gathered.append((readers, [p.ds_secondary_tensor.clone() for p in readers]))
        torch.cuda.current_stream().wait_stream(allgather)
        torch.cuda.synchronize()
        return stall, gathered

    rows = []
    for mode in ("sync", "ordered"):
        hpz.install(mode=mode)
        for _ in range(args.warmup):
            step()
        hpz.reset_counters()
        stalls, times = [], []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            stall, gathered = step()
            times.append(time.perf_counter() - t0)
            stalls.append(stall)
        ok = all(
            torch.equal(copy[:min(p.ds_numel, copy.numel())], p.detach().view(-1)[:min(p.ds_numel, copy.numel())])
            for readers, copies in gathered for p, copy in zip(readers, copies))
        c = hpz.counters()
        rows.append((mode, 1e3 * sum(stalls) / len(stalls), 1e3 * sum(times) / len(times), c["host_syncs"] //
                     args.steps, c["waits_issued"] // args.steps, ok))
    hpz.uninstall()
    print(f"\nLlama-2-7B-shaped stack: {args.layers} layers, hpZ {args.hpz}, {args.tokens} tokens, bf16, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'mode':8} {'host stall/step ms':>19} {'step ms':>9} {'host syncs/step':>16} {'waits/step':>11} "
          f"{'bytes ok':>9}")
    for mode, stall, t, syncs, waits, ok in rows:
        print(f"{mode:8} {stall:19.2f} {t:9.2f} {syncs:16d} {waits:11d} {str(ok):>9}")


def race(args) -> None:
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from zerotrain import hpz

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # before NCCL comes up
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
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hpz", type=int, default=8, help="hpZ group size (GPUs per node)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        die("needs CUDA GPUs (streams are what this measures; the CPU accelerator has none)")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        race(args)
    else:
        release_path(args)


if __name__ == "__main__":
    main()
