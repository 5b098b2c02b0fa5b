"""The option matrix's refused rows (zerotrain.hpz.options): each option refused with hpZ, naming both keys and why.

Fast tier: the check on DeepSpeed config dicts (the trainer's own, built from the run config), each refusal beside
the same config without hpZ (accepted: it is the combination being refused), the CUDA-only refusals allowed on
CUDA, and the options the matrix shows to work accepted. One train.py launch shows the exit code (2) and that the
run stops before anything is written (tests/test_launch_failures.py: hpZ + parameter offload).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zerotrain import engine, run_config
from zerotrain.errors import EXIT_USER_ERROR, ConfigError
from zerotrain.hpz import options

HPZ = {"stage": 3, "zero_hpz_partition_size": 2}

# name -> (zero_optimization extras, top-level extras, words the message must contain besides the hpZ key)
REFUSED = {
    "offload_param": ({"offload_param": {"device": "cpu"}}, {},
                      ["zero.offload_param.device=cpu", "issues/6926", "ms-swift", "offload_param.device=none"]),
    "super_offload": ({"offload_optimizer": {"device": "cpu", "super_offload": True}}, {},
                      ["zero.offload_optimizer.super_offload=true", "SuperOffload", "not shown to work"]),
    "zenflow": ({"zenflow": {"topk_ratio": 0.1}}, {}, ["zero.zenflow", "ZenFlow", "not shown to work"]),
    "mics": ({"mics_shard_size": 2}, {}, ["zero.mics_shard_size", "MiCS was removed", "issues/8489"]),
    "deepcompile": ({}, {"compile": {"deepcompile": True}},
                    ["deepspeed.compile.deepcompile=true", "only the primary partition", "init_z3.py",
                     "silently do nothing"]),
    "autoep": ({}, {"expert_parallel": {"enabled": True}},
               ["deepspeed.expert_parallel.enabled=true", "AutoEP", "secondary groups"]),
    "quantized_nontrainable": ({"zero_quantized_nontrainable_weights": True}, {},
                               ["zero.zero_quantized_nontrainable_weights=true", "torch.empty", "scales come from "
                                "garbage", ".to(param.ds_tensor.dtype)", "pull/6993", "back to int8"]),
    "qwz_cpu": ({"zero_quantized_weights": True}, {}, ["zero.zero_quantized_weights=true", "qwZ", "no CPU kernels",
                                                       "allowed on CUDA"]),
    "qgz_cpu": ({"zero_quantized_gradients": True}, {}, ["zero.zero_quantized_gradients=true", "qgZ",
                                                         "no CPU kernels"]),
}


def ds(zero_extra: dict, top: dict, hpz: int = 2) -> dict:
    return {"zero_optimization": {**HPZ, "zero_hpz_partition_size": hpz, **zero_extra}, **top}


@pytest.mark.parametrize("name", list(REFUSED))
def test_each_refused_option_names_both_keys_and_why(name):
    zero_extra, top, words = REFUSED[name]
    with pytest.raises(options.HpzOptionError) as info:
        options.check(ds(zero_extra, top), "cpu")
    message = str(info.value)
    for w in [*words, "with zero.zero_hpz_partition_size=2 (hpZ) is refused", "docs/hpz.md#option-matrix"]:
        assert w in message, (w, message)
    assert isinstance(info.value, ConfigError) and info.value.exit_code == EXIT_USER_ERROR
    options.check(ds(zero_extra, top, hpz=1), "cpu")  # control: the same option without hpZ is not ours to refuse


def test_deepspeed_naming_for_users_of_the_library():
    with pytest.raises(options.HpzOptionError, match=r"zero_optimization.offload_param.device=cpu with "
                                                     r"zero_optimization.zero_hpz_partition_size=2"):
        options.check(ds({"offload_param": {"device": "cpu"}}, {}), "cpu", naming="deepspeed")
    with pytest.raises(options.HpzOptionError, match=r"; compile.deepcompile=true with"):
        options.check(ds({"offload_param": {"device": "cpu"}}, {"compile": {"deepcompile": True}}), "cpu",
                      naming="deepspeed")


def test_qwz_and_qgz_are_allowed_on_cuda_and_nothing_else_changes_there():
    options.check(ds({"zero_quantized_weights": True, "zero_quantized_gradients": True}, {}), "cuda")
    with pytest.raises(options.HpzOptionError, match="zero_quantized_nontrainable_weights"):
        options.check(ds({"zero_quantized_nontrainable_weights": True}, {}), "cuda")


@pytest.mark.parametrize("zero_extra,top", [
    ({}, {}),
    ({"offload_optimizer": {"device": "cpu"}}, {}),  # the matrix shows it works
    ({"offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}}, {}),
    ({"stage3_allgather_sequential": True}, {}),
    ({}, {"fp16": {"enabled": True, "loss_scale": 0}}),
    ({}, {"compile": {"deepcompile": False}, "expert_parallel": {"enabled": False}}),
])
def test_options_shown_to_work_are_accepted(zero_extra, top):
    assert options.refusals(ds(zero_extra, top), "cpu") == []


def test_not_zero3_or_hpz_off_refuses_nothing():
    assert options.refusals({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2,
                                                   "offload_param": {"device": "cpu"}}}, "cpu") == []
    assert options.refusals({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "cpu") == []
    assert options.refusals({}, "cpu") == []


def test_the_trainers_deepspeed_config_from_run_config_overrides_is_refused():
    """What train.py builds from `zero=zero3_hpz zero.offload_param.device=cpu deepspeed.compile.deepcompile=true`
    (hpZ size resolved to 2 as on 2 ranks per node) is refused naming the zerotrain keys."""
    cfg = run_config.parse_args(["recipe=tiny_llama", "zero=zero3_hpz", "zero.offload_param.device=cpu",
                                 "deepspeed.compile={deepcompile: true}"])
    built = engine.deepspeed_config(cfg.zero, micro_batch_size=1, grad_accum=1, grad_clip=1.0, precision="fp32",
                                    seed=0, dp_size=4, hpz_size=2, extra=cfg.deepspeed)
    keys = [key for key, _ in options.refusals(built, "cpu")]
    assert keys == ["zero.offload_param.device=cpu", "deepspeed.compile.deepcompile=true"]


def test_the_emulator_launch_records_the_same_refused_rows_for_the_table():
    import worker_matrix  # benchmarks/hpz_matrix.py's table takes each refusal's message from it

    assert set(worker_matrix.REFUSED) == set(REFUSED)
    assert all(worker_matrix.REFUSED[name] == REFUSED[name][:2] for name in REFUSED)
    recorded = worker_matrix.refusals()
    assert all(r["refused"] and r["exit_code"] == EXIT_USER_ERROR for r in recorded.values()), recorded


def test_the_table_writer_has_a_note_for_every_option_row():
    import worker_matrix  # a row added there without a note in benchmarks/hpz_matrix.py fails the table's remake

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import hpz_matrix

    assert set(worker_matrix.OPTIONS) <= set(hpz_matrix.NOTES), set(worker_matrix.OPTIONS) - set(hpz_matrix.NOTES)
