"""The engine's options (zerotrain/engine.py): optim.impl and the offload presets, and the ``deepspeed`` section of
top-level DeepSpeed keys checked by DeepSpeed's own parser. The unit tests need no process group; one 2-rank launch
(tests/workers/train_variants.py) trains with optimizer offload (DeepSpeedCPUAdam, JIT-built once into
TORCH_EXTENSIONS_DIR) and then without it, on the same data."""

from __future__ import annotations

import json
import math
import re

import pytest
from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

from tools.launcher import torchrun
from zerotrain import engine, run_config
from zerotrain.engine import OptimizerImpl
from zerotrain.errors import ConfigError


def compose(*overrides: str):
    return run_config.parse_args(["recipe=tiny_llama", *overrides])


# ------------------------------------------------------------------------------------------- optim.impl


def test_default_impl_is_torch_adamw_and_offload_chooses_deepspeed_cpu():
    cfg = compose()
    assert cfg.optim.impl == OptimizerImpl.torch_adamw
    assert engine.resolve_impl(cfg.optim, cfg.zero, cfg.deepspeed) == OptimizerImpl.torch_adamw
    offload = compose("zero=zero3_offload_optimizer")
    assert engine.resolve_impl(offload.optim, offload.zero, offload.deepspeed) == OptimizerImpl.deepspeed_cpu
    both = compose("zero=zero3_offload_all")
    assert both.zero["offload_param"]["device"] == "cpu"
    assert engine.resolve_impl(both.optim, both.zero, both.deepspeed) == OptimizerImpl.deepspeed_cpu
    # DeepSpeed's own switch, through the deepspeed section, lets a torch optimizer step offloaded states.
    unforced = compose("zero=zero3_offload_optimizer", "deepspeed.zero_force_ds_cpu_optimizer=false")
    assert engine.resolve_impl(unforced.optim, unforced.zero, unforced.deepspeed) == OptimizerImpl.torch_adamw


def test_fused_adam_with_offload_is_refused_at_compose_time():
    with pytest.raises(ConfigError, match="optim.impl=deepspeed_fused cannot step optimizer states offloaded"):
        compose("zero=zero3_offload_optimizer", "optim.impl=deepspeed_fused")
    with pytest.raises(ConfigError, match="optim.impl.*torch_adamw"):
        compose("optim.impl=fused")  # not a member: the enum's own error lists the choices


def test_an_op_that_cannot_be_built_is_a_clear_error_before_the_model():
    # DeepSpeed's CUDA FusedAdam builder on a machine without CUDA: the real builder, really failing.
    with pytest.raises(ConfigError, match=r"optim.impl=deepspeed_fused: DeepSpeed's FusedAdamBuilder cannot be built"
                                          r".*torch_adamw \(needs no compiler\)"):
        engine.check_optimizer_available(OptimizerImpl.deepspeed_fused, FusedAdamBuilder())
    engine.check_optimizer_available(OptimizerImpl.torch_adamw)  # needs nothing


# ------------------------------------------------------------------------------ the deepspeed section


def test_top_level_deepspeed_keys_pass_through_when_deepspeed_knows_them():
    cfg = compose("deepspeed.communication_data_type=fp32", "deepspeed.wall_clock_breakdown=true")
    built = engine.deepspeed_config(cfg.zero, micro_batch_size=4, grad_accum=1, grad_clip=1.0, precision="fp32",
                                    seed=1, dp_size=4, hpz_size=2, extra=cfg.deepspeed)
    assert built["communication_data_type"] == "fp32" and built["wall_clock_breakdown"] is True
    assert built["train_batch_size"] == 16 and built["zero_optimization"]["zero_hpz_partition_size"] == 2
    engine.validate_deepspeed_keys({"flops_profiler": {"enabled": True, "profile_step": 2},
                                    "tensorboard": {"enabled": False}, "zero_force_ds_cpu_optimizer": False})


@pytest.mark.parametrize("extra,message", [
    ({"wall_clock_breakdwon": True}, "unknown key 'deepspeed.wall_clock_breakdwon'. Did you mean "
                                     "'wall_clock_breakdown'?"),
    ({"flops_profiler": {"enabld": True}}, "unknown key 'deepspeed.flops_profiler.enabld'. Did you mean 'enabled'?"),
    ({"checkpoint": {"load_univrsal": True}}, "'deepspeed.checkpoint.load_univrsal'. Did you mean 'load_universal'?"),
    ({"wall_clock_breakdown": True, "communication_data_type": "fp42"},
     r"deepspeed.communication_data_type: rejected by DeepSpeed's config parser \(ValueError: Invalid "
     r"communication_data_type"),
    ({"comms_logger": {"verbos": True}}, "deepspeed.comms_logger: rejected .*verbos"),
    ({"gradient_clipping": 2.0}, "'deepspeed.gradient_clipping' is set by the builder: use train.grad_clip"),
    ({"zero_optimization": {"stage": 2}}, "'deepspeed.zero_optimization' is set by the builder: use the zero "
                                          "section"),
    ({"train_micro_batch_size_per_gpu": 8}, "use train.micro_batch_size"),
])
def test_bad_deepspeed_keys_are_named(extra, message):
    with pytest.raises(ConfigError, match=message):
        engine.validate_deepspeed_keys(extra)


def test_deepspeeds_parser_alone_accepts_a_misspelt_key():
    # Negative control of the unknown-key checks above: DeepSpeed itself ignores the typo silently, so only the
    # recording of the keys it reads catches it.
    from deepspeed.runtime.config import DeepSpeedConfig

    base = engine.deepspeed_config({"stage": 3}, micro_batch_size=1, grad_accum=1, grad_clip=1.0, precision="bf16",
                                   seed=0, dp_size=1, hpz_size=1)
    parsed = DeepSpeedConfig({**base, "wall_clock_breakdwon": True, "flops_profiler": {"enabld": True}})
    assert parsed.wall_clock_breakdown is False and parsed.flops_profiler_config.enabled is False


def test_a_misspelt_deepspeed_key_fails_at_compose_time():
    with pytest.raises(ConfigError, match="Did you mean 'wall_clock_breakdown'"):
        compose("deepspeed.wall_clock_breakdwon=true")


def test_nested_deepspeed_keys_need_no_yaml_block_and_are_still_checked_by_deepspeed():
    cfg = compose("deepspeed.flops_profiler.enabled=true", "deepspeed.flops_profiler.profile_step=2")
    built = engine.deepspeed_config(cfg.zero, micro_batch_size=4, grad_accum=1, grad_clip=1.0, precision="fp32",
                                    seed=1, dp_size=1, hpz_size=1, extra=cfg.deepspeed)
    assert built["flops_profiler"] == {"enabled": True, "profile_step": 2}  # what deepspeed.initialize gets
    # A bad nested key is refused as a YAML block's would be: the read recorder sees DeepSpeed's parser skip it.
    with pytest.raises(ConfigError, match=r"unknown key 'deepspeed\.flops_profiler\.enabld'\. Did you mean 'enabled'"):
        compose("deepspeed.flops_profiler.enabld=true")
    with pytest.raises(ConfigError, match=r"deepspeed\.flops_profiler: rejected by DeepSpeed's config parser"):
        compose("deepspeed.flops_profiler=3")
    # Schema sections still take no new keys, however deep.
    with pytest.raises(ConfigError, match=r"unknown config key 'optim\.adam\.beta1'"):
        compose("optim.adam.beta1=0.9")


# ------------------------------------------------------------------- one launch, two runs: optimizer offload


@pytest.fixture(scope="module")
def offload_runs(tmp_path_factory, shakespeare):
    """tiny_llama on 2 ranks, 4 steps, ZeRO-3 with the optimizer offloaded (DeepSpeedCPUAdam), then, in the same
    launch, the same run with the offload device set to none (torch AdamW), plus a deepspeed-section key that must
    reach DeepSpeed."""
    out = tmp_path_factory.mktemp("offload")
    common = ["recipe=tiny_llama", "train.steps=4", "train.log_interval=1", "train.eval_interval=0",
              "checkpoint.interval=0", "checkpoint.save_final=false", "wandb.mode=disabled", "mmlu.enabled=false",
              f"data.train.0.path={shakespeare}", f"run.output_dir={out}", "zero=zero3_offload_optimizer",
              "zero.offload_optimizer.pin_memory=false", "deepspeed.communication_data_type=fp32"]
    runs = [[*common, "run.name=offload"], [*common, "run.name=reference", "zero.offload_optimizer.device=none"]]
    proc = torchrun(2, "tests/workers/train_variants.py", *(" ".join(r) for r in runs), timeout=900)
    return out, proc.stdout + proc.stderr


def _losses(run_dir):
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_optimizer_offload_trains_with_deepspeed_cpu_adam_like_torch_adamw(offload_runs):
    out, log = offload_runs
    # One line per run, in the order they ran: the offloaded run, then the negative control (no offload, no CPUAdam).
    assert re.findall(r"optimizer: (\w+) \(optim.impl=(\w+)\)", log) == [
        ("DeepSpeedCPUAdam", "deepspeed_cpu"), ("AdamW", "torch_adamw")], log[-3000:]
    offloaded, reference = _losses(out / "offload"), _losses(out / "reference")
    assert len(offloaded) == len(reference) == 4 and all(math.isfinite(x) for x in offloaded)
    assert offloaded[0] == reference[0]  # the same model and batch before any step
    assert offloaded[-1] < offloaded[0]
    for a, b in zip(offloaded, reference):
        assert abs(a - b) < 1e-5, (offloaded, reference)  # two Adam implementations, fp32: rounding apart


def test_deepspeed_section_reaches_the_engines_config(offload_runs):
    out, _ = offload_runs
    saved = json.loads((out / "offload" / "deepspeed_config.json").read_text())
    assert saved["communication_data_type"] == "fp32"
    assert saved["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
