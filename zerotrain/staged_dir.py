"""Write a directory under a temporary name next to its target, and rename it into place only once it is complete.

    with staged_directory(Path("runs/x/hf")) as staging:     # runs/x/.hf.partial
        write_everything_into(staging)
    # runs/x/hf is now the complete new directory; an older runs/x/hf was replaced only at this point

An exception (or Ctrl-C) inside the block removes the staging directory and leaves the target as it was. A process
killed outright leaves ``.<name>.partial`` behind, hidden, and never the target half-written; the next staging of
the same target removes it. Renames stay on one file system, so the target is replaced in two renames (old aside,
new in); a kill between the two leaves the old directory at ``.<name>.replaced``, which the next staging puts back.
One writer per target at a time (the exports are written by one process).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file, then the directories: after a power cut the renamed directory holds whole files."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            _fsync(path)
    for path in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        _fsync(path)
    _fsync(root)


@contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """Yield an empty directory beside ``target``; on a clean exit it becomes ``target`` (see the module doc)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.partial")
    aside = target.with_name(f".{target.name}.replaced")
    if aside.is_dir() and not target.exists():
        os.rename(aside, target)  # killed between the two renames of an earlier replacement: the old one is whole
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(aside, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        _fsync_tree(staging)
        if target.exists():
            os.rename(target, aside)
        os.rename(staging, target)
        _fsync(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if aside.exists() and not target.exists():
            os.rename(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)
