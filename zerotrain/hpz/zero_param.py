"""The attributes DeepSpeed's ZeRO-3 sets on a partitioned parameter, named once for the type checker.

``deepspeed.runtime.zero.partition_parameters`` adds ``ds_tensor``, ``ds_secondary_tensor``, ``ds_numel``... to
each ``torch.nn.Parameter`` at run time, so a checker sees none of them. ``ZeroParam`` and ``ZeroShard`` declare
them (names and types only: nothing here is ever instantiated); code that handles ZeRO parameters annotates them
with these types, or converts with ``zero_param``, a ``typing.cast`` that does nothing at run time.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, cast

import torch


class ZeroShard(torch.Tensor):
    """A parameter's primary partition (``ds_tensor``) or hpZ secondary shard (``ds_secondary_tensor``)."""

    ds_numel: int
    status: Any  # deepspeed PartitionedParamStatus
    final_location: Any


class ZeroParam(torch.nn.Parameter):
    """A ``torch.nn.Parameter`` that ZeRO-3 has partitioned."""

    ds_id: int
    ds_numel: int
    ds_shape: torch.Size
    ds_status: Any  # deepspeed ZeroParamStatus
    ds_tensor: ZeroShard
    ds_secondary_tensor: Optional[ZeroShard]
    ds_process_group: Any
    ds_secondary_tensor_group_size: int
    ds_secondary_tensor_num_of_groups: int
    all_gather_coalesced: Any  # a closure DeepSpeed binds per parameter; gpu_check wraps it

    ds_summary: Callable[[], dict]


def zero_param(param: torch.Tensor) -> ZeroParam:
    """``param`` as a ZeRO-3 parameter (no check, no conversion: the caller knows DeepSpeed partitioned it)."""
    return cast(ZeroParam, param)
