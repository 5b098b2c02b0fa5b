"""Where a checkpoint's files are: the names every module of the package (and the tools reading a run) agree on.

Layout of ``<run dir>/checkpoints``::

    latest                       the tag of the newest *complete* checkpoint (same file name DeepSpeed uses, so
                                 DeepSpeed's own tools, e.g. zero_to_fp32.py, understand the directory)
    step_00000100/               DeepSpeed's files (model + ZeRO partitions of every rank)
        zerotrain/rank_00003.pt  per-rank state: RNG states, data-loader position
        zerotrain/meta.json      step, tokens, W&B run id, world size, resolved config, and the size and CRC32 of
                                 every file
    .step_00000200.partial/      a save in progress (:mod:`zerotrain.checkpoint.sharded`); never named by latest
    universal/step_00000100/     the universal copy of step_00000100, for a resume on another number of ranks
        zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt, ...   (:mod:`zerotrain.checkpoint.universal`)
        zerotrain/meta.json      step_00000100's metadata, with the CRC32 of every file of the copy
        zerotrain/rank_state.pt  the RNG and data-loader state every rank of the new world takes
"""

from __future__ import annotations

from pathlib import Path

from zerotrain.errors import CheckpointError

LATEST = "latest"
OURS = "zerotrain"  # our files inside a checkpoint directory
META = "meta.json"  # in OURS: the checkpoint's metadata and file list
PARTIAL = ".partial"  # suffix of a checkpoint directory being written
UNIVERSAL = "universal"  # <root>/universal/<tag>: the universal copy of <root>/<tag>
RANK_STATE = "rank_state.pt"  # in a universal copy: the one per-rank state (RNG, loader) every new rank takes


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(tag_dir: Path, rank: int) -> Path:
    """Rank ``rank``'s own state (RNG, data-loader position) in checkpoint ``tag_dir``."""
    return tag_dir / OURS / f"rank_{rank:05d}.pt"


def universal_dir(root: Path, tag: str) -> Path:
    """Where the universal copy of checkpoint ``<root>/<tag>`` lives."""
    return root / UNIVERSAL / tag


def latest_tag(root: Path) -> str | None:
    """The tag ``<root>/latest`` names; None when there is no pointer. An empty pointer is an error naming the
    complete checkpoints it could name instead."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    if not tag:
        raise CheckpointError(f"{pointer} is empty; delete it to start fresh or write a tag from "
                              f"{complete_tags(root)}")
    return tag


def complete_tags(root: Path) -> list[str]:
    """The checkpoints under ``root`` whose metadata was written (the last file of a save), oldest first."""
    return sorted(p.parent.parent.name for p in root.glob(f"step_*/{OURS}/{META}"))


def resolve_tag_dir(path: Path) -> Path:
    """A run directory, a checkpoints directory or a tag directory -> the tag directory."""
    path = Path(path)
    for root in (path / "checkpoints", path):
        tag = latest_tag(root) if root.is_dir() else None
        if tag:
            return root / tag
    if (path / OURS / META).is_file():
        return path
    raise CheckpointError(
        f"{path} is not a run directory, a checkpoints directory or a checkpoint (no 'latest' pointer and no "
        f"{OURS}/{META})"
    )
