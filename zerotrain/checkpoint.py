"""Checkpoints: DeepSpeed's sharded checkpoint plus our metadata, a ``latest`` pointer, resume, keep-last-K.

Layout of ``<run dir>/checkpoints``::

    latest                       the tag of the newest *complete* checkpoint (same file name DeepSpeed uses, so
                                 DeepSpeed's own tools, e.g. zero_to_fp32.py, understand the directory)
    step_00000100/               DeepSpeed's files (model + ZeRO partitions of every rank)
        zerotrain/rank_00003.pt  per-rank state: RNG states, data-loader position
        zerotrain/meta.json      step, tokens, W&B run id, world size, resolved config, and the size of every file

Ordering is what makes a crash at any moment harmless: every rank writes its files, all ranks meet at a barrier,
only then rank 0 writes ``meta.json`` (listing the files it sees) and moves ``latest`` (atomic rename). Old
checkpoints are pruned after ``latest`` has moved, never the one it points to. On load, the file list in
``meta.json`` is checked first, so a truncated or missing shard is reported by name instead of deep inside DeepSpeed.

The ``checkpoint`` section of the run config (:class:`CheckpointConfig`) is declared here.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from zerotrain.distributed import barrier
from zerotrain.errors import CheckpointError
from zerotrain.fields import bounded

LATEST = "latest"
OURS = "zerotrain"


@dataclass
class CheckpointConfig:
    """The ``checkpoint`` section: when to save, how many to keep, whether to resume and to export."""

    interval: int = bounded(0, ge=0)
    """Steps between checkpoints; 0: only at the end (save_final)."""
    keep_last: int = bounded(3, ge=1)
    """Complete checkpoints kept; older ones are deleted after a newer one is complete."""
    resume: bool = True
    """Resume automatically from <run dir>/checkpoints/latest; false refuses to start over existing checkpoints."""
    save_final: bool = True
    """Save a checkpoint after the last step."""
    export_hf: bool = False
    """Also write a Hugging Face directory (<run dir>/hf) after the last step (needs save_final)."""

    def save_due(self, step: int, last_step: int) -> bool:
        """Whether step ``step`` ends with a periodic checkpoint (the last step's is save_final's)."""
        return bool(self.interval) and step % self.interval == 0 and step != last_step


@dataclass
class TrainState:
    """What the loop needs, besides DeepSpeed's engine state, to continue exactly where it stopped."""

    step: int = 0
    tokens: int = 0
    wandb_run_id: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _file_sizes(tag_dir: Path) -> dict[str, int]:
    return {
        str(p.relative_to(tag_dir)): p.stat().st_size
        for p in sorted(tag_dir.rglob("*"))
        if p.is_file() and p.name != "meta.json"
    }


def save(engine, root: Path, state: TrainState, rank_state: dict[str, Any], config_yaml: str, rank: int,
         world_size: int, keep_last: int) -> Path:
    """Collective: every rank calls it at the same step."""
    tag = tag_for(state.step)
    tag_dir = root / tag
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    ours = tag_dir / OURS
    ours.mkdir(parents=True, exist_ok=True)
    rank_file = ours / f"rank_{rank:05d}.pt"
    tmp = rank_file.with_name(f".{rank_file.name}.tmp")
    torch.save(rank_state, tmp)
    os.replace(tmp, rank_file)
    barrier()  # every rank's files are on disk before anything points at them
    if rank == 0:
        meta = {
            "tag": tag,
            "step": state.step,
            "tokens": state.tokens,
            "wandb_run_id": state.wandb_run_id,
            "world_size": world_size,
            "extra": state.extra,
            "config": config_yaml,
            "files": _file_sizes(tag_dir),
        }
        _atomic_write(ours / "meta.json", json.dumps(meta, indent=1))
        _atomic_write(root / LATEST, tag)
        _prune(root, keep_last, protect=tag)
    barrier()
    return tag_dir


def _complete_tags(root: Path) -> list[str]:
    return sorted(p.parent.parent.name for p in root.glob(f"step_*/{OURS}/meta.json"))


def _prune(root: Path, keep_last: int, protect: str) -> None:
    tags = _complete_tags(root)
    for tag in tags[: max(0, len(tags) - keep_last)]:
        if tag != protect:
            shutil.rmtree(root / tag, ignore_errors=True)


def latest_tag(root: Path) -> Optional[str]:
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    if not tag:
        raise CheckpointError(f"{pointer} is empty; delete it to start fresh or write a tag from {_complete_tags(root)}")
    return tag


def read_meta(tag_dir: Path) -> dict[str, Any]:
    """Read and integrity-check a checkpoint's metadata (every listed file present with its recorded size)."""
    meta_path = tag_dir / OURS / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(
            f"checkpoint {tag_dir} is incomplete (no {meta_path.name}): it was interrupted while saving. "
            f"Point {tag_dir.parent / LATEST} at a complete one: {_complete_tags(tag_dir.parent) or 'none'}"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint metadata {meta_path} is corrupt: {e}") from None
    for name, size in meta.get("files", {}).items():
        path = tag_dir / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {tag_dir} is missing {name}; it cannot be resumed from")
        if path.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt: {path.stat().st_size} bytes, {size} were written. "
                f"Other complete checkpoints: {[t for t in _complete_tags(tag_dir.parent) if t != tag_dir.name]}"
            )
    return meta


def load(engine, root: Path, rank: int, world_size: int) -> Optional[tuple[TrainState, dict[str, Any]]]:
    """Collective: resume from ``latest`` if there is one. Returns (state, this rank's state) or None."""
    tag = latest_tag(root)
    if tag is None:
        return None
    tag_dir = root / tag
    meta = read_meta(tag_dir)
    if meta["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint {tag_dir} was written by {meta['world_size']} ranks, this run has {world_size}: ZeRO-3 "
            f"partitions are per rank. Relaunch with {meta['world_size']} ranks, or convert with DeepSpeed's "
            f"zero_to_fp32.py and fine-tune from the export (model.pretrained_path)."
        )
    try:
        path, _ = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
    except Exception as e:  # DeepSpeed raises many types for unreadable files; name the checkpoint instead
        raise CheckpointError(f"could not load DeepSpeed checkpoint {tag_dir}: {type(e).__name__}: {e}") from e
    if path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint in {tag_dir}")
    rank_file = tag_dir / OURS / f"rank_{rank:05d}.pt"
    try:
        rank_state = torch.load(rank_file, weights_only=False)
    except Exception as e:
        raise CheckpointError(f"checkpoint file {rank_file} is unreadable: {e}") from e
    state = TrainState(step=meta["step"], tokens=meta["tokens"], wandb_run_id=meta.get("wandb_run_id"),
                       extra=meta.get("extra", {}))
    return state, rank_state
