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

The run's tokenizer is bound to its data: the copy is the file the data set's manifest names (never a fallback), with
the manifest's sha256, and every checkpoint records that sha256 too (``TrainState.extra["tokenizer"]``). A relaunch
whose data set has another tokenizer is refused once the run has a checkpoint (:func:`check_relaunch`, before
anything is written); before its first checkpoint the copy is replaced, with a warning. An export refuses a copy that
is not the checkpoint's tokenizer (:func:`check_export`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from zerotrain.data.tokenizer import FileTokenizer, file_sha256, find_tokenizer_file, load_tokenizer
from zerotrain.durable import staged_directory
from zerotrain.errors import DataError

log = logging.getLogger("zerotrain")

RUN_TOKENIZER_DIR = "tokenizer"
SOURCE_RECORD = "source.json"


def _load_file_tokenizer(path: Path) -> FileTokenizer:
    tokenizer = load_tokenizer(path)
    assert isinstance(tokenizer, FileTokenizer)  # load_tokenizer only reads files
    return tokenizer


def save_copy(source: str | Path, run_dir: Path, replace: bool = False) -> Path:
    """Copy the tokenizer of the data set ``source`` to ``<run_dir>/tokenizer`` unless the run already has that
    tokenizer; another one there is replaced when ``replace`` (a run without a checkpoint), else refused. Rank 0
    only; returns the copy's directory."""
    target = Path(run_dir) / RUN_TOKENIZER_DIR
    path, sha256 = dataset_tokenizer(source)
    tokenizer = _load_file_tokenizer(path)
    if target.is_dir():
        kept = copy_sha256(target)
        if kept == sha256:
            return target
        if not replace:
            raise DataError(_mismatch(source, path, sha256, f"its copy {target}", kept, run_dir))
        log.warning("the run directory's tokenizer %s (sha256 %s) is replaced by %s (sha256 %s), the tokenizer of "
                    "data.train.0.path=%s: the run has no checkpoint yet, so it starts over with its new data set's "
                    "tokenizer, which exports will ship", target, kept, path, sha256, source)
    with staged_directory(target) as staging:
        tokenizer.save_pretrained(staging)
        record = {"source": str(path.resolve()), "sha256": sha256, "launch_directory": os.getcwd()}
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


# ----------------------------------------------------------------------------------------------------------------
# The binding of a run's tokenizer to its data
# ----------------------------------------------------------------------------------------------------------------

STATE_KEY = "tokenizer"  # TrainState.extra[STATE_KEY]: {"sha256", "source"} of the tokenizer the run trains with


def dataset_tokenizer(data_dir: str | Path) -> tuple[Path, str]:
    """The tokenizer file a prepared data set's manifest names, and the sha256 the manifest records for it (the file
    itself is checked against it when the data set is opened)."""
    from zerotrain.data.shards import read_manifest

    root = Path(data_dir)
    info = read_manifest(root)["tokenizer"]
    return root / info["dir"] / info["file"], info["sha256"]


def copy_sha256(copy_dir: Path) -> str:
    """The sha256 of the tokenizer file in a run's copy (the file exports ship)."""
    return file_sha256(find_tokenizer_file(copy_dir))


def state_record(data_dir: str | Path) -> dict[str, str]:
    """What a checkpoint records of the run's tokenizer."""
    path, sha256 = dataset_tokenizer(data_dir)
    return {"sha256": sha256, "source": str(path.resolve())}


def _mismatch(source: str | Path, path: Path, sha256: str, what: str, expected: str, run_dir: Path) -> str:
    return (f"data.train.0.path={source} has another tokenizer than run {run_dir}: {path} (sha256 {sha256}), but "
            f"{what} has sha256 {expected}. Its token ids would mean other text to the model, and an export would "
            f"ship the wrong tokenizer. Nothing was written. Relaunch with the data set the run was trained on, or "
            f"prepare this one with the run's tokenizer (data/prepare.py tokenizer={Path(run_dir) / RUN_TOKENIZER_DIR}"
            f" ...), or start a new run (another run.name)")


def check_relaunch(data_dir: str | Path, run_dir: Path, latest: Optional[tuple[Path, dict[str, Any]]]) -> None:
    """Before anything is written: a run with a checkpoint (``latest``: its directory and metadata) goes on only with
    the tokenizer it was trained with, the checkpoint's and its copy's. Without a checkpoint any tokenizer goes (the
    copy is replaced, see :func:`save_copy`). Reads only."""
    if latest is None or not (Path(data_dir) / "manifest.json").is_file():
        return  # nothing to bind to yet, or a data set train.py reports as missing
    tag_dir, meta = latest
    path, sha256 = dataset_tokenizer(data_dir)
    recorded = (meta.get("extra") or {}).get(STATE_KEY)
    if recorded and recorded.get("sha256") != sha256:
        raise DataError(_mismatch(data_dir, path, sha256, f"its checkpoint {tag_dir} was trained with "
                                  f"{recorded.get('source')}, which", recorded.get("sha256"), run_dir))
    copy = Path(run_dir) / RUN_TOKENIZER_DIR
    if copy.is_dir():
        kept = copy_sha256(copy)
        if kept != sha256:
            raise DataError(_mismatch(data_dir, path, sha256, f"its copy {find_tokenizer_file(copy)} (the tokenizer "
                                      f"of its checkpoint {tag_dir})", kept, run_dir))


def check_export(tokenizer: FileTokenizer, tag_dir: Path, meta: dict[str, Any]) -> None:
    """An export ships only the tokenizer the checkpoint was trained with (checkpoints since the binding record
    it)."""
    recorded = (meta.get("extra") or {}).get(STATE_KEY)
    if recorded and recorded.get("sha256") != tokenizer.sha256:
        raise DataError(
            f"the tokenizer {tokenizer.path} (sha256 {tokenizer.sha256}) is not the one checkpoint {tag_dir} was "
            f"trained with: {recorded.get('source')} (sha256 {recorded.get('sha256')}). Nothing was exported. Put that "
            f"tokenizer back in {tag_dir.resolve().parent.parent / RUN_TOKENIZER_DIR} (its data set's tokenizer/ "
            f"directory holds it), then export again")
