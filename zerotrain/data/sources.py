"""Reading raw inputs: local .txt / .jsonl / .parquet files, or a Hugging Face dataset, as a stream of records.

A record is what one training example is made from: a ``str`` (a document cut from a .txt file) or a ``dict`` (a
JSONL line, a parquet row, a dataset row). Each comes with ``where`` ("file.jsonl:12") so that any error about it
names the place to fix.

How .txt files become documents (``txt_split``):

* ``paragraphs`` (default): paragraphs are separated by blank lines; consecutive paragraphs of one file are joined
  (with one blank line) into documents of at least ``txt_doc_chars`` characters. A file boundary always ends a
  document. With ``txt_doc_chars=0`` every paragraph is its own document. Runs of several blank lines between
  paragraphs become one; the text of each paragraph is kept exactly.
* ``file``: each file is one document, verbatim.

Everything streams: no input is read into memory whole (except a .txt file in ``file`` mode, which is one document).
"""

from __future__ import annotations

import codecs
import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from zerotrain.data.tokenizer import file_sha256
from zerotrain.errors import DataError

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
TXT_SPLITS = ("paragraphs", "file")


@dataclass(frozen=True)
class Record:
    where: str  # for error messages: "path:line", "path row 7", "dataset[split] row 7"
    value: Union[str, dict[str, Any]]


def expand_inputs(spec: str) -> list[Path]:
    """Files named by ``spec``: comma-separated files, directories (their supported files) or glob patterns."""
    files: list[Path] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if any(ch in part for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(part, recursive=True) if Path(m).is_file())
            if not matches:
                raise DataError(f"input pattern '{part}' matches no file")
            files.extend(matches)
        elif Path(part).is_dir():
            found = sorted(p for p in Path(part).rglob("*") if p.is_file() and p.suffix in SUPPORTED_SUFFIXES)
            if not found:
                raise DataError(f"input directory {part} holds no {', '.join(SUPPORTED_SUFFIXES)} file")
            files.extend(found)
        elif Path(part).is_file():
            files.append(Path(part))
        else:
            raise DataError(f"input file {part} does not exist")
    if not files:
        raise DataError("no input given: pass input=<file, directory or glob> or hf_dataset=<name>")
    for path in files:
        if path.suffix not in SUPPORTED_SUFFIXES:
            raise DataError(f"input file {path}: unsupported type '{path.suffix}'; use {', '.join(SUPPORTED_SUFFIXES)}")
    return files


def describe_files(files: list[Path]) -> dict:
    """The manifest's record of where the data came from (with checksums, so a changed input is detectable)."""
    return {
        "type": "files",
        "files": [{"path": str(p), "bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in files],
    }


def iter_file_records(files: list[Path], txt_split: str = "paragraphs", txt_doc_chars: int = 4000) -> Iterator[Record]:
    for path in files:
        if path.suffix in TEXT_SUFFIXES:
            yield from _text_records(path, txt_split, txt_doc_chars)
        elif path.suffix in JSONL_SUFFIXES:
            yield from _jsonl_records(path)
        else:
            yield from _parquet_records(path)


def _open_text(path: Path):
    # newline="" keeps \r\n as written: documents are reproduced exactly, not normalised.
    return open(path, encoding="utf-8", newline="")


def _text_records(path: Path, txt_split: str, txt_doc_chars: int) -> Iterator[Record]:
    try:
        if txt_split == "file":
            with _open_text(path) as f:
                text = f.read()
            if text.strip():
                yield Record(str(path), text)
            return
        yield from _paragraph_documents(path, txt_doc_chars)
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _paragraphs(path: Path) -> Iterator[tuple[int, str]]:
    """(first line number, paragraph text) for each run of non-blank lines, the final newline dropped."""
    lines: list[str] = []
    start = 1
    with _open_text(path) as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                if not lines:
                    start = number
                lines.append(line)
            elif lines:
                yield start, "".join(lines).rstrip("\r\n")
                lines = []
    if lines:
        yield start, "".join(lines).rstrip("\r\n")


def _paragraph_documents(path: Path, min_chars: int) -> Iterator[Record]:
    group: list[str] = []
    size, start = 0, 1
    for line, paragraph in _paragraphs(path):
        if not group:
            start = line
        group.append(paragraph)
        size += len(paragraph)
        if size >= min_chars:
            yield Record(f"{path}:{start}", "\n\n".join(group))
            group, size = [], 0
    if group:
        yield Record(f"{path}:{start}", "\n\n".join(group))


def _jsonl_records(path: Path) -> Iterator[Record]:
    with open(path, encoding="utf-8") as f:
        number = 0
        try:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{number}: malformed JSON ({e.msg} at column {e.colno}); "
                                    f"each line must be one JSON object") from None
                if not isinstance(value, dict):
                    raise DataError(f"{path}:{number}: expected a JSON object, got {type(value).__name__}")
                yield Record(f"{path}:{number}", value)
        except UnicodeDecodeError:
            raise _not_utf8(path) from None


def first_invalid_utf8(path: Path, block_bytes: int = 1 << 20) -> Optional[tuple[int, int, str]]:
    """(line number, byte offset, reason) of the first byte of ``path`` that is not valid UTF-8, or None.

    A text-mode file decodes a whole read-ahead buffer at a time, so the error it raises says neither the line
    being read nor the offset in the file: both are recounted here, from the bytes, once an error is known.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = newlines = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(block_bytes)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                # e.object is the decoder's carried-over bytes (a partial character, never a newline) + block.
                carried = len(e.object) - len(block)
                line = newlines + e.object[: e.start].count(b"\n") + 1
                return line, offset - carried + e.start, e.reason
            if not block:
                return None
            newlines += block.count(b"\n")
            offset += len(block)


def _not_utf8(path: Path) -> DataError:
    found = first_invalid_utf8(path)
    if found is None:  # the file changed under us; still say which one
        return DataError(f"{path}: not UTF-8 text; convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)")
    line, offset, reason = found
    return DataError(f"{path}:{line}: not UTF-8 (byte offset {offset:,}: {reason}); convert the file to UTF-8 "
                     f"(e.g. iconv -f latin1 -t utf-8)")


def _parquet_records(path: Path, batch_rows: int = 1024) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    row = 0
    for batch in parquet.iter_batches(batch_size=batch_rows):
        for value in batch.to_pylist():
            yield Record(f"{path} row {row}", value)
            row += 1


def iter_hf_records(
    name: str,
    config: Optional[str] = None,
    split: str = "train",
    streaming: bool = False,
    cache_dir: Optional[str] = None,
) -> Iterator[Record]:
    """Rows of a Hugging Face dataset (a hub name, or a local directory / loading script path)."""
    import datasets

    try:
        dataset = datasets.load_dataset(name, config, split=split, streaming=streaming, cache_dir=cache_dir)
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as e:
        raise DataError(f"hf_dataset={name} (config={config}, split={split}): cannot load it: {e}") from None
    for row, value in enumerate(dataset):
        yield Record(f"{name}[{split}] row {row}", value)


def describe_hf(name: str, config: Optional[str], split: str, streaming: bool) -> dict:
    import datasets

    return {
        "type": "hf_dataset",
        "name": name,
        "config": config,
        "split": split,
        "streaming": streaming,
        "datasets_version": datasets.__version__,
    }


def text_of(record: Record, field: str) -> str:
    """The text of a pretraining record: the record itself (.txt) or its ``field`` (JSONL, parquet, datasets)."""
    if isinstance(record.value, str):
        return record.value
    if field not in record.value:
        keys = ", ".join(sorted(record.value)) or "none"
        raise DataError(f"{record.where}: no '{field}' field (fields: {keys}); set text_field=<name>")
    text = record.value[field]
    if not isinstance(text, str):
        raise DataError(f"{record.where}: field '{field}' is {type(text).__name__}, expected a string")
    return text
