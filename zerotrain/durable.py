"""Writes that survive a kill or a power cut: atomic replacement, fsync, and checksums computed while writing.

Everything the run keeps (checkpoints, their ``latest`` pointer, the saved config, exports) is written to a temporary
name, flushed to the disk (``fsync``) and then renamed into place, and the directory holding it is flushed too, so
that after a crash a path either holds the complete new content or the complete old one, never a torn mix.

Directories (an export, a checkpoint) are written under a temporary name beside their target and renamed into place
when complete (:func:`staged_directory`, :func:`replace_dir`): a kill leaves a hidden ``.<name>.partial`` that the
next writer removes, never a half-written target.

Checksums are CRC32 (``zlib.crc32``: 2.2 GB/s on one core of the 2-core CI machine), computed by a file wrapper as the
bytes go out, so a checkpoint is never read back to be hashed. CRC32 catches the failures that matter here (a flipped
bit on disk, a truncated or partially copied file); it is not a defence against deliberate tampering.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from zerotrain.errors import StorageError

READ_BLOCK = 16 << 20
# Writes at least this large are hashed on a second thread while the first one writes them (zlib.crc32 and the
# write system call both release the GIL), so the checksum costs little more than the write itself.
OVERLAP_BYTES = 1 << 20
_hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zt-crc32")


class ChecksumWriter(io.RawIOBase):
    """A write-only binary file that keeps the CRC32 and byte count of what passed through it.

    It has no ``fileno``: ``torch.save`` then writes tensor data through :meth:`write` instead of straight to the
    file descriptor, so every byte is hashed.
    """

    def __init__(self, raw: io.BufferedWriter):
        super().__init__()
        self._raw = raw
        self.crc32 = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= OVERLAP_BYTES:
            crc = _hasher.submit(zlib.crc32, view, self.crc32)
            self._raw.write(view)
            self.crc32 = crc.result()  # before returning: the caller may reuse the buffer
        else:
            self.crc32 = zlib.crc32(view, self.crc32)
            self._raw.write(view)
        self.size += len(view)
        return len(view)


@contextmanager
def checksummed_file(path: Path) -> Iterator[ChecksumWriter]:
    """Open ``path`` for writing; on exit the data is flushed and fsync-ed, and the writer holds its CRC32."""
    with open(path, "wb") as raw:
        writer = ChecksumWriter(raw)
        yield writer
        raw.flush()
        os.fsync(raw.fileno())


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's metadata and data to the disk (a rename is durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a crash leaves either the old or the new content, never a part."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def replace_dir(src: Path, dst: Path) -> None:
    """Rename the finished directory ``src`` to ``dst``; an old ``dst`` is moved aside first and deleted after."""
    aside = None
    if dst.exists():
        aside = dst.with_name(f".{dst.name}.replaced")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(dst, aside)
    os.rename(src, dst)
    fsync_path(dst.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    """Flush every file, then the directories: after a power cut the renamed directory holds whole files."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            fsync_path(path)
    for path in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        fsync_path(path)
    fsync_path(root)


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
        fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if aside.exists() and not target.exists():
            os.rename(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc/self/status``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and put back at once
    os.umask(mask)
    return mask


def default_modes(root: Path) -> None:
    """Give every file under ``root`` the mode a plain ``open()`` would (0666 less the umask), as the run's other
    files have: some writers create theirs private (safetensors 0.8 writes ``model.safetensors`` 0600)."""
    mode = 0o666 & ~current_umask()
    for path in Path(root).rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def is_out_of_space(error: BaseException, directory: Path) -> bool:
    """Whether a failed write ran out of space. Not every writer says ENOSPC: PyTorch's stream writer raises
    ``RuntimeError('... basic_ios::clear: iostream error')`` or ``'unexpected pos 128 vs 0'``; the disk says it."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        usage = shutil.disk_usage(directory)
    except OSError:
        return False
    return usage.free < max(1 << 20, usage.total // 1000)


def write_error(error: OSError, path: Path) -> StorageError:
    """A failed write of ``path`` as a message a user can act on: out of space (with the free space), a read-only
    file system, or the system's own words."""
    where = mount_point(path.parent if path.parent.exists() else Path.cwd())
    if is_out_of_space(error, where):
        free = shutil.disk_usage(where).free
        return StorageError(f"no space left on {where} while writing {path} ({human_bytes(free)} free); free space "
                            f"there, or choose another run.output_dir, and relaunch")
    if error.errno == errno.EROFS:
        return StorageError(f"cannot write {path}: {where} is a read-only file system; choose a writable location")
    return StorageError(f"cannot write {path}: {error.strerror or error}")


def mount_point(path: Path) -> Path:
    """The file system a path lives on, for messages ("no space left on /scratch")."""
    path = path.resolve()
    while not path.is_mount() and path != path.parent:
        path = path.parent
    return path


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
