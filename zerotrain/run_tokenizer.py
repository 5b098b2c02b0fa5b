"""The run directory's own copy of the tokenizer: made when training starts, used by every export of the run.

A run's saved config names its data set by the path given at launch, often relative to the directory it was launched
from, and data sets get moved or deleted; so the run directory keeps what an export needs, written atomically by
rank 0 when training starts (and left as it is when the run resumes)::

    <run dir>/tokenizer/
        tokenizer.model | tokenizer.json, tokenizer_config.json, ...   what Tokenizer.save_pretrained writes
        source.json                                                     where it came from: path, sha256, launch dir

Runs made before this copy existed fall back to the data set's tokenizer: the saved path if absolute, else resolved
against the directory the run was launched from (the run directory minus a relative ``run.output_dir``/``run.name``),
then against the current directory.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from zerotrain.data.tokenizer import FileTokenizer, load_tokenizer
from zerotrain.durable import staged_directory
from zerotrain.errors import DataError

log = logging.getLogger("zerotrain")

RUN_TOKENIZER_DIR = "tokenizer"
SOURCE_RECORD = "source.json"


def _load_file_tokenizer(path: Path) -> FileTokenizer:
    tokenizer = load_tokenizer(path)
    assert isinstance(tokenizer, FileTokenizer)  # load_tokenizer only reads files
    return tokenizer


def save_copy(source: str | Path, run_dir: Path) -> Path:
    """Copy the tokenizer of the data set ``source`` to ``<run_dir>/tokenizer`` unless the run already has its copy.
    Rank 0 only; returns the copy's directory."""
    target = Path(run_dir) / RUN_TOKENIZER_DIR
    tokenizer = _load_file_tokenizer(Path(source))
    if target.is_dir():
        kept = _load_file_tokenizer(target)
        if kept.sha256 != tokenizer.sha256:
            log.warning("the data set's tokenizer %s differs from the one this run started with (%s); exports keep "
                        "using the run's copy", tokenizer.path, target)
        return target
    with staged_directory(target) as staging:
        tokenizer.save_pretrained(staging)
        record = {"source": str(tokenizer.path.resolve()), "sha256": tokenizer.sha256,
                  "launch_directory": os.getcwd()}
        (staging / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    log.info("tokenizer copied to %s (from %s)", target, tokenizer.path)
    return target


def _launch_directories(run_dir: Path, run_config: dict[str, Any]) -> list[Path]:
    """Where a relative data path of the run may be relative to: its launch directory if it can be told, then here."""
    bases = []
    relative = Path(str(run_config.get("output_dir", ""))) / str(run_config.get("name", ""))
    resolved = Path(run_dir).resolve()
    suffix = relative.parts
    if suffix and not relative.is_absolute() and resolved.parts[-len(suffix):] == suffix:
        bases.append(Path(*resolved.parts[: -len(suffix)]))
    if Path.cwd() not in bases:
        bases.append(Path.cwd())
    return bases


def load(run_dir: Path, saved_config: dict[str, Any]) -> FileTokenizer:
    """The tokenizer a run was trained with: its copy, or for older runs its data set's (see the module doc).
    ``saved_config`` is the run's resolved config as a plain dict (e.g. from a checkpoint's meta.json)."""
    copy = Path(run_dir) / RUN_TOKENIZER_DIR
    if copy.is_dir():
        return _load_file_tokenizer(copy)
    source = Path(saved_config["data"]["train"][0]["path"])
    if source.is_absolute():
        tried = [source]
    else:
        tried = [base / source for base in _launch_directories(run_dir, saved_config.get("run", {}))]
    for path in tried:
        if path.exists():
            return _load_file_tokenizer(path)
    raise DataError(
        f"cannot find the tokenizer of run {run_dir}: it has no {copy} (runs started before the tokenizer was "
        f"copied there) and its data set data.train.0.path={source} is not at {' or '.join(map(str, tried))}. Put "
        f"the data set back there, or copy its tokenizer/ directory to {copy}, and export again"
    )
