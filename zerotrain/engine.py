"""The DeepSpeed engine: our config -> DeepSpeed's config dict, the optimizer, the schedule, ``deepspeed.initialize``.

DeepSpeed's own options are passed through, not re-invented: the ``zero`` section of the run config *is* DeepSpeed's
``zero_optimization`` block. The only thing resolved here is ``zero_hpz_partition_size: auto``, which needs the
launcher's node layout (devices per node).
"""

from __future__ import annotations

from typing import Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from omegaconf import DictConfig

from zerotrain.config import as_container
from zerotrain.schedule import lr_multiplier


def deepspeed_config(cfg: DictConfig, dp_size: int, hpz_size: int) -> dict[str, Any]:
    """The dict handed to DeepSpeed (and saved with the run as ``deepspeed_config.json``)."""
    zero = dict(as_container(cfg.zero))
    if "zero_hpz_partition_size" in zero:
        zero["zero_hpz_partition_size"] = hpz_size
    train = cfg.train
    return {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum,
        "train_batch_size": train.micro_batch_size * train.grad_accum * dp_size,
        "gradient_clipping": train.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": train.precision == "bf16"},
        # Our loop logs; DeepSpeed's own periodic prints would interleave with it.
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "seed": cfg.run.seed,
    }


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices, not norms and biases (GPT-2/nanoGPT convention). ZeRO-3 flattens partitioned parameters,
    so the original rank comes from ``ds_shape``."""
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        shape = getattr(param, "ds_shape", param.shape)
        (decay if len(shape) >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: DictConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    optim = cfg.optim
    groups = _param_groups(model, optim.weight_decay)
    kwargs = dict(lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)
    if get_accelerator().device_name() == "cuda":
        # DeepSpeed's fused multi-tensor Adam on GPUs; on the CPU it would JIT-build for minutes for no gain here.
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, adam_w_mode=optim.name == "adamw", **kwargs)
    cls = torch.optim.AdamW if optim.name == "adamw" else torch.optim.Adam
    return cls(groups, **kwargs)


def initialize(cfg: DictConfig, model: torch.nn.Module, ds_config: dict[str, Any]):
    """``deepspeed.initialize`` with our optimizer and schedule; returns the engine."""
    optimizer = build_optimizer(cfg, model)
    factor = lr_multiplier(cfg.schedule, cfg.train.steps)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
        config=ds_config,
    )
    return engine
