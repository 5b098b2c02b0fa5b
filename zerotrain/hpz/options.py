"""Which DeepSpeed options hpZ is refused with: the matrix's refused rows, checked when the engine is built.

hpZ (``zero_hpz_partition_size`` > 1 under ZeRO-3) is proven under the emulated asynchronous accelerator with the
options of docs/hpz.md's option matrix (race-free in ``ordered``, losses equal to plain ZeRO-3). The options below
are not: each either makes hpZ silently do nothing, takes a path DeepSpeed itself reports broken, needs kernels this
machine does not have, or was never shown to work. :func:`refusals` lists the reasons for a DeepSpeed config dict;
:func:`check` raises :class:`HpzOptionError` (a :class:`~zerotrain.errors.ConfigError`: exit 2) naming both keys.

The trainer calls :func:`check` before the model is built; a user of ``zerotrain.hpz`` over plain DeepSpeed can call
it on the dict handed to ``deepspeed.initialize`` (``hpz.install`` itself does not refuse anything).
Key names: ``naming="zerotrain"`` says ``zero.<key>`` / ``deepspeed.<key>`` (the run config's sections),
``naming="deepspeed"`` says ``zero_optimization.<key>`` / ``<key>`` (DeepSpeed's own config).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zerotrain.errors import ConfigError

DS_ISSUES = "https://github.com/deepspeedai/DeepSpeed/issues"
DS_PULLS = "https://github.com/deepspeedai/DeepSpeed/pull"


class HpzOptionError(ConfigError):
    """An option that hpZ is refused with; the message names the option's key, the hpZ key and why."""


def _enabled(section: Any, key: str = "enabled") -> bool:
    return isinstance(section, Mapping) and bool(section.get(key, False))


def _device(section: Any) -> str:
    return str(section.get("device", "none")).lower() if isinstance(section, Mapping) else "none"


def hpz_size(ds_config: Mapping[str, Any]) -> int:
    """The hpZ size this config asks for (1: hpZ off, also outside ZeRO-3)."""
    zero = ds_config.get("zero_optimization") or {}
    if int(zero.get("stage", 0) or 0) != 3:
        return 1
    size = zero.get("zero_hpz_partition_size", 1)
    return int(size) if isinstance(size, int) else 1  # 'auto' is resolved before the engine is built


def refusals(ds_config: Mapping[str, Any], device: str, naming: str = "zerotrain") -> list[tuple[str, str]]:
    """(option key, why) for every option of ``ds_config`` that hpZ is refused with on ``device`` (DeepSpeed's
    accelerator name: ``cpu``, ``cuda``, ...). Empty when hpZ is off."""
    if hpz_size(ds_config) <= 1:
        return []
    zero = ds_config.get("zero_optimization") or {}
    z = "zero." if naming == "zerotrain" else "zero_optimization."
    top = "deepspeed." if naming == "zerotrain" else ""
    out: list[tuple[str, str]] = []

    if _device(zero.get("offload_param")) != "none":
        out.append((f"{z}offload_param.device={_device(zero.get('offload_param'))}",
                    "parameter offload with hpZ is reported broken (loss stuck, grad_norm 0: DeepSpeed issue "
                    f"{DS_ISSUES}/6926, ms-swift https://github.com/modelscope/ms-swift/issues/3697), and the CPU "
                    "cannot show otherwise: offloading to the host is no move there, so a race-free run under the "
                    f"emulator says nothing of the device-host copies; set {z}offload_param.device=none or "
                    f"{z}zero_hpz_partition_size=1"))
    offload_optimizer = zero.get("offload_optimizer")
    if _enabled(offload_optimizer, "super_offload"):
        out.append((f"{z}offload_optimizer.super_offload=true",
                    "SuperOffload replaces ZeRO-3's optimizer (SuperOffloadOptimizer_Stage3) and is not shown to "
                    f"work with hpZ; use plain {z}offload_optimizer (shown to work) or turn hpZ off"))
    if zero.get("zenflow") is not None:
        out.append((f"{z}zenflow", "ZenFlow's asynchronous offloaded updates are not shown to work with hpZ"))
    for key in ("mics_shard_size", "mics_hierarchical_params_gather"):
        if key in zero:
            out.append((f"{z}{key}", f"MiCS was removed from DeepSpeed 0.19 ({DS_ISSUES}/8489); its sharding "
                        "replaced hpZ's groups and never had hpZ's secondary shards"))
    compile_section = ds_config.get("compile")
    if _enabled(compile_section, "deepcompile"):
        out.append((f"{top}compile.deepcompile=true",
                    "DeepCompile registers only the primary partition of each parameter "
                    "(deepspeed/compile/init_z3.py) and gathers from it, so hpZ would silently do nothing"))
    if _enabled(ds_config.get("expert_parallel")):
        out.append((f"{top}expert_parallel.enabled=true",
                    "DeepSpeed's AutoEP under ZeRO-3 does not support hpZ's secondary groups (it asserts so "
                    "while building the engine, after replacing the model's layers)"))
    if zero.get("zero_quantized_nontrainable_weights"):
        out.append((f"{z}zero_quantized_nontrainable_weights=true",
                    "DeepSpeed 0.19.8's quantized secondary shards of frozen weights are wrong twice over: both "
                    "shard builders quantize a fresh torch.empty buffer and then copy the real weights into the int8 "
                    "tensor (partition_parameters.py ~1838/1866 and ~1922/1944: the scales come from garbage), and "
                    "the coalesced gather ends with .to(param.ds_tensor.dtype) (~795, DeepSpeed PR "
                    f"{DS_PULLS}/6993), which casts the dequantized weights back to int8"))
    if device == "cpu":
        for key, what in (("zero_quantized_weights", "qwZ"), ("zero_quantized_gradients", "qgZ")):
            if zero.get(key):
                out.append((f"{z}{key}=true",
                            f"{what} quantizes with DeepSpeed's CUDA kernels (QuantizerBuilder): there are no CPU "
                            f"kernels, so it cannot run on the CPU accelerator (it is allowed on CUDA)"))
    return out


def check(ds_config: Mapping[str, Any], device: str, naming: str = "zerotrain") -> None:
    """Raise :class:`HpzOptionError` naming every refused option (see :func:`refusals`); nothing when hpZ is off."""
    found = refusals(ds_config, device, naming)
    if not found:
        return
    z = "zero." if naming == "zerotrain" else "zero_optimization."
    size = hpz_size(ds_config)
    raise HpzOptionError("; ".join(f"{key} with {z}zero_hpz_partition_size={size} (hpZ) is refused: {why}"
                                   for key, why in found) + " (docs/hpz.md#option-matrix)")
