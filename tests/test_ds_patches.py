"""The one version gate every run-time change to DeepSpeed goes through (zerotrain.ds_patches): hpZ's is tested in
tests/hpz/test_hpz_install.py; here the gate itself and the universal-load repair, which must refuse before it
touches an optimizer whose DeepSpeed it was not written for."""

from __future__ import annotations

import deepspeed
import pytest

from zerotrain import ds_patches
from zerotrain.checkpoint import universal


def test_the_pinned_deepspeed_passes_the_gate():
    assert ds_patches.require_supported("x", "y", "z") == deepspeed.__version__ == ds_patches.PINNED_DEEPSPEED


@pytest.mark.parametrize("version", ["0.18.9", "0.20.0", "garbage"])
def test_another_deepspeed_is_refused_naming_the_component_and_the_way_out(monkeypatch, version):
    monkeypatch.setattr(deepspeed, "__version__", version)
    with pytest.raises(ds_patches.DeepSpeedVersionError) as err:
        ds_patches.require_supported("zerotrain.thing", "its internals", "do without it")
    message = str(err.value)
    assert "zerotrain.thing" in message and version in message and ds_patches.SUPPORTED_DEEPSPEED in message
    assert "install deepspeed==0.19.8 or do without it" in message


def test_the_universal_load_repair_refuses_another_deepspeed_before_reading_anything(monkeypatch, tmp_path):
    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    with pytest.raises(ds_patches.DeepSpeedVersionError, match="load_hp_checkpoint_state_from_checkpoint_dir_stage3"):
        universal.repair(engine=None, universal=tmp_path)  # nothing at tmp_path: the gate comes first
    monkeypatch.setattr(deepspeed, "__version__", ds_patches.PINNED_DEEPSPEED)
    with pytest.raises(FileNotFoundError):  # negative control: the pinned version goes on to read the copy
        universal.repair(engine=None, universal=tmp_path)


# ---- one dispatcher per deepspeed.comm backend method, shared by comm accounting and step timing -----------------


class Backend:
    """Stands in for deepspeed.comm's backend object (TorchBackend): what the dispatchers wrap is its methods."""

    def all_reduce(self, tensor, op=None):
        return ("all_reduce", tensor)

    def barrier(self):
        return "barrier"


def test_hooks_nest_in_order_added_and_any_can_leave_without_undoing_the_other(monkeypatch):
    import deepspeed.comm.comm as ds_comm

    backend = Backend()
    monkeypatch.setattr(ds_comm, "cdb", backend)
    calls: list = []

    def hook(name):
        def observe(method, call, *args, **kwargs):
            calls.append((name, "in", method))
            result = call(*args, **kwargs)
            calls.append((name, "out", method))
            return result
        return observe

    ds_patches.add_collective_hook("a", hook("a"), ["all_reduce", "barrier"])
    ds_patches.add_collective_hook("b", hook("b"), ["all_reduce"])
    try:
        assert backend.all_reduce(7, op="sum") == ("all_reduce", 7)  # arguments and result untouched
        assert calls == [("a", "in", "all_reduce"), ("b", "in", "all_reduce"), ("b", "out", "all_reduce"),
                         ("a", "out", "all_reduce")]
        calls.clear()
        assert backend.barrier() == "barrier" and calls == [("a", "in", "barrier"), ("a", "out", "barrier")]

        ds_patches.remove_collective_hook("a")  # the first one installed leaves first: b still observes
        calls.clear()
        backend.all_reduce(1)
        assert calls == [("b", "in", "all_reduce"), ("b", "out", "all_reduce")]
    finally:
        ds_patches.remove_collective_hook("a")
        ds_patches.remove_collective_hook("b")
    assert vars(backend) == {}  # the last one out restores the class's own methods exactly


def test_negative_control_two_patch_sets_on_one_method_lose_the_inner_wrapper():
    """What comm accounting and step timing did before the shared dispatcher: each wrapped the method itself, and
    the first one's restore deleted the instance attribute holding the second one's wrapper."""
    backend, seen = Backend(), []
    first, second = ds_patches.PatchSet(), ds_patches.PatchSet()
    inner = first.replace(backend, "barrier", lambda: seen.append("first") or Backend.barrier(backend))
    second.replace(backend, "barrier", lambda: seen.append("second") or inner())
    first.restore()
    backend.barrier()
    assert seen == []  # the second wrapper is gone with the first's restore


# ---- torch.compile at the import of DeepSpeed's Muon module, deferred to the first call --------------------------

ENGINE_BUILD = """
import os, sys, torch, deepspeed
from zerotrain import ds_patches
if sys.argv[1] == "deferred":
    ds_patches.defer_import_time_compile()
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
loss = engine(torch.randn(1, 8)).sum()
engine.backward(loss)
engine.step()
print("muon imported:", "deepspeed.runtime.zero.muon.original_muon" in sys.modules)
print("inductor imported:", "torch._inductor.compile_fx" in sys.modules)
"""


@pytest.mark.launch
def test_a_zero3_engine_build_no_longer_imports_inductor(tmp_path):
    """DeepSpeed's engine build imports its Muon module (is ZeRO supported for this optimizer?), whose
    ``@compiler.compile()`` made torch.compile import all of torch._inductor; deferred, the same build and step
    import the module but not inductor. The control (no call) shows the import is DeepSpeed's, so the patch is live."""
    from tools.launcher import PYTHON, free_port, run

    script = tmp_path / "build.py"
    script.write_text(ENGINE_BUILD)
    single = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for how, inductor in (("deferred", False), ("as_deepspeed_does", True)):
        proc = run([PYTHON, str(script), how], env={**single, "MASTER_PORT": str(free_port())}, timeout=300)
        assert "muon imported: True" in proc.stdout, proc.stdout + proc.stderr[-3000:]
        assert f"inductor imported: {inductor}" in proc.stdout, (how, proc.stdout)


def test_the_deferred_compile_compiles_once_at_the_first_call_with_the_same_arguments(monkeypatch):
    import torch
    from deepspeed.runtime import compiler

    ds_patches.defer_import_time_compile()
    calls = []
    real = torch.compile

    def spy(fn, **kwargs):
        calls.append(kwargs)
        return real(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)

    @compiler.compile()(backend="eager")
    def scaled(x):
        return 2 * x

    @compiler.compile()
    def shifted(x):
        return x + 1

    assert calls == []  # decorating compiles nothing
    x = torch.arange(4.0)
    assert torch.equal(scaled(x), 2 * x) and torch.equal(scaled(x), 2 * x)
    assert calls == [{"backend": "eager"}]  # once, at the first call
    assert shifted.__name__ == "shifted" and calls == [{"backend": "eager"}]
