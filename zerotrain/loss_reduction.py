"""How an optimizer step's loss averages over its trained tokens (``train.loss_reduction``).

Hugging Face's causal-LM loss is, per forward, the mean over that micro-batch's trained tokens (labels != -100).
DeepSpeed then divides each micro-batch's loss by the accumulation steps and ZeRO averages gradients over the data-
parallel ranks, so a step's gradient is the *mean of micro-batch means*. With SFT (prompt tokens and padding not
trained) or packing, micro-batches hold very different numbers of trained tokens, and that mean weighs a token of a
short micro-batch more than one of a long one: the result depends on how the global batch is split.

``token`` (the default) makes every trained token of the step weigh the same. Each rank counts its trained tokens
over the step's micro-batches, one all-reduce gives the global count ``N``, and every forward gets
``num_items_in_batch = N / (grad_accum * dp)``, which transformers' loss uses as ``sum / num_items_in_batch``. After
DeepSpeed's ``1 / grad_accum`` and ZeRO's ``1 / dp`` the gradient is exactly ``sum of token losses / N``, and the
mean of the micro-batch losses (what the trainer logs) is the global token mean. ``micro_batch`` keeps the plain
per-forward mean.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from zerotrain.data.loader import IGNORE_INDEX


def trained_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Tokens the causal-LM loss is taken over. transformers shifts the labels left by one (token t predicts
    label t+1), so each row's first label is never a target: count ``labels[:, 1:]``, as transformers does."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def num_items_in_batch(micro_batches: Sequence[dict[str, torch.Tensor]], dp_size: int,
                       device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``num_items_in_batch`` every forward of this step gets under ``token`` reduction (collective: every
    rank calls it once per step), and a flag (1.0: the step has no trained token). Both stay on the device: no
    host sync per step; the trainer warns about token-less steps when it reduces its log window. A step without a
    single trained token (possible in SFT) gets 1: its loss and gradient are then 0 instead of 0/0."""
    count = torch.zeros(1, dtype=torch.int64, device=device)
    for batch in micro_batches:
        count += trained_tokens(batch["labels"]).to(device)
    dist.all_reduce(count)
    empty = count == 0
    total = torch.where(empty, torch.full_like(count, len(micro_batches) * dp_size), count)
    # float64 division, then float32: the same float as Python's ``total / n`` put into a float32 tensor.
    value = (total[0].double() / (len(micro_batches) * dp_size)).float()
    return value, empty[0].float()
