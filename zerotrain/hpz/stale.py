"""Keeping secondary shards fresh when weights change outside the optimizer step.

DeepSpeed rebuilds a shard only when it is missing (or when a
``GatheredParameters(modifier_rank=...)`` exit says the weights changed), and
drops shards only after the optimizer step -- and then only for *trainable*
parameters (``invalidate_secondary_tensor`` walks the optimizer's groups).
Anything else that rewrites weights -- loading a checkpoint, ``load_state_dict``
on the module, resizing the token embeddings (DeepSpeed PR #7130) -- leaves an
old shard in place, and the next all-gather that reads it (the backward one)
silently uses the old weights.

The fix is to drop every shard of the affected module after such an operation.
The next all-gather then falls back to the primary partitions (which the
operation did update), and the following release rebuilds the shard. It must
happen on every rank (the choice between the hpZ group and the full group has
to agree across ranks); all the operations that trigger it are collective.
"""

from __future__ import annotations

from typing import Iterable

import torch

from . import counting
from .zero_param import zero_param


def invalidate_shards(params: Iterable[torch.nn.Parameter]) -> int:
    """Drop the secondary shard of every parameter given; returns how many were dropped."""
    dropped = 0
    for param in params:
        if getattr(param, "ds_secondary_tensor", None) is not None:
            zero_param(param).ds_secondary_tensor = None
            dropped += 1
    counting.bump("shards_invalidated", dropped)
    return dropped


def invalidate_module(module: torch.nn.Module) -> int:
    """Drop the shards of all parameters of ``module``, frozen ones included."""
    return invalidate_shards(module.parameters())
