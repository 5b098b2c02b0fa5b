"""What a checkpoint's CRC32 costs: saving one rank's optimizer shard with and without the checksumming writer,
and verifying it on resume, extrapolated to Llama-2-7B.

    .venv/bin/python benchmarks/checkpoint_checksum.py [--gib 1.0] [--repeats 3] [--dir /path/on/the/checkpoint/fs]

A ZeRO-3 checkpoint is almost entirely the optimizer states: per parameter an fp32 master copy and Adam's two fp32
moments, 12 bytes, split evenly over the ranks (the model-state files hold only small placeholders). Llama-2-7B
(6.74e9 parameters) is 80.9 GB in all: 10.1 GB per rank on one 8-GPU node, 1.3 GB per rank on 8 nodes. The cost is
linear in bytes, so it is measured on a smaller shard and scaled. Measure on the file system the checkpoints go to
(``--dir``): the write itself usually dominates.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from zerotrain import durable

LLAMA2_7B_PARAMS = 6.74e9
BYTES_PER_PARAM = 12  # fp32 master + Adam exp_avg + exp_avg_sq


def shard(gib: float) -> dict:
    n = int(gib * 2**30 / 4 / 3)
    g = torch.Generator().manual_seed(0)
    return {"fp32_flat": torch.randn(n, generator=g), "exp_avg": torch.randn(n, generator=g),
            "exp_avg_sq": torch.rand(n, generator=g)}


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="shard size to measure (GiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="directory on the checkpoint file system (default: a temp dir)")
    args = parser.parse_args()
    state = shard(args.gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="zt-ckpt-bench-"))
    try:
        plain, summed, verify = [], [], []
        for i in range(args.repeats):
            path = work / f"plain{i}.pt"

            def save_plain():  # fsync-ed like every checkpoint file: a save is not done before the data is on disk
                torch.save(state, path, _use_new_zipfile_serialization=False)
                durable.fsync_path(path)

            plain.append(timed(save_plain))
            path.unlink()
            path = work / f"summed{i}.pt"

            def save_summed():
                with durable.checksummed_file(path) as f:
                    torch.save(state, f, _use_new_zipfile_serialization=False)

            summed.append(timed(save_summed))
            verify.append(timed(lambda: durable.file_crc32(path)))
            path.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    timings = (("torch.save + fsync", plain), ("checksummed save", summed), ("verify", verify))
    best = {name: min(v) for name, v in timings}
    gb = nbytes / 1e9
    per_rank = {"1 node x 8 GPUs": LLAMA2_7B_PARAMS * BYTES_PER_PARAM / 8 / 1e9,
                "8 nodes x 8 GPUs": LLAMA2_7B_PARAMS * BYTES_PER_PARAM / 64 / 1e9}
    print(f"shard of {gb:.2f} GB, best of {args.repeats}; Llama-2-7B per-rank shards: "
          + ", ".join(f"{k}: {v:.1f} GB" for k, v in per_rank.items()))
    print()
    print(f"| step | s for {gb:.2f} GB | GB/s | " + " | ".join(f"7B, {k} (s)" for k in per_rank) + " |")
    print("|---|---:|---:|" + "---:|" * len(per_rank))
    rows = dict(best)
    rows["checksum overhead on save"] = best["checksummed save"] - best["torch.save + fsync"]
    for name, seconds in rows.items():
        rate = f"{gb / seconds:.2f}" if seconds > 0 else "-"
        scaled = " | ".join(f"{seconds * v / gb:.1f}" for v in per_rank.values())
        print(f"| {name} | {seconds:.2f} | {rate} | {scaled} |")


if __name__ == "__main__":
    main()
