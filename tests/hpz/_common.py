"""Shared helpers for the multi-process hpZ workers (run under torchrun, CPU accelerator, gloo).

Builds tiny Hugging Face models under ZeRO-3, runs short deterministic
training loops, and offers an oracle that checks every secondary shard
against the primary partitions by gathering the primaries directly.
"""

from __future__ import annotations

import gc
import json
import os
from typing import Any, Callable, Dict, List, Optional

import torch

WORLD_HPZ = 2  # 4 ranks = 2 emulated nodes of 2


def init_dist() -> None:
    import deepspeed

    from zerotrain import ds_patches
    ds_patches.defer_import_time_compile()  # as the trainer's engine build does (2 CPU s a process)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")


def freeze_survivors() -> None:
    """Collect the last run's garbage, then exempt what survives from later collections (``gc.freeze``).

    DeepSpeed's ZeRO-3 optimizer runs a full ``gc.collect()`` in every engine build (``zero.utils.defragment``),
    which walks every object of the process (0.24 CPU-s with only torch, transformers, DeepSpeed and zerotrain.hpz
    imported, more once engines have run), per rank and build: 80 builds in the emulator launch. Called between
    runs, it leaves those collections the objects made since (one run's engine); what it freezes is alive at that
    moment (modules, caches, results), not garbage.
    """
    gc.collect()
    gc.freeze()


def rank() -> int:
    return torch.distributed.get_rank()


def ds_config(hpz: int = WORLD_HPZ, bf16: bool = False, gas: int = 2, micro: int = 2, optimizer: bool = False,
              **zero_extra: Any) -> Dict[str, Any]:
    zero = {
        "stage": 3,
        "zero_hpz_partition_size": hpz,
        # Small models otherwise stay fully gathered and hpZ shards are never read.
        "stage3_prefetch_bucket_size": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_param_persistence_threshold": 0,
    }
    zero.update(zero_extra)
    cfg: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
    }
    if optimizer:  # DeepSpeed-built optimizer; torch_adam avoids the FusedAdam JIT build
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    return cfg


def model_config(kind: str):
    if kind == "llama":
        from transformers import LlamaConfig
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "falcon":
        from transformers import FalconConfig
        return FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=64)
    raise ValueError(kind)


def model_class(kind: str):
    # Import before zero.Init is entered (the brief's trap: lazy imports under Init misbehave).
    if kind == "llama":
        from transformers import LlamaForCausalLM
        return LlamaForCausalLM
    from transformers import FalconForCausalLM
    return FalconForCausalLM


def build_zero3_model(kind: str, cfg: Dict[str, Any], seed: int = 0, dtype=torch.float32):
    """Build under zero.Init through transformers' DeepSpeed integration (as HF users do)."""
    from transformers.integrations import HfDeepSpeedConfig
    cls = model_class(kind)
    hf_ds = HfDeepSpeedConfig(cfg)  # must stay alive while the model is built
    torch.manual_seed(seed)
    model = cls._from_config(model_config(kind), dtype=dtype)
    del hf_ds
    return model


def build_plain_model(kind: str, seed: int = 0):
    cls = model_class(kind)
    torch.manual_seed(seed)
    return cls(model_config(kind))


def batches(n: int, micro: int = 2, seq: int = 16, seed: int = 1234) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 7919 * rank())
    return [torch.randint(0, 256, (micro, seq), generator=g) for _ in range(n)]


def train(engine, steps: int, gas: int = 2, eval_at: Optional[int] = None, seed: int = 1234,
          before_backward: Optional[Callable[[int, int], None]] = None) -> Dict[str, List[float]]:
    """steps optimizer steps of gas micro-batches; an eval pass (no_grad, eval()) before step eval_at."""
    data = batches(steps * gas, seed=seed)
    eval_data = batches(2, seed=seed + 1)
    losses, eval_losses = [], []
    for step in range(steps):
        if eval_at is not None and step == eval_at:
            engine.eval()
            with torch.no_grad():
                for x in eval_data:
                    eval_losses.append(engine(input_ids=x, labels=x).loss.float().item())
            engine.train()
        for micro in range(gas):
            x = data[step * gas + micro]
            loss = engine(input_ids=x, labels=x).loss
            if before_backward is not None:
                before_backward(step, micro)
            engine.backward(loss)
            engine.step()
            losses.append(loss.float().item())
    return {"train": losses, "eval": eval_losses}


def stale_shards(module: torch.nn.Module) -> List[str]:
    """Names of parameters whose secondary shard differs from the primary partitions (oracle).

    Gathers every primary partition over the full partition group (independent
    of hpZ) and compares this rank's shard with its slice.
    """
    import deepspeed.comm as dist
    bad = []
    for name, p in module.named_parameters():
        shard = getattr(p, "ds_secondary_tensor", None)
        if shard is None:
            continue
        group = p.ds_process_group
        parts = [torch.empty_like(p.ds_tensor) for _ in range(dist.get_world_size(group=group))]
        dist.all_gather(parts, p.ds_tensor.contiguous(), group=group)
        flat = torch.cat(parts)
        S = shard.numel()
        j = dist.get_rank(group=p.ds_zero_param_process_group)
        valid = max(0, min(p.ds_numel - j * S, S))
        if not torch.equal(flat[j * S:j * S + valid], shard[:valid]):
            bad.append(name)
    return bad


def all_gather_obj(obj: Any) -> List[Any]:
    out: List[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def write_json(path: str, payload: Any) -> None:
    if rank() == 0:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1)
        os.replace(tmp, path)
