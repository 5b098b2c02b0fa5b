"""Learning-rate schedules: linear warmup, then cosine, linear or constant, as a multiplier of the peak lr."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from zerotrain.fields import bounded


class ScheduleName(StrEnum):
    cosine = "cosine"  # half a cosine from the peak down to lr * min_lr_ratio
    linear = "linear"  # a straight line from the peak down to lr * min_lr_ratio
    constant = "constant"  # the peak until the end


@dataclass
class ScheduleConfig:
    """The ``schedule`` section (``configs/schedule/*.yaml``): warmup, then the decay of the learning rate."""

    name: ScheduleName = ScheduleName.cosine
    """The decay after warmup: cosine | linear | constant."""
    warmup_steps: int = bounded(0, ge=0)
    """Steps of linear warmup from lr / warmup_steps to lr; 0: start at the peak."""
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)
    """cosine/linear end at lr * min_lr_ratio at the last step."""


def lr_multiplier(schedule: ScheduleConfig, total_steps: int) -> Callable[[int], float]:
    """``f(step) -> factor`` for ``torch.optim.lr_scheduler.LambdaLR``; ``step`` counts applied optimizer steps.

    Warmup ramps from lr/warmup to lr over ``warmup_steps`` (never 0 at the first step, which would waste it).
    The decay runs from the end of warmup to ``total_steps`` and ends at ``lr * min_lr_ratio``.
    """
    warmup = schedule.warmup_steps
    floor = schedule.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule.name == ScheduleName.constant:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if schedule.name == ScheduleName.linear:
            return 1.0 - (1.0 - floor) * progress
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
