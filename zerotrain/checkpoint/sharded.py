"""One checkpoint of one world: DeepSpeed's sharded files plus ours, saved so that a kill loses nothing, and checked
file by file before anything reads them.

Nothing is ever written into a directory that ``latest`` points to (:mod:`zerotrain.checkpoint.layout`), so a kill
at any moment of a save loses nothing:

1. every rank writes its files into ``.step_00000100.partial/`` (DeepSpeed's files and ours), each file checksummed
   as it is written and fsync-ed;
2. all ranks agree that every rank succeeded (a failure anywhere, a full disk say, removes the partial directory
   and raises :class:`CheckpointError` on every rank; ``latest`` stays where it was);
3. rank 0 writes ``meta.json``, renames the directory to ``step_00000100``, and only then moves ``latest`` (written
   to a temporary name, fsync-ed and renamed); the universal copies (they served the one resume that needed them)
   and older checkpoints are pruned last, never the one ``latest`` names. A save that the free space cannot hold
   (the last checkpoint's size) prunes first, down to ``keep_last - 1`` old checkpoints, ``latest`` kept.

A partial directory left by a kill is removed by the next save. Before a load, the file list in ``meta.json`` is
checked (presence, size, and the CRC32 of the files this rank reads, :func:`read_meta`), so a truncated, missing or
bit-flipped file is reported by name instead of deep inside DeepSpeed or, worse, not at all. A universal copy's
``meta.json`` has the same form and is checked the same way.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional, cast

import torch

from zerotrain import durable
from zerotrain.checkpoint.layout import (
    LATEST,
    META,
    OURS,
    PARTIAL,
    UNIVERSAL,
    complete_tags,
    latest_tag,
    rank_file,
    tag_for,
)
from zerotrain.distributed import all_agree, barrier, gather_objects, min_over_ranks
from zerotrain.errors import CheckpointError

log = logging.getLogger("zerotrain")
_SHOWN_FAILURES = 4  # failed ranks a verification message names in full (a damaged disk fails on every rank)


@dataclass
class TrainState:
    """What the loop needs, besides DeepSpeed's engine state, to continue exactly where it stopped."""

    step: int = 0
    tokens: int = 0
    wandb_run_id: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------
# Which rank owns which file
# ----------------------------------------------------------------------------------------------------------------

# DeepSpeed 0.19.8 names each rank's ZeRO partition files '{bf16_}zero_pp_rank_<dp rank>_mp_rank_00_*.pt'; ours are
# 'zerotrain/rank_<rank>.pt'. Everything else ('mp_rank_00_model_states.pt') is written by rank 0.
_RANK_FILE = re.compile(r"(?:^|/)(?:\w*zero_pp_rank_(\d+)_|rank_(\d{5})\.pt$)")


def file_owner(name: str) -> int:
    """The rank that writes (and on resume verifies) a checkpoint file; 0 for the files all ranks share."""
    match = _RANK_FILE.search(name)
    if not match:
        return 0
    return int(match.group(1) or match.group(2))


def files_to_verify(meta: dict[str, Any], rank: int, world_size: Optional[int] = None) -> list[str]:
    """The files whose CRC32 ``rank`` checks on resume, so that together the ranks check each file once.

    A checkpoint of the same world: the files that rank wrote and reads. Another world size (``world_size`` given):
    old rank ``r``'s files go to new rank ``r % world_size``. A universal copy, which every rank reads whole: its
    files in turn."""
    names = sorted(meta.get("files", {}))
    if meta.get("universal"):
        return names[rank::world_size or 1]
    if world_size is None:
        return [name for name in names if file_owner(name) == rank]
    return [name for name in names if file_owner(name) % world_size == rank]


# ----------------------------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------------------------


def _partial_dir(root: Path, tag: str) -> Path:
    return root / f".{tag}{PARTIAL}"


def _remove_partials(root: Path) -> None:
    """Partial directories of saves that were killed: nothing points at them, nothing else would remove them."""
    for stale in root.glob(f".step_*{PARTIAL}"):
        shutil.rmtree(stale, ignore_errors=True)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def checkpoint_bytes(tag_dir: Path) -> Optional[int]:
    """Size of a complete checkpoint from its metadata (None when there is none)."""
    try:
        return sum(_entry(v)[0] for v in read_meta(tag_dir, verify_rank=None)["files"].values())
    except CheckpointError:
        return None


@contextmanager
def _checksummed_saves(engine, partial: Path, written: dict[str, list[int]]) -> Iterator[None]:
    """Route the engine's checkpoint writes through :class:`durable.ChecksumWriter` for this save only.

    DeepSpeed writes every checkpoint file with ``engine.checkpoint_engine.save(state_dict, path)``
    (``torch.save``); replacing that method on this engine's own checkpoint engine, for the duration of the save,
    gets each file's CRC32 as it is written, with no second read of the data."""
    ckpt_engine = engine.checkpoint_engine
    original = ckpt_engine.save
    serialization = getattr(ckpt_engine, "zipfile_serialization", False)

    def save(state_dict, path):
        path = Path(path)
        with durable.checksummed_file(path) as f:
            torch.save(state_dict, f, _use_new_zipfile_serialization=serialization)
        written[str(path.relative_to(partial))] = [f.size, f.crc32]

    ckpt_engine.save = save
    try:
        yield
    finally:
        ckpt_engine.save = original


def _free_bytes(root: Path) -> int:
    """Collective: the free space on the checkpoint directory's file system, the least any rank sees."""
    return min_over_ranks(shutil.disk_usage(root if root.is_dir() else root.parent).free)


def _space_ok(root: Path, tag: str, rank: int, keep_last: int, policy: str) -> bool:
    """Collective, before a save: is there room for another checkpoint the size of the last one?

    If not, the oldest checkpoints are deleted first, down to ``keep_last - 1`` of them (never the one ``latest``
    names), since the new one makes ``keep_last``: a relaunch with a lower ``checkpoint.keep_last`` then has the room
    the message of a full disk promised. Still too little: ``warn`` says so and saves anyway (the save may still fit:
    nothing is lost if it does not), ``skip`` skips this save."""
    free = _free_bytes(root)
    latest = _latest_or_none(root)
    needed = checkpoint_bytes(root / latest) if latest else None
    if latest is None or not needed or free >= needed:
        return True
    if all_agree(len(complete_tags(root)) > keep_last - 1):
        pruned = _prune(root, keep_last - 1, protect=latest) if rank == 0 else []
        barrier()  # every rank measures the space after the deletion
        if pruned:
            log.info("only %s free before saving %s: deleted %s first (checkpoint.keep_last=%d), latest stays at %s",
                     durable.human_bytes(free), tag, ", ".join(pruned), keep_last, latest)
        free = _free_bytes(root)
        if free >= needed:
            return True
    where = durable.mount_point(root)
    text = (f"only {durable.human_bytes(free)} free on {where} and the last checkpoint ({latest}) took "
            f"{durable.human_bytes(needed)}")
    if policy == "skip":
        log.warning("%s: skipping the checkpoint of step %s (checkpoint.low_space=skip); latest stays at %s. "
                    "Free space on %s or lower checkpoint.keep_last", text, tag, latest, where)
        return False
    log.warning("%s: saving %s may fail (a failed save removes itself; latest stays at %s). Free space on %s, "
                "lower checkpoint.keep_last, or set checkpoint.low_space=skip", text, tag, latest, where)
    return True


def _fail(root: Path, tag: str, partial: Path, rank: int, error: Optional[BaseException]) -> CheckpointError:
    """Every rank: agree on what went wrong, remove the partial save, and say it in one message."""
    free = shutil.disk_usage(root if root.is_dir() else root.parent).free
    written = _dir_bytes(partial) if rank == 0 else 0
    reports = gather_objects(None if error is None else
                             (type(error).__name__, str(error), durable.is_out_of_space(error, root)))
    barrier()  # everyone has looked at the partial directory before it goes
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    barrier()
    latest = latest_tag(root)
    keep = f"latest still points at {latest}" if latest else "no earlier checkpoint exists"
    failed = [(r, report) for r, report in enumerate(reports) if report is not None]
    if any(report[2] for _, report in failed):
        previous = checkpoint_bytes(root / latest) if latest else None
        needed = (f"about {durable.human_bytes(max(previous, written))} needed" if previous else
                  f"at least {durable.human_bytes(written)} needed")
        return CheckpointError(
            f"no space left on {durable.mount_point(root)} while saving {root / tag} "
            f"({durable.human_bytes(free)} free, {needed}); the partial save was removed and {keep}. "
            f"Free space, or lower checkpoint.keep_last (a save short of space first deletes the oldest "
            f"checkpoints down to keep_last - 1, never latest), and relaunch: the run resumes from there")
    details = "; ".join(f"rank {r}: {name}: {text}" for r, (name, text, _) in failed[:4])
    return CheckpointError(f"could not save checkpoint {root / tag} ({details}); the partial save was removed "
                           f"and {keep}")


def save(engine, root: Path, state: TrainState, rank_state: dict[str, Any], config_yaml: str, rank: int,
         world_size: int, keep_last: int, low_space: str = "warn") -> Optional[Path]:
    """Collective: every rank calls it at the same step. Returns the checkpoint directory, or None when the
    ``low_space=skip`` policy skipped it. Raises :class:`CheckpointError` (on every rank) when it failed; then
    nothing of it remains and ``latest`` has not moved."""
    tag = tag_for(state.step)
    tag_dir = root / tag
    # A relaunch of a finished run, or a save at a step already saved: the directory latest names is final.
    if all_agree(_latest_or_none(root) == tag and _is_complete(tag_dir)):
        log.info("checkpoint %s is already complete and is the latest: not writing it again", tag_dir)
        return tag_dir
    if not all_agree(_space_ok(root, tag, rank, keep_last, low_space)):
        return None
    partial = _partial_dir(root, tag)
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_partials(root)
            (partial / OURS).mkdir(parents=True)
        except OSError as e:
            error = e
    if not all_agree(error is None):
        raise _fail(root, tag, partial, rank, error)

    written: dict[str, list[int]] = {}
    with _checksummed_saves(engine, partial, written):
        try:
            engine.save_checkpoint(str(root), tag=partial.name, save_latest=False)
        except Exception as e:  # noqa: BLE001 - any failure must reach every rank, see below
            error = e
            # DeepSpeed 0.19.8's save ends with one barrier after all its writes (its other collectives come
            # before them): a rank whose write failed joins it, so the others are not left waiting in it forever.
            barrier()
    if error is None:
        try:
            own = rank_file(partial, rank)
            with durable.checksummed_file(own) as f:
                torch.save(rank_state, cast(IO[bytes], f))  # a binary file object; typeshed's RawIOBase is no IO
            written[str(own.relative_to(partial))] = [f.size, f.crc32]
        except OSError as e:
            error = e
    if not all_agree(error is None):
        raise _fail(root, tag, partial, rank, error)

    files = {name: entry for per_rank in gather_objects(written) for name, entry in per_rank.items()}
    if rank == 0:
        try:
            _publish(root, tag, partial, state, world_size, config_yaml, files, keep_last)
        except OSError as e:
            error = e
    if not all_agree(error is None):
        raise _fail(root, tag, partial, rank, error)
    return tag_dir


def _publish(root: Path, tag: str, partial: Path, state: TrainState, world_size: int, config_yaml: str,
             files: dict[str, list[int]], keep_last: int) -> None:
    """Rank 0, once every rank's files are on disk: metadata, rename into place, then ``latest``, then pruning."""
    for path in sorted(partial.rglob("*")):  # a file no writer reported (none in 0.19.8): hash it from disk
        name = str(path.relative_to(partial))
        if path.is_file() and name not in files:
            files[name] = [path.stat().st_size, durable.file_crc32(path)]
    meta = {
        "tag": tag,
        "step": state.step,
        "tokens": state.tokens,
        "wandb_run_id": state.wandb_run_id,
        "world_size": world_size,
        "extra": state.extra,
        "config": config_yaml,
        "files": {name: {"bytes": size, "crc32": crc} for name, (size, crc) in sorted(files.items())},
    }
    durable.atomic_write_text(partial / OURS / META, json.dumps(meta, indent=1))
    durable.fsync_path(partial / OURS)
    durable.fsync_path(partial)
    durable.replace_dir(partial, root / tag)
    durable.atomic_write_text(root / LATEST, tag)
    # A universal copy served the one resume on another world size that needed it; from here on latest is a
    # checkpoint of this world, and the copy (about 12 bytes per parameter) would only fill the disk.
    shutil.rmtree(root / UNIVERSAL, ignore_errors=True)
    _prune(root, keep_last, protect=tag)


def _latest_or_none(root: Path) -> Optional[str]:
    try:
        return latest_tag(root) if root.is_dir() else None
    except CheckpointError:  # an empty pointer: reported by load, not a reason to stop a save
        return None


def _is_complete(tag_dir: Path) -> bool:
    try:
        read_meta(tag_dir, verify_rank=None)
    except CheckpointError:
        return False
    return True


def _prune(root: Path, keep: int, protect: str) -> list[str]:
    """Delete the oldest complete checkpoints but ``keep`` (and ``protect``); returns the deleted tags."""
    tags = complete_tags(root)
    pruned = [tag for tag in tags[: max(0, len(tags) - keep)] if tag != protect]
    for tag in pruned:
        shutil.rmtree(root / tag, ignore_errors=True)
    return pruned


# ----------------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------------


def _entry(value: Any) -> tuple[int, Optional[int]]:
    """(bytes, crc32) of a file in meta.json; checkpoints saved before checksums recorded the size only."""
    if isinstance(value, dict):
        return value["bytes"], value.get("crc32")
    return int(value), None


def _others(tag_dir: Path) -> str:
    others = [t for t in complete_tags(tag_dir.parent) if t != tag_dir.name]
    return f"Other complete checkpoints: {', '.join(others)}" if others else "There is no other complete checkpoint"


def read_meta(tag_dir: Path, verify_rank: Optional[int] = None, world_size: Optional[int] = None) -> dict[str, Any]:
    """Read and integrity-check a checkpoint's metadata: every listed file present with its recorded size, and, for
    ``verify_rank``, the recorded CRC32 of its share of the files (:func:`files_to_verify`; ``world_size``: the
    world resuming, when it differs from the one that saved)."""
    if not tag_dir.is_dir():
        raise CheckpointError(
            f"{tag_dir.parent / LATEST} names {tag_dir.name}, but {tag_dir} does not exist (deleted or moved?). "
            f"{_others(tag_dir)}: point {tag_dir.parent / LATEST} at one of them, or delete it to start fresh")
    meta_path = tag_dir / OURS / META
    if not meta_path.is_file():
        raise CheckpointError(
            f"checkpoint {tag_dir} is incomplete (no {meta_path.name}): it was interrupted while saving. "
            f"Point {tag_dir.parent / LATEST} at a complete one: {complete_tags(tag_dir.parent) or 'none'}"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint metadata {meta_path} is corrupt: {e}") from None
    files = meta.get("files", {})
    for name, value in files.items():
        path = tag_dir / name
        size, _ = _entry(value)
        if not path.is_file():
            raise CheckpointError(f"checkpoint {tag_dir} is missing {name}; it cannot be resumed from. "
                                  f"{_others(tag_dir)}")
        if path.stat().st_size != size:
            raise CheckpointError(f"checkpoint file {path} is corrupt: {path.stat().st_size} bytes, {size} were "
                                  f"written. {_others(tag_dir)}")
    if verify_rank is not None:
        for name in files_to_verify(meta, verify_rank, world_size):
            _, crc = _entry(files[name])
            found = None if crc is None else durable.file_crc32(tag_dir / name)
            if found != crc:
                source = tag_dir.parent.parent / tag_dir.name  # <root>/universal/<tag> -> <root>/<tag>
                remedy = (f"Delete {tag_dir} and relaunch: it is converted again from {source}"
                          if meta.get("universal") else _others(tag_dir))
                raise CheckpointError(
                    f"checkpoint file {tag_dir / name} is corrupt: its CRC32 differs from the one recorded when it "
                    f"was written ({found:08x}, recorded {crc:08x}: a flipped bit on disk, or a damaged copy). "
                    f"{remedy}")
    return meta


def read_meta_on_all_ranks(tag_dir: Path, rank: int, world_size: int, verify: bool) -> dict[str, Any]:
    """Collective :func:`read_meta`: each rank checks its share of the files, and when any failed every rank raises
    the same :class:`CheckpointError`, with each failed rank's message: under torchrun only rank 0 prints
    (:func:`zerotrain.launch.failures.report`), and it must name the file another rank found corrupt."""
    failure: Optional[str] = None
    meta: dict[str, Any] = {}
    try:
        meta = read_meta(tag_dir, verify_rank=rank if verify else None, world_size=world_size)
    except CheckpointError as e:
        failure = str(e)
    failures = [(r, text) for r, text in enumerate(gather_objects(failure)) if text is not None]
    if not failures:
        return meta
    distinct = list(dict.fromkeys(text for _, text in failures))  # a missing meta.json: every rank says the same
    if len(distinct) == 1:
        raise CheckpointError(distinct[0])
    shown = [f"rank {r}: {text}" for r, text in failures[:_SHOWN_FAILURES]]
    more = f"\n  (and {len(failures) - len(shown)} more ranks)" if len(failures) > len(shown) else ""
    raise CheckpointError(f"checkpoint {tag_dir} failed verification on {len(failures)} ranks:\n  "
                          + "\n  ".join(shown) + more)
