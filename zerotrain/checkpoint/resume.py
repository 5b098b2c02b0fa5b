"""Resuming a run: a plan made before the engine is built, carried out once it is.

The trainer calls the two halves in this order, each collective (every rank, same arguments):

1. :func:`plan_resume`, right after the process group exists and before anything is written or built: with
   ``checkpoint.resume``, whether the latest checkpoint is of another world size and so is read from its universal
   copy (:func:`zerotrain.checkpoint.universal.prepare_resume` makes the copy here if needed). The plan's
   :attr:`ResumePlan.deepspeed_config` is what the DeepSpeed config needs for that (DeepSpeed reads a universal
   checkpoint only when its config says so at initialize);
2. :func:`execute_resume`, once the engine exists: ``checkpoint.resume=false`` over existing checkpoints is refused;
   otherwise the latest checkpoint (or its universal copy) is verified and loaded into the engine, a universal load
   repaired (:func:`zerotrain.checkpoint.universal.repair`), and the loop's state and this rank's own state (RNG,
   data-loader position) returned for the trainer to put back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from zerotrain.checkpoint import sharded, universal
from zerotrain.checkpoint.config import CheckpointConfig
from zerotrain.checkpoint.layout import OURS, RANK_STATE, UNIVERSAL, latest_tag, rank_file, universal_dir
from zerotrain.errors import CheckpointError


@dataclass(frozen=True)
class ResumePlan:
    """What :func:`plan_resume` decided, for :func:`execute_resume` to carry out."""

    root: Path
    """The run's checkpoints directory."""
    enabled: bool
    """``checkpoint.resume``: resume from ``latest`` (false: refuse to start over existing checkpoints)."""
    verify: bool
    """``checkpoint.verify``: check the CRC32 of every file read."""
    universal: bool = False
    """The latest checkpoint is of another world size: it is read from its universal copy, which exists."""

    @property
    def deepspeed_config(self) -> dict[str, Any]:
        """The keys the DeepSpeed config needs for this plan (none for an ordinary resume)."""
        return {"checkpoint": {"load_universal": True}} if self.universal else {}


def plan_resume(section: CheckpointConfig, root: Path, rank: int, world_size: int, micro_batch_size: int,
                grad_accum: int) -> ResumePlan:
    """Collective, before the engine is built. Raises :class:`CheckpointError` on every rank when a resume on
    another world size cannot go ahead (:func:`zerotrain.checkpoint.universal.prepare_resume`)."""
    root = Path(root)
    needs_universal = section.resume and universal.prepare_resume(
        root, rank, world_size, micro_batch_size, grad_accum, convert_on_resize=section.convert_on_resize,
        verify=section.verify)
    return ResumePlan(root, enabled=section.resume, verify=section.verify, universal=needs_universal)


def execute_resume(engine, plan: ResumePlan, rank: int, world_size: int
                   ) -> Optional[tuple[sharded.TrainState, dict[str, Any]]]:
    """Collective, once the engine is built from the plan's DeepSpeed config: load the latest checkpoint into it.
    Returns (the loop's state, this rank's state), or None when there is nothing to resume."""
    if not plan.enabled:
        if latest_tag(plan.root) is not None:
            raise CheckpointError(
                f"{plan.root} holds checkpoints and checkpoint.resume=false: refusing to overwrite them. "
                f"Choose another run.name, or resume with checkpoint.resume=true"
            )
        return None
    return load(engine, plan.root, rank, world_size, verify=plan.verify)


def load(engine, root: Path, rank: int, world_size: int, verify: bool = True
         ) -> Optional[tuple[sharded.TrainState, dict[str, Any]]]:
    """Collective: load ``latest`` into the engine if there is one. Returns (state, this rank's state) or None.

    An engine built to read a universal checkpoint (:attr:`ResumePlan.deepspeed_config`) reads the latest
    checkpoint's universal copy, which :func:`plan_resume` made."""
    tag = latest_tag(root)
    if tag is None:
        return None
    tag_dir = root / tag
    if engine.load_universal_checkpoint():
        meta = sharded.read_meta_on_all_ranks(universal_dir(root, tag), rank, world_size, verify)
        load_dir, own = root / UNIVERSAL, universal_dir(root, tag) / OURS / RANK_STATE
    else:
        meta = sharded.read_meta_on_all_ranks(tag_dir, rank, world_size, verify)
        if meta["world_size"] != world_size:
            raise CheckpointError(
                f"checkpoint {tag_dir} was written by {meta['world_size']} ranks, this run has {world_size}, and "
                f"the engine was not built to read a universal checkpoint (zerotrain.checkpoint.plan_resume "
                f"decides that before deepspeed.initialize)")
        load_dir, own = root, rank_file(tag_dir, rank)
    try:
        path, _ = engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
    except Exception as e:  # DeepSpeed raises many types for unreadable files; name the checkpoint instead
        raise CheckpointError(f"could not load DeepSpeed checkpoint {load_dir / tag}: {type(e).__name__}: {e}") from e
    if path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint in {load_dir / tag}")
    if engine.load_universal_checkpoint():
        universal.repair(engine, universal_dir(root, tag))
    try:
        rank_state = torch.load(own, weights_only=False)
    except Exception as e:
        raise CheckpointError(f"checkpoint file {own} is unreadable: {e}") from e
    state = sharded.TrainState(step=meta["step"], tokens=meta["tokens"], wandb_run_id=meta.get("wandb_run_id"),
                               extra=meta.get("extra", {}))
    return state, rank_state
