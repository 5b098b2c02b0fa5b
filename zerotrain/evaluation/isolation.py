"""Running evaluation inside training without disturbing it.

``isolated_evaluation(model)`` puts every submodule in eval mode, disables
autograd, and on exit restores each submodule's own train/eval flag (a frozen
submodule kept in eval mode by the trainer stays so) and the RNG states of
Python ``random``, NumPy, torch CPU and the accelerator, so the training run
after an evaluation draws exactly the random numbers it would have drawn
without one.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch


def _accelerator_module() -> Any | None:
    """torch.cuda (or the current accelerator's module) if it has RNG state to save."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        module = torch.get_device_module(accelerator.current_accelerator())
    elif torch.cuda.is_available():
        module = torch.cuda
    else:
        return None
    if not hasattr(module, "get_rng_state_all"):
        return None
    return module


@contextlib.contextmanager
def preserved_rng_state() -> Iterator[None]:
    """Save all RNG states on entry and put them back on exit."""
    python_state = random.getstate()
    cpu_state = torch.get_rng_state()
    accel = _accelerator_module()
    accel_states = accel.get_rng_state_all() if accel is not None else None
    np: Any
    numpy_state: Any
    try:
        import numpy as np

        numpy_state = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch
        np, numpy_state = None, None
    try:
        yield
    finally:
        random.setstate(python_state)
        torch.set_rng_state(cpu_state)
        if accel is not None:
            accel.set_rng_state_all(accel_states)
        if np is not None:
            np.random.set_state(numpy_state)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode for the duration; each submodule's previous flag restored afterwards."""
    previous = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        # train() first so wrappers that override it (DeepSpeedEngine) see the call,
        # then per-module flags for submodules that differed from their parent.
        model.train(previous[0][1])
        for module, training in previous:
            module.training = training


@contextlib.contextmanager
def isolated_evaluation(model: torch.nn.Module) -> Iterator[None]:
    """eval mode + no_grad + RNG state preserved."""
    # no_grad, not inference_mode: ZeRO-3 re-partitions parameters created outside
    # inference mode, which inference_mode forbids.
    with preserved_rng_state(), eval_mode(model), torch.no_grad():
        yield
