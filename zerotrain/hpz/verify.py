"""Verification mode: prove each secondary shard equals the primary partitions before it is read.

Layout. With data-parallel size ``dp``, primary partition size ``P`` (rank
``w`` holds flat elements ``[w*P, (w+1)*P)``) and hpZ group size ``g``, the
shard of hpZ-local rank ``j`` holds ``[j*S, (j+1)*S)`` with ``S = P*dp/g``.
So it is the concatenation of the primary partitions of ``k = dp/g``
consecutive ranks ``j*k .. j*k+k-1`` -- ranks that mostly live on *other*
nodes. Hence the check runs over the parameter's partition (data-parallel)
group, not just the node.

Cost. Each rank hashes its primary partition and the ``k`` blocks of its shard
with an exact integer checksum (the bit patterns summed, plain and
position-weighted, in wrapping int64 -- integer sums are order-independent,
so equal data gives equal checksums bit for bit), then one small all-gather
ships ``(2 + 2k)`` int64 per parameter. Every rank checks every rank's shards,
so all ranks raise the same error together instead of one rank raising while
the others hang in the next collective. With verify off none of this runs: no
extra collectives, no extra kernels.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import deepspeed.comm as dist
import torch

from zerotrain.errors import HpzVerificationError

from . import counting
from .zero_param import ZeroParam, zero_param

# ds_id -> (qualified name, weak reference to the owning engine). ds_ids are
# unique per process (a class-level counter in zero.Init), so engines can share it.
_param_info: Dict[int, Tuple[str, Any]] = {}

_WEIGHT_MOD = 65521  # keeps position weights small; any fixed modulus works


def register_engine(engine: Any) -> None:
    ref = weakref.ref(engine)
    for name, param in engine.module.named_parameters():
        if hasattr(param, "ds_id"):
            _param_info[zero_param(param).ds_id] = (name, ref)


def _describe(param: ZeroParam) -> Tuple[str, Optional[int]]:
    name, ref = _param_info.get(param.ds_id) or (None, None)
    engine = ref() if ref is not None else None
    step = getattr(engine, "global_steps", None) if engine is not None else None
    return name or "<unknown>", step


def _bits(t: torch.Tensor) -> torch.Tensor:
    int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(int_type).to(torch.int64)


def _checksum(flat: torch.Tensor, global_offset: int) -> torch.Tensor:
    """(sum of bit patterns, position-weighted sum) of a 1-D slice starting at ``global_offset``."""
    if flat.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=flat.device)
    bits = _bits(flat)
    pos = torch.arange(global_offset, global_offset + flat.numel(), device=flat.device, dtype=torch.int64)
    weights = pos % _WEIGHT_MOD + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


def _valid(numel: int, start: int, size: int) -> int:
    return max(0, min(numel - start, size))


def check_shards(readers: List[ZeroParam]) -> None:
    """Raise :class:`HpzVerificationError` if any rank's shard of any reader is stale or corrupt.

    Collective over the readers' partition group: call it on every rank with
    the same parameters (the all-gather that follows has the same requirement).
    """
    params = [p for p in readers if not hasattr(p.ds_secondary_tensor, "ds_quant_scale")]
    if not params:
        return
    group = params[0].ds_process_group
    dp = dist.get_world_size(group=group)
    me = dist.get_rank(group=group)
    g = params[0].ds_secondary_tensor_group_size
    k = dp // g
    device = params[0].ds_tensor.device

    rows = []
    for p in params:
        P = p.ds_tensor.ds_numel
        shard = p.ds_secondary_tensor
        assert shard is not None  # readers are the parameters with a shard (ordering.secondary_readers)
        row = [_checksum(p.ds_tensor.view(-1)[:_valid(p.ds_numel, me * P, P)], me * P)]
        j = me % g  # hpZ groups are consecutive blocks of g ranks
        for b in range(k):
            owner = j * k + b
            block = shard.view(-1).narrow(0, b * P, P)[:_valid(p.ds_numel, owner * P, P)]
            row.append(_checksum(block.to(device), owner * P))
        rows.append(torch.cat(row))
    mine = torch.stack(rows)  # [n_params, 2 + 2k]
    gathered = [torch.empty_like(mine) for _ in range(dp)]
    dist.all_gather(gathered, mine, group=group)
    counting.bump("verify_collectives")
    counting.bump("verify_checks", len(params))

    table = torch.stack(gathered).cpu()  # [dp, n_params, 2 + 2k]
    for i, p in enumerate(params):
        for rank in range(dp):
            j = rank % g
            for b in range(k):
                owner = j * k + b
                got = table[rank, i, 2 + 2 * b:4 + 2 * b]
                want = table[owner, i, 0:2]
                if not torch.equal(got, want):
                    name, step = _describe(p)
                    raise HpzVerificationError(
                        f"hpZ verify: secondary shard of parameter ds_id={p.ds_id} name={name} "
                        f"on rank {rank} (hpZ local rank {j}) does not match the primary partition of "
                        f"rank {owner} (shard block {b}) at step {step}; the all-gather would use "
                        f"stale or uninitialised weights")
