#!/usr/bin/env python
"""Score a checkpoint on MMLU: a Hugging Face export, or a training run directory (exported once).

    python evaluation/mmlu.py --checkpoint runs/tiny-llama --data data/mmlu/test.jsonl --output mmlu.json
    torchrun --nproc_per_node 8 evaluation/mmlu.py --checkpoint /models/Llama-2-7b-hf --data cais/mmlu

Under torchrun every rank loads the whole model and scores a share of the
questions; the result is identical to a one-process run. Rank 0 writes the JSON
report and prints the table. See evaluation/README.md.

A model no single device holds (Llama-2-70B: 140 GB in bf16) is partitioned over
the ranks with DeepSpeed ZeRO-3 instead, each rank holding 1/N of every weight:

    torchrun --nproc_per_node 8 evaluation/mmlu.py --zero3 --dtype bf16 --checkpoint /models/Llama-2-70b-hf
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from zerotrain import distributed
from zerotrain.data.tokenizer import TransformersTokenizer
from zerotrain.evaluation import (
    EvaluationError,
    evaluate,
    format_table,
    load_hf_export,
    load_mmlu,
    model_max_length,
    resolve_checkpoint,
)
from zerotrain.evaluation.zero3_inference import Zero3Model, export_dtype

logger = logging.getLogger("evaluation.mmlu")
DTYPES = {"auto": "auto", "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="HF export dir (config.json, *.safetensors, tokenizer), or a zerotrain run or checkpoint "
                        "dir (its checkpoint is exported once, into <checkpoint>/hf)")
    p.add_argument("--data", default="cais/mmlu",
                   help="cais/mmlu (hub), a .jsonl/.parquet file, a Hendrycks CSV dir, or a save_to_disk dir")
    p.add_argument("--subjects", nargs="+", default=None, help="subjects to score (default: all)")
    p.add_argument("--limit-per-subject", type=int, default=None, help="score only the first N per subject")
    p.add_argument("--shots", type=int, default=5)
    p.add_argument("--split", default="test", help="evaluation split (test or validation)")
    p.add_argument("--no-dev-split", choices=("holdout", "error"), default="holdout",
                   help="without a dev split: hold out the first --shots questions per subject as "
                        "few-shot examples (default), or fail")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass per process")
    p.add_argument("--max-length", type=int, default=None, help="context length (default: from config)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    p.add_argument("--bos", choices=("auto", "yes", "no"), default="auto",
                   help="prepend BOS to every prompt: auto = as the tokenizer does by default")
    p.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK if available, else cpu")
    p.add_argument("--zero3", action="store_true",
                   help="partition the weights over the ranks with DeepSpeed ZeRO-3 (rank 0 reads the files), for "
                        "models one device cannot hold; same scores as without. The device is DeepSpeed's "
                        "accelerator (--device is not used)")
    p.add_argument("--output", type=Path, default=None, help="JSON report path")
    p.add_argument("--no-per-question", action="store_true", help="leave per-question scores out of the JSON")
    return p.parse_args(argv)


def setup_distributed(device_arg: str | None) -> tuple[int, torch.device]:
    """(rank, device); joins the process group (nccl on GPUs, else gloo) under torchrun."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_arg:
        device = torch.device(device_arg)
    else:
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return (dist.get_rank() if dist.is_initialized() else 0), device


def load_partitioned(checkpoint: str, dtype_name: str) -> tuple[Zero3Model, object, torch.device]:
    """(the ZeRO-3 holder of the model, its tokenizer, the device to evaluate on), on every rank."""
    from deepspeed.accelerator import get_accelerator
    from transformers import AutoTokenizer

    export = resolve_checkpoint(checkpoint)
    dtype = export_dtype(export) if dtype_name == "auto" else DTYPES[dtype_name]
    holder = Zero3Model(export, dtype)
    logger.info("ZeRO-3: %s partitioned over %d ranks (%.1f%% of the weights on each), %s",
                export, dist.get_world_size(), 100 * holder.local_fraction, dtype)
    return holder, AutoTokenizer.from_pretrained(export), torch.device(get_accelerator().current_device_name())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.zero3:
        rank, device = distributed.init().rank, None  # DeepSpeed's process group; the device comes with the model
    else:
        rank, device = setup_distributed(args.device)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        data = load_mmlu(args.data, subjects=args.subjects, limit_per_subject=args.limit_per_subject,
                         shots=args.shots, eval_split=args.split, no_dev_split=args.no_dev_split)
        if args.zero3:
            holder, tokenizer, device = load_partitioned(args.checkpoint, args.dtype)
            model = holder.model
        else:
            model, tokenizer = load_hf_export(args.checkpoint, dtype=DTYPES[args.dtype], device=device)
        max_length = args.max_length or model_max_length(model)
        logger.info("%d questions, %d subjects, %d-shot, max_length %d, batch %d",
                    len(data.questions), len(data.subjects), args.shots, max_length, args.batch_size)
        add_bos = {"auto": None, "yes": True, "no": False}[args.bos]
        result = evaluate(model, TransformersTokenizer(tokenizer, add_bos=add_bos), data,
                          batch_size=args.batch_size, max_length=max_length, device=device,
                          progress=True)
    except EvaluationError as e:
        logger.error("%s: %s", type(e).__name__, e)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        report = {"checkpoint": str(args.checkpoint), "max_length": max_length,
                  **result.to_dict(per_question=not args.no_per_question)}
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(report, indent=2))
            logger.info("report written to %s", args.output)
        print(format_table(result))
    return 0


if __name__ == "__main__":
    from zerotrain.launch.teardown import exit_with

    exit_with(main)  # as train.py: no C++ teardown after the outcome
