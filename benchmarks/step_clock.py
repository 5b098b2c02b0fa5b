"""The clock both sides of benchmarks/train_throughput.py time their loop with (zerotrain_timed.py,
hf_trainer_baseline.py): at each step's end the wall clock and this process's CPU time (every thread), so that the
two loops are measured the same way.

The CPU column says whether a loop does more work or waits more: with more ranks than cores (4 on 2 here) every
CPU second of any rank is wall time for the others, so a loop's own costs show as CPU seconds per step.
"""

from __future__ import annotations

import time

import torch

WARM_STEPS = 2  # the first step ends include start-up work


class StepClock:
    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def tick(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def summary(self) -> dict[str, float]:
        """Collective: steady-state wall seconds per step (this rank's) and CPU seconds per step summed over the
        ranks, from the step after the warm-up to the last."""
        wall, cpu = self.wall[WARM_STEPS:], self.cpu[WARM_STEPS:]
        if len(wall) < 2:
            raise ValueError(f"{len(self.wall)} steps timed: need at least {WARM_STEPS + 2}")
        steps = len(wall) - 1
        cpu_total = torch.tensor([(cpu[-1] - cpu[0]) / steps], dtype=torch.float64)
        torch.distributed.all_reduce(cpu_total)
        return {"step_time_s": (wall[-1] - wall[0]) / steps, "cpu_s_per_step": float(cpu_total),
                "torch_world": torch.distributed.get_world_size()}
