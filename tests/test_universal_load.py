"""The pieces of zerotrain.checkpoint.universal.repair, on real torch AdamW optimizers (the whole repair runs in
tests/test_resume_resize.py, on a real 4 -> 2 rank resume)."""

from __future__ import annotations

import pytest
import torch

from zerotrain.checkpoint import universal


def adamw(params, **kernel) -> torch.optim.AdamW:
    return torch.optim.AdamW([{"params": params[:1], "weight_decay": 0.1},
                              {"params": params[1:], "weight_decay": 0.0}], lr=1e-3, **kernel)


def torchs_own_step_device(param: torch.Tensor, **kernel) -> torch.device:
    """Where torch's AdamW itself creates ``step`` for this parameter (its lazy state initialisation)."""
    opt = torch.optim.AdamW([param], lr=1e-3, **kernel)
    param.grad = torch.zeros_like(param)
    opt._init_group(opt.param_groups[0], [], [], [], [], [], [])
    return opt.state[param]["step"].device


# The configurations a CPU can build: the kernels on CPU parameters (fused AdamW runs on the CPU since torch 2.4),
# and a capturable group on the meta device, where torch puts step on the parameter's device, not the CPU.
KERNELS = [({"foreach": True}, "cpu"), ({"foreach": False}, "cpu"), ({"fused": True}, "cpu"),
           ({"capturable": True}, "meta"), ({"foreach": True}, "meta")]


@pytest.mark.parametrize("kernel,device", KERNELS, ids=lambda v: str(v))
def test_step_device_is_torchs_own_choice(kernel, device):
    param = torch.nn.Parameter(torch.zeros(3, device=device))
    opt = torch.optim.AdamW([param], lr=1e-3, **kernel)
    assert universal.step_device(opt.param_groups[0], param) == torchs_own_step_device(param, **kernel)


def test_separated_steps_go_where_torch_wants_them_and_are_copies():
    params = [torch.nn.Parameter(torch.zeros(3, device="meta")) for _ in range(2)]
    opt = adamw(params, capturable=True)
    shared = torch.tensor(4.0)  # DeepSpeed's load: one CPU tensor for every partition
    for p in params:
        opt.state[p] = {"step": shared}
    assert shared.device != torchs_own_step_device(params[0], capturable=True), "the defect: a clone stays on the CPU"
    universal.separate_steps(opt)
    steps = [opt.state[p]["step"] for p in params]
    assert all(s.device == torchs_own_step_device(p, capturable=True) for s, p in zip(steps, params))
    assert all(s.dtype == shared.dtype for s in steps)
    assert steps[0] is not steps[1]


def test_steps_are_separated_when_zero3_has_emptied_the_groups_params():
    """Between steps DeepSpeed's ZeRO-3 leaves every group's ``params`` empty (a sub-group's flat partition is put in
    for its own step only): the states must still get their own ``step`` each. The control is a walk of the groups,
    which finds no parameter there and leaves the one shared tensor (the 8e-3 drift of test_resume_resize.py)."""
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    opt = adamw(params)
    shared = torch.tensor(4.0)
    for p in params:
        opt.state[p] = {"step": shared}
    for group in opt.param_groups:
        group["params"] = []  # as stage3.py leaves them after _optimizer_step
    assert not [p for g in opt.param_groups for p in g["params"] if p in opt.state], "control: the groups show none"
    universal.separate_steps(opt)
    steps = [opt.state[p]["step"] for p in params]
    assert steps[0] is not steps[1] and steps[0] is not shared and all(s.item() == 4.0 for s in steps)


def saved_groups(**kernel) -> list[dict]:
    """The param groups of a checkpoint written by a run with these kernel flags (after one real step)."""
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    opt = adamw(params, **kernel)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    groups = opt.state_dict()["param_groups"]
    for g in groups:
        g["lr"] = 5e-4  # a hyperparameter the scheduler moved: it must come back
    return groups


@pytest.mark.parametrize("current", [{"foreach": False}, {"fused": True}], ids=str)
@pytest.mark.parametrize("keep,kept", [(universal.KERNEL_FLAGS, True), ((), False)],
                         ids=["repair", "copying-everything"])
def test_kernel_flags_stay_this_runs(current, keep, kept):
    saved = saved_groups(foreach=True)
    opt = adamw([torch.nn.Parameter(torch.ones(3)) for _ in range(2)], **current)
    mine = [{k: g[k] for k in universal.KERNEL_FLAGS} for g in opt.param_groups]
    universal.restore_groups(opt, saved, keep=keep)
    assert [g["lr"] for g in opt.param_groups] == [5e-4, 5e-4]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    now = [{k: g[k] for k in universal.KERNEL_FLAGS} for g in opt.param_groups]
    assert (now == mine) is kept, f"kernel flags after the load: {now}, this run's: {mine}"
