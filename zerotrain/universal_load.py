"""Repairs to DeepSpeed 0.19.8's ZeRO-3 load of a universal checkpoint, applied right after the load.

:func:`zerotrain.checkpoint.load` calls :func:`repair` whenever the engine read a universal copy (a resume on another
number of ranks, :mod:`zerotrain.checkpoint_convert`). Without it the resumed run optimises differently from the
run that saved; ``tests/test_resume_resize.py`` keeps a control with the repair switched off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zerotrain.errors import CheckpointError

# Keys of a torch optimizer's param group that choose a kernel, not a hyperparameter: they belong to the run that
# resumes (a run saved on CPUs and resumed on GPUs must not keep the CPU's foreach path, nor the other way round).
KERNEL_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def step_device(group: dict[str, Any], param: torch.Tensor) -> torch.device:
    """The device torch's Adam/AdamW keeps a parameter's ``step`` on (``Adam._init_group``, torch 2.11-2.13): the
    parameter's device for a capturable or fused group (the fused CUDA kernel refuses a CPU ``step``, pytorch
    #104767), the CPU otherwise (torch hosts it there on purpose, to save a kernel launch per increment)."""
    if group.get("capturable") or group.get("fused"):
        return param.device
    return torch.device("cpu")


def restore_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]],
                   keep: tuple[str, ...] = KERNEL_FLAGS) -> None:
    """Put every saved group's hyperparameters back into the optimizer's group of the same index, except
    ``params`` and the ``keep`` keys, which stay this run's."""
    for group, values in zip(optimizer.param_groups, saved):
        group.update({key: value for key, value in values.items() if key != "params" and key not in keep})


def separate_steps(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter's state its own ``step`` tensor (a copy, same dtype) on :func:`step_device`."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone().to(step_device(group, param))


def repair(engine, universal: Path) -> None:
    """Undo the defects of DeepSpeed 0.19.8's ZeRO-3 universal load (``load_hp_checkpoint_state_from_checkpoint_
    dir_stage3``) that change the optimisation after a resume, or break its first step on GPUs; measured on the tiny
    Llama, 4 -> 2 ranks, the curve drifts by 8e-3 in 4 steps with them and stays within 5e-7 (one ulp) of the
    uninterrupted run without (``tests/test_resume_resize.py``):

    - it copies the *first* parameter group's hyperparameters into every group, so the no-decay group (norms,
      biases) comes back with ``weight_decay=0.1``; the copy holds every group's values, put back here, except the
      kernel choices (:data:`KERNEL_FLAGS`), which stay this run's;
    - it gives every partition's Adam state one shared ``step`` tensor, which torch's Adam increments in place, once
      per partition stepped: with two groups the bias correction then runs two steps ahead per step. Each partition
      gets its own copy here;
    - that ``step`` is on the CPU (``ds_to_universal`` saved it from the CPU), which torch's fused CUDA AdamW refuses
      at the first step; each copy goes where torch itself would put it (:func:`step_device`)."""
    saved = torch.load(universal / "zero" / "optimizer_state.pt", weights_only=False)
    groups = saved.get("optimizer_state_dict", saved).get("param_groups")
    optimizer = engine.optimizer.optimizer  # the torch optimizer under ZeRO-3's partitioning
    if not groups or len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"universal checkpoint {universal} holds {len(groups or [])} optimizer parameter groups, this run's "
            f"optimizer has {len(optimizer.param_groups)}: the optimizer's configuration changed since the "
            f"checkpoint was saved")
    restore_groups(optimizer, groups)
    separate_steps(optimizer)
