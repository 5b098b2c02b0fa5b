"""The DeepSpeed engine: our config -> DeepSpeed's config dict, the optimizer, the schedule, ``deepspeed.initialize``.

DeepSpeed's own options are passed through, not re-invented: the ``zero`` section of the run config *is* DeepSpeed's
``zero_optimization`` block, checked here by DeepSpeed's own schema (:func:`validate_zero`), and the ``deepspeed``
section takes any other top-level DeepSpeed key (``communication_data_type``, ``flops_profiler``, ...), checked by
DeepSpeed's own parser (:func:`validate_deepspeed_keys`). The only thing resolved here is
``zero_hpz_partition_size: auto``, which needs the launcher's node layout (devices per node). The ``optim`` section
(:class:`OptimConfig`) is declared here too, with the optimizer implementations (:class:`OptimizerImpl`): which one
a run gets (:func:`resolve_impl`) and whether this machine can have it (:func:`check_optimizer_available`) are
decided before the model is built.
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

from zerotrain import ds_patches
from zerotrain.config import did_you_mean
from zerotrain.errors import ConfigError
from zerotrain.fields import bounded
from zerotrain.schedule import ScheduleConfig, lr_multiplier


class OptimizerName(StrEnum):
    adamw = "adamw"  # Adam with decoupled weight decay (Loshchilov & Hutter)
    adam = "adam"  # weight decay as L2 in the gradient


class OptimizerImpl(StrEnum):
    # torch.optim.AdamW/Adam: fused=True on CUDA, foreach elsewhere. Needs no compiler: the default.
    torch_adamw = "torch_adamw"
    # DeepSpeed's FusedAdam: JIT-compiled with nvcc at start-up unless DeepSpeed was installed with the op prebuilt.
    deepspeed_fused = "deepspeed_fused"
    # DeepSpeedCPUAdam: the step in host memory, for zero.offload_optimizer (DeepSpeed requires it there);
    # JIT-compiled with the host C++ compiler on first use (~2 minutes, cached in TORCH_EXTENSIONS_DIR).
    deepspeed_cpu = "deepspeed_cpu"


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
    impl: OptimizerImpl = OptimizerImpl.torch_adamw
    """torch_adamw | deepspeed_fused | deepspeed_cpu: whose kernel steps the optimizer. With zero.offload_optimizer
    the run uses deepspeed_cpu whatever this says (DeepSpeed requires DeepSpeedCPUAdam for offloaded states)."""


def offloads_optimizer(zero: Mapping[str, Any]) -> bool:
    """Whether the zero section puts the optimizer states in host memory (or on NVMe)."""
    section = zero.get("offload_optimizer") or {}
    return str(section.get("device", "none")).lower() not in ("none", "")


def resolve_impl(optim: OptimConfig, zero: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> OptimizerImpl:
    """The implementation a run really gets: deepspeed_cpu under optimizer offload (unless the ``deepspeed`` section
    turned DeepSpeed's requirement off with ``zero_force_ds_cpu_optimizer: false``); an impl that cannot work with
    the zero section is a :class:`ConfigError`."""
    impl = OptimizerImpl(optim.impl)
    forced = bool((extra or {}).get("zero_force_ds_cpu_optimizer", True))
    if offloads_optimizer(zero):
        if impl == OptimizerImpl.deepspeed_fused:
            raise ConfigError("optim.impl=deepspeed_fused cannot step optimizer states offloaded to the host "
                              "(zero.offload_optimizer): use optim.impl=deepspeed_cpu, or a zero preset without "
                              "offload")
        return OptimizerImpl.deepspeed_cpu if forced else impl
    if impl == OptimizerImpl.deepspeed_cpu and get_accelerator().device_name() != "cpu":
        raise ConfigError("optim.impl=deepspeed_cpu steps the optimizer in host memory, which needs the states "
                          "there: add zero.offload_optimizer (zero=zero3_offload_optimizer), or use "
                          "optim.impl=torch_adamw")
    return impl


_OP_BUILDERS = {OptimizerImpl.deepspeed_fused: "FusedAdamBuilder", OptimizerImpl.deepspeed_cpu: "CPUAdamBuilder"}


def check_optimizer_available(impl: OptimizerImpl, builder: Any = None) -> None:
    """Load (JIT-building once, then cached) the DeepSpeed op behind ``impl`` now, before the model is built, so a
    missing compiler or a CUDA toolkit that does not match torch fails in seconds with a clear error rather than
    after minutes of set-up. torch_adamw needs nothing. ``builder``: the op builder to load (default: the
    accelerator's own)."""
    if impl == OptimizerImpl.torch_adamw:
        return
    name = _OP_BUILDERS[impl]
    builder = builder or get_accelerator().create_op_builder(name)
    try:
        builder.load()
    except BaseException as e:  # noqa: BLE001 -- the builders raise RuntimeError, AssertionError, OSError, SystemExit
        if isinstance(e, KeyboardInterrupt):
            raise
        detail = " ".join(str(e).split())[:600] or type(e).__name__
        raise ConfigError(
            f"optim.impl={impl}: DeepSpeed's {name} cannot be built or loaded on this machine "
            f"({type(e).__name__}: {detail}). torch {torch.__version__}, torch.version.cuda {torch.version.cuda}. "
            f"It is JIT-compiled at start-up: it needs ninja and a compiler (nvcc from a CUDA toolkit matching "
            f"torch.version.cuda for FusedAdam; DS_SKIP_CUDA_CHECK=1 tolerates a minor mismatch). "
            + ("Use optim.impl=torch_adamw (needs no compiler)." if impl == OptimizerImpl.deepspeed_fused else
               "Offloading the optimizer needs it: install a C++ compiler and ninja, or drop zero.offload_optimizer.")
        ) from None


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


# Top-level DeepSpeed keys the builder sets from our own sections: the key to use instead.
OWNED_KEYS = {
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "train_batch_size": "train.micro_batch_size and train.grad_accum (x data-parallel ranks)",
    "gradient_clipping": "train.grad_clip",
    "zero_optimization": "the zero section (zero.<key>, or zero=<preset>)",
    "bf16": "train.precision",
    "fp16": "train.precision (bf16 | fp32; fp16 is not supported)",
    "seed": "run.seed",
    "optimizer": "the optim section (optim.name, optim.lr, optim.impl, ...)",
    "scheduler": "the schedule section",
}


class _ReadRecorder(dict):
    """A dict that records which of its keys were looked up, recursively: DeepSpeed's parser silently ignores keys
    it does not know, so the keys it never reads are the misspelt ones."""

    def __init__(self, data: Mapping[str, Any]):
        super().__init__({k: _ReadRecorder(v) if isinstance(v, Mapping) else v for k, v in data.items()})
        self.read: set[str] = set()

    def _note(self, key: Any) -> None:
        self.read.add(key)

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)

    def pop(self, key, *default):
        self._note(key)
        return super().pop(key, *default)

    def setdefault(self, key, default=None):
        self._note(key)
        return super().setdefault(key, default)


def _unread(recorder: _ReadRecorder, prefix: str) -> list[str]:
    """'deepspeed.<path>' of every key DeepSpeed never looked up, with a suggestion from the keys it did."""
    problems = []
    for key, value in dict.items(recorder):
        path = f"{prefix}.{key}"
        if key not in recorder.read:
            known = sorted(k for k in recorder.read if isinstance(k, str))
            problems.append(f"unknown key '{path}'.{did_you_mean(key, known)}")
        elif isinstance(value, _ReadRecorder) and value.read:  # no reads at all: a pydantic model took it whole
            problems += _unread(value, path)
    return problems


def validate_deepspeed_keys(extra: Mapping[str, Any]) -> None:
    """Check the ``deepspeed`` section with DeepSpeed's own parser (``DeepSpeedConfig``, which needs no process
    group): values it rejects, keys it never reads (misspelt), and keys the builder owns, each named."""
    owned = [f"'deepspeed.{k}' is set by the builder: use {OWNED_KEYS[k]}" for k in extra if k in OWNED_KEYS]
    if owned:
        raise ConfigError("; ".join(owned))
    if not extra:
        return
    from deepspeed.runtime.config import DeepSpeedConfig

    base = deepspeed_config({"stage": 3}, micro_batch_size=1, grad_accum=1, grad_clip=1.0, precision="bf16", seed=0,
                            dp_size=1, hpz_size=1)  # world size 1: what DeepSpeedConfig assumes without a group
    recorder = _ReadRecorder(copy.deepcopy(dict(extra)))
    merged = _ReadRecorder({})
    dict.update(merged, base)
    dict.update(merged, recorder)
    try:
        DeepSpeedConfig(merged)
    except Exception as e:  # noqa: BLE001 -- DeepSpeed raises ValueError, TypeError, AssertionError, pydantic errors
        detail = " ".join(str(e).split())[:500] or type(e).__name__
        raise ConfigError(f"{_culprit(base, extra)}: rejected by DeepSpeed's config parser "
                          f"({type(e).__name__}: {detail})") from None
    # merged's reads of the top-level keys are recorded on merged; the nested ones on recorder's children.
    recorder.read = merged.read
    problems = _unread(recorder, "deepspeed")
    if problems:
        raise ConfigError("invalid deepspeed section (top-level DeepSpeed keys): " + "; ".join(problems))


def _culprit(base: dict[str, Any], extra: Mapping[str, Any]) -> str:
    """The first ``deepspeed.<key>`` that DeepSpeed's parser rejects on its own (the parser does not say)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    for key, value in extra.items():
        try:
            DeepSpeedConfig({**base, key: copy.deepcopy(value)})
        except Exception:  # noqa: BLE001
            return f"deepspeed.{key}"
    return "the deepspeed section"


def deepspeed_config(zero: Mapping[str, Any], *, micro_batch_size: int, grad_accum: int, grad_clip: float,
                     precision: str, seed: int, dp_size: int, hpz_size: int,
                     extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The dict handed to DeepSpeed (and saved with the run as ``deepspeed_config.json``); ``extra``: the
    ``deepspeed`` section's top-level keys, merged over the builder's defaults (checked by
    :func:`validate_deepspeed_keys`)."""
    section: dict[str, Any] = copy.deepcopy(dict(zero))
    if "zero_hpz_partition_size" in section:
        section["zero_hpz_partition_size"] = hpz_size
    return {**_built(section, micro_batch_size, grad_accum, grad_clip, precision, seed, dp_size),
            **copy.deepcopy(dict(extra or {}))}


def _built(zero: dict[str, Any], micro_batch_size: int, grad_accum: int, grad_clip: float, precision: str, seed: int,
           dp_size: int) -> dict[str, Any]:
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
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        shape = getattr(param, "ds_shape", param.shape)
        (decay if len(shape) >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(optim: OptimConfig, model: torch.nn.Module, impl: OptimizerImpl) -> torch.optim.Optimizer:
    """The optimizer over ``model``'s parameter groups, with the implementation :func:`resolve_impl` chose."""
    groups = _param_groups(model, optim.weight_decay)
    kwargs: dict[str, Any] = {"lr": optim.lr, "betas": tuple(optim.betas), "eps": optim.eps}
    adamw = optim.name == OptimizerName.adamw
    if impl == OptimizerImpl.deepspeed_fused:
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, adam_w_mode=adamw, **kwargs)
    if impl == OptimizerImpl.deepspeed_cpu:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=adamw, **kwargs)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    # One fused kernel per step on CUDA (torch 2.13 has it for CPU tensors too, but foreach is the tested path there).
    fast: dict[str, Any] = {"fused": True} if get_accelerator().device_name() == "cuda" else {"foreach": True}
    return cls(groups, **kwargs, **fast)


def initialize(model: torch.nn.Module, optim: OptimConfig, schedule: ScheduleConfig, total_steps: int,
               ds_config: dict[str, Any], impl: OptimizerImpl = OptimizerImpl.torch_adamw):
    """``deepspeed.initialize`` with our optimizer and schedule; returns the engine."""
    optimizer = build_optimizer(optim, model, impl)
    factor = lr_multiplier(schedule, total_steps)
    ds_patches.defer_import_time_compile()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
        config=ds_config,
    )
    return engine
