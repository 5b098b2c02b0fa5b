"""The on-disk format of a prepared data set: shard writer, manifest, and memory-mapped reader.

Layout of a prepared directory (written by :mod:`zerotrain.data.prepare`)::

    manifest.json                  what is here, with a sha256 for every file (see below)
    tokenizer/                     the tokenizer file(s), copied verbatim, + tokenizer_config.json
    train/000000.tokens.bin        token ids, little-endian uint16 (vocab <= 65536) or uint32, documents back to back
    train/000000.docs.bin          little-endian int64, num_documents + 1 offsets into the shard's tokens:
                                   document i is tokens[docs[i]:docs[i+1]] (its BOS/EOS included)
    train/000000.mask.bin          SFT only: uint8 per token, 1 where the loss is taken (response tokens + EOS)
    train/000001.tokens.bin ...    a new shard starts once one holds shard_tokens tokens; documents never straddle
    valid/000000.tokens.bin ...    the same for the validation split

``manifest.json`` (``format_version`` 1) holds: ``kind`` (pretrain | sft), ``dtype``, ``tokenizer`` (kind, file,
sha256, vocab_size, bos/eos/pad ids), ``document`` (how documents were framed: bos, eos, chat template), ``splits``
(per split: documents, tokens, and per shard its files with sha256 and its token/document counts), ``source`` and
``arguments`` (the prepare arguments, less the output path). Nothing in it depends on time or place, so two
preparations of the same input are byte-identical.

Reading never loads a split into memory: shards are ``np.memmap``-ed and read a window at a time.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from zerotrain.data.tokenizer import file_sha256
from zerotrain.errors import DataError

FORMAT_NAME = "zerotrain-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "valid")
OFFSET_DTYPE = np.dtype("<i8")
MASK_DTYPE = np.dtype("u1")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id (ids run from 0 to vocab_size - 1)."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def write_manifest(directory: Path, manifest: dict) -> None:
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------


class _HashedFile:
    """An append-only file whose sha256 is computed while writing (no second pass over the data)."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "wb")
        self._digest = hashlib.sha256()

    def write(self, array: np.ndarray) -> None:
        data = array.tobytes()
        self._file.write(data)
        self._digest.update(data)

    def close(self) -> str:
        self._file.close()
        return self._digest.hexdigest()


class SplitWriter:
    """Appends documents (and their loss masks, for SFT) to the shards of one split."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int, with_mask: bool):
        self.root = directory
        self.split = split
        self.dtype = dtype
        self.shard_tokens = shard_tokens
        self.with_mask = with_mask
        self.shards: list[dict] = []
        self.num_documents = 0
        self.num_tokens = 0
        self._open: Optional[dict] = None
        (directory / split).mkdir(parents=True, exist_ok=True)

    def _start_shard(self) -> dict:
        stem = f"{self.split}/{len(self.shards):06d}"
        files = {"tokens": _HashedFile(self.root / f"{stem}.tokens.bin"),
                 "docs": _HashedFile(self.root / f"{stem}.docs.bin")}
        if self.with_mask:
            files["mask"] = _HashedFile(self.root / f"{stem}.mask.bin")
        files["docs"].write(np.zeros(1, OFFSET_DTYPE))
        return {"stem": stem, "files": files, "tokens": 0, "documents": 0}

    def add(self, ids: Sequence[int], mask: Optional[Sequence[int]] = None) -> None:
        if len(ids) == 0:
            return
        if self._open is None:
            self._open = self._start_shard()
        shard = self._open
        shard["files"]["tokens"].write(np.asarray(ids, dtype=self.dtype))
        if self.with_mask:
            shard["files"]["mask"].write(np.asarray(mask, dtype=MASK_DTYPE))
        shard["tokens"] += len(ids)
        shard["documents"] += 1
        shard["files"]["docs"].write(np.array([shard["tokens"]], OFFSET_DTYPE))
        self.num_documents += 1
        self.num_tokens += len(ids)
        if shard["tokens"] >= self.shard_tokens:
            self._close_shard()

    def _close_shard(self) -> None:
        shard, self._open = self._open, None
        assert shard is not None  # called with a shard open
        files = {
            kind: {"path": f"{shard['stem']}.{kind}.bin", "sha256": handle.close()}
            for kind, handle in shard["files"].items()
        }
        self.shards.append({"num_tokens": shard["tokens"], "num_documents": shard["documents"], "files": files})

    def finish(self) -> dict:
        """Close the last shard; the split's entry in the manifest."""
        if self._open is not None:
            self._close_shard()
        return {"num_documents": self.num_documents, "num_tokens": self.num_tokens, "shards": self.shards}


# --------------------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Shard:
    tokens: np.memmap
    docs: np.memmap
    mask: Optional[np.memmap]


class SplitReader:
    """One split of a prepared data set as a single token stream (shards concatenated), memory-mapped."""

    def __init__(self, root: Path, split: str, entry: dict, dtype: np.dtype):
        self.root = root
        self.split = split
        self.num_tokens: int = entry["num_tokens"]
        self.num_documents: int = entry["num_documents"]
        self.shards = [self._map(shard, dtype) for shard in entry["shards"]]
        self.has_mask = all(s.mask is not None for s in self.shards) and bool(self.shards)
        # Cumulative token / document counts: global position -> (shard, local position) by bisection.
        self._token_starts = np.cumsum([0] + [len(s.tokens) for s in self.shards]).tolist()
        self._doc_starts = np.cumsum([0] + [len(s.docs) - 1 for s in self.shards]).tolist()

    def _map(self, shard: dict, dtype: np.dtype) -> Shard:
        files = shard["files"]
        tokens = self._memmap(files["tokens"]["path"], dtype, shard["num_tokens"])
        docs = self._memmap(files["docs"]["path"], OFFSET_DTYPE, shard["num_documents"] + 1)
        mask = self._memmap(files["mask"]["path"], MASK_DTYPE, shard["num_tokens"]) if "mask" in files else None
        return Shard(tokens, docs, mask)

    def _memmap(self, relative: str, dtype: np.dtype, count: int) -> np.memmap:
        path = self.root / relative
        if not path.is_file():
            raise DataError(f"{path}: shard file missing from the prepared data set {self.root}; "
                            f"prepare it again with data/prepare.py")
        expected = count * np.dtype(dtype).itemsize
        actual = path.stat().st_size
        if actual != expected:
            raise DataError(f"{path}: {actual} bytes, but {self.root / MANIFEST} says {expected} (truncated or "
                            f"modified shard); prepare the data set again with data/prepare.py")
        # Empty files cannot be memory-mapped; a zero-length array stands in.
        return np.memmap(path, dtype=dtype, mode="r") if count else np.zeros(0, dtype)  # type: ignore[return-value]

    def _read(self, arrays: list[np.ndarray], start: int, length: int) -> np.ndarray:
        end = start + length
        if start < 0 or end > self.num_tokens:
            raise IndexError(f"tokens [{start}, {end}) outside split '{self.split}' of {self.num_tokens} tokens")
        parts = []
        shard = bisect.bisect_right(self._token_starts, start) - 1
        while start < end:
            local = start - self._token_starts[shard]
            take = min(end - start, len(arrays[shard]) - local)
            parts.append(np.asarray(arrays[shard][local : local + take]))
            start += take
            shard += 1
        return np.concatenate(parts) if len(parts) != 1 else parts[0].copy()

    def tokens(self, start: int, length: int) -> np.ndarray:
        """``length`` token ids from global position ``start`` (crossing shard boundaries as needed)."""
        return self._read([s.tokens for s in self.shards], start, length)

    def mask(self, start: int, length: int) -> np.ndarray:
        if not self.has_mask:
            raise DataError(f"{self.root}: split '{self.split}' has no loss mask (prepared with kind=pretrain)")
        return self._read([s.mask for s in self.shards], start, length)  # type: ignore[misc]

    def document_offsets(self) -> np.ndarray:
        """Global [num_documents + 1] start offsets of every document in the token stream (8 bytes a document)."""
        parts = [np.zeros(1, np.int64)]
        for start, shard in zip(self._token_starts, self.shards):
            parts.append(np.asarray(shard.docs[1:], dtype=np.int64) + start)
        return np.concatenate(parts)


class PreparedDataset:
    """A directory written by data/prepare.py: its manifest, verified, and its splits."""

    def __init__(self, path: str | Path, verify: str = "checksums"):
        self.root = Path(path)
        self.manifest = read_manifest(self.root)
        self.kind: str = self.manifest["kind"]
        self.dtype = np.dtype(self.manifest["dtype"])
        self.tokenizer_info: dict = self.manifest["tokenizer"]
        if verify == "checksums":
            verify_checksums(self.root, self.manifest)
        elif verify != "sizes":
            raise ValueError(f"verify={verify!r}: expected 'checksums' or 'sizes'")
        self._splits: dict[str, SplitReader] = {}

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer_info["vocab_size"])

    def has_split(self, split: str) -> bool:
        return self.manifest["splits"].get(split, {}).get("num_tokens", 0) > 0

    def split(self, split: str) -> SplitReader:
        if split not in self.manifest["splits"]:
            raise DataError(f"{self.root}: no split '{split}' (has {', '.join(self.manifest['splits'])})")
        if split not in self._splits:
            self._splits[split] = SplitReader(self.root, split, self.manifest["splits"][split], self.dtype)
        return self._splits[split]


def read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    if not root.is_dir():
        raise DataError(f"{root}: prepared data set not found. Create it with "
                        f"'python data/prepare.py input=<text files> output={root}' (see data/README.md)")
    if not path.is_file():
        raise DataError(f"{path}: missing, so {root} is not a prepared data set (or its preparation was "
                        f"interrupted). Prepare it again with data/prepare.py")
    try:
        manifest: Any = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e}); prepare the data set again with data/prepare.py") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise DataError(f"{path}: not a zerotrain data manifest; prepare the data set with data/prepare.py")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: format version {manifest.get('format_version')}, this code reads "
                        f"{FORMAT_VERSION}; prepare the data set again with this version of data/prepare.py")
    return manifest


def verify_checksums(root: Path, manifest: dict) -> None:
    """Every shard file and the tokenizer copy must match the sha256 in the manifest."""
    checks = [(root / f["path"], f["sha256"]) for split in manifest["splits"].values()
              for shard in split["shards"] for f in shard["files"].values()]
    tokenizer = manifest["tokenizer"]
    checks.append((root / tokenizer["dir"] / tokenizer["file"], tokenizer["sha256"]))
    for path, expected in checks:
        if not path.is_file():
            raise DataError(f"{path}: missing from the prepared data set {root}; prepare it again with data/prepare.py")
        if file_sha256(path) != expected:
            raise DataError(f"{path}: sha256 does not match {root / MANIFEST} (corrupted or modified); "
                            f"prepare the data set again with data/prepare.py")
