"""Validation loss during training: the same first ``train.eval_batches`` batches of the validation split, every
``train.eval_interval`` steps and after the last step.

Every rank runs the same number of forwards (ZeRO-3 gathers parameters collectively) on its share of the batches;
the losses are summed over ranks. The model is evaluated in eval mode under no_grad with the RNG states put back, so
training continues exactly as without validation.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


class Validation:
    """``loader``: the fixed validation batches of this rank (``zerotrain.data.loader.build_valid_loader``)."""

    def __init__(self, loader: Any, interval: int, last_step: int, num_batches: int, dp_size: int):
        self.loader = loader
        self.interval = interval
        self.last_step = last_step
        self.num_batches = num_batches
        self.dp_size = dp_size

    def due(self, step: int) -> bool:
        return bool(self.interval) and (step % self.interval == 0 or step == self.last_step)

    def run(self, engine: Any, device: Any) -> tuple[dict[str, float], str]:
        """Collective; returns the record to log (``val/loss``, ``val/ppl``) and the console line."""
        from zerotrain.evaluation import isolated_evaluation  # eval mode, no_grad, RNG states put back

        total = torch.zeros(1, dtype=torch.float32, device=device)
        with isolated_evaluation(engine):
            for batch in self.loader:
                batch = {k: v.to(device) for k, v in batch.items()}
                total += engine(**batch).loss.float()
        dist.all_reduce(total)
        val = total.item() / (self.num_batches * self.dp_size)
        return {"val/loss": val, "val/ppl": math.exp(min(val, 50.0))}, f"validation loss {val:.4f}"
