"""The DeepSpeed engine: our config -> DeepSpeed's config dict, the optimizer, the schedule, ``deepspeed.initialize``.

DeepSpeed's own options are passed through, not re-invented: the ``zero`` section of the run config *is* DeepSpeed's
``zero_optimization`` block, checked here by DeepSpeed's own schema (:func:`validate_zero`). The only thing resolved
here is ``zero_hpz_partition_size: auto``, which needs the launcher's node layout (devices per node). The ``optim``
section (:class:`OptimConfig`) is declared here too.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from zerotrain.config import did_you_mean
from zerotrain.errors import ConfigError
from zerotrain.fields import bounded
from zerotrain.schedule import ScheduleConfig, lr_multiplier


class OptimizerName(StrEnum):
    adamw = "adamw"  # Adam with decoupled weight decay (Loshchilov & Hutter)
    adam = "adam"  # weight decay as L2 in the gradient


@dataclass
class OptimConfig:
    """The ``optim`` section (``configs/optim/*.yaml``): Adam(W) over the matrices, no decay on norms and biases."""

    name: OptimizerName = OptimizerName.adamw
    """adamw | adam."""
    lr: float = bounded(3e-4, ge=0)
    """Peak learning rate; the schedule multiplies it."""
    betas: list[float] = bounded(factory=lambda: [0.9, 0.95], length=2, ge=0, lt=1)
    """Adam's (beta1, beta2): decay rates of the first and second moment estimates."""
    eps: float = bounded(1e-8, ge=0)
    """Added to the denominator for numerical stability."""
    weight_decay: float = bounded(0.1, ge=0)
    """Decoupled weight decay (adamw) or L2 penalty (adam) on the weight matrices."""


def validate_zero(zero: Mapping[str, Any]) -> None:
    """Check the zero section with DeepSpeed's own schema, so a misspelt DeepSpeed key fails before launch."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    checked = dict(zero)
    if checked.get("zero_hpz_partition_size") == "auto":
        checked["zero_hpz_partition_size"] = 1
    try:
        DeepSpeedZeroConfig(**checked)
    except Exception as e:  # noqa: BLE001 -- pydantic.ValidationError; its message lists every bad field
        fields = list(DeepSpeedZeroConfig.model_fields)
        aliases = [f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias]
        hints = []
        for error in getattr(e, "errors", list)():
            name = str(error["loc"][0]) if error.get("loc") else ""
            if error.get("type") == "extra_forbidden":
                hints.append(f"unknown key 'zero.{name}'.{did_you_mean(name, fields + aliases)}")
            else:
                hints.append(f"zero.{name}: {error.get('msg')} (got {error.get('input')!r})")
        detail = "; ".join(hints) or str(e)
        raise ConfigError(f"invalid DeepSpeed zero_optimization section: {detail}") from None


def deepspeed_config(zero: Mapping[str, Any], *, micro_batch_size: int, grad_accum: int, grad_clip: float,
                     precision: str, seed: int, dp_size: int, hpz_size: int) -> dict[str, Any]:
    """The dict handed to DeepSpeed (and saved with the run as ``deepspeed_config.json``)."""
    zero = copy.deepcopy(dict(zero))
    if "zero_hpz_partition_size" in zero:
        zero["zero_hpz_partition_size"] = hpz_size
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch_size * grad_accum * dp_size,
        "gradient_clipping": grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        # Our loop logs; DeepSpeed's own periodic prints would interleave with it.
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "seed": seed,
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


def build_optimizer(optim: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    groups = _param_groups(model, optim.weight_decay)
    kwargs = {"lr": optim.lr, "betas": tuple(optim.betas), "eps": optim.eps}
    if get_accelerator().device_name() == "cuda":
        # DeepSpeed's fused multi-tensor Adam on GPUs; on the CPU it would JIT-build for minutes for no gain here.
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, adam_w_mode=optim.name == OptimizerName.adamw, **kwargs)
    cls = torch.optim.AdamW if optim.name == OptimizerName.adamw else torch.optim.Adam
    return cls(groups, **kwargs)


def initialize(model: torch.nn.Module, optim: OptimConfig, schedule: ScheduleConfig, total_steps: int,
               ds_config: dict[str, Any]):
    """``deepspeed.initialize`` with our optimizer and schedule; returns the engine."""
    optimizer = build_optimizer(optim, model)
    factor = lr_multiplier(schedule, total_steps)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
        config=ds_config,
    )
    return engine
