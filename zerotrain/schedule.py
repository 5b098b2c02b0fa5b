"""Learning-rate schedules: linear warmup, then cosine, linear or constant, as a multiplier of the peak lr."""

from __future__ import annotations

import math
from typing import Callable

from zerotrain.config import ScheduleConfig


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
        if schedule.name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if schedule.name == "linear":
            return 1.0 - (1.0 - floor) * progress
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
