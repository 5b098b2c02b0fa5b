"""Synthetic run directories for the comparison tests (metrics.jsonl written the way zerotrain.loggers writes it),
and a stand-in for the part of ``wandb.Api`` that tools.compare uses (no network in the tests)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any, Iterable, Optional

TOKENS_PER_STEP = 1000


def record(step: int, loss: float, step_time: float = 1.0, tps: Optional[float] = None, mfu: Optional[float] = None,
           **extra: Any) -> dict[str, Any]:
    tps = TOKENS_PER_STEP / step_time if tps is None else tps
    return {"step": step, "loss": loss, "lr": 2e-5, "grad_norm": 1.0, "step_time_s": step_time,
            "tokens": step * TOKENS_PER_STEP, "tokens_per_s": tps, "tokens_per_s_per_device": tps / 4,
            "tflops_per_device": 1.0, "mfu": mfu, **extra}


def write_run(run_dir: Path, rows: Iterable[dict[str, Any]], group: Optional[str] = None) -> Path:
    """A run directory with metrics.jsonl (json.dumps writes NaN as NaN, as the trainer does) and, with a group,
    the config.yaml the trainer saves (only the keys the comparison reads)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if group is not None:
        (run_dir / "config.yaml").write_text(f"run:\n  name: {run_dir.name}\nwandb:\n  group: {group}\n")
    return run_dir


class FakeHistoryRun:
    def __init__(self, name: str, rows: list[dict[str, Any]]):
        self.name, self.url, self._rows = name, f"https://wandb.ai/e/p/runs/{name}", rows

    def scan_history(self, page_size: int = 1000):
        return iter(self._rows)


class FakeApi:
    """The surface of wandb.Api used by load_wandb_group: runs(path, filters) -> runs with scan_history()."""

    def __init__(self, runs: list[FakeHistoryRun]):
        self._runs, self.calls = runs, []

    def runs(self, path: str, filters: Optional[dict] = None) -> list[FakeHistoryRun]:
        self.calls.append((path, filters))
        return list(self._runs)


# W&B's offline run file (run-<id>.wandb): a 7-byte header (":W&B", magic 0xBEE1, version 0), then LevelDB's log
# format (32 KiB blocks; each chunk: CRC32C, length, type full/first/middle/last) of wandb's own protobuf Records.
_WANDB_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
_BLOCK = 32768
_CHUNK = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _offline_records(data: bytes) -> list[bytes]:
    assert data.startswith(_WANDB_HEADER), "not a W&B offline run file (or another format version)"
    records, pending, pos = [], b"", len(_WANDB_HEADER)
    while pos + _CHUNK.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK.size:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = _CHUNK.unpack_from(data, pos)
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + _CHUNK.size: pos + _CHUNK.size + length]
        pos += _CHUNK.size + length
        if kind == _FULL:
            records.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            records.append(pending + chunk)
    return records


def offline_history(path: Path, timeout: float = 60.0) -> list[dict[str, Any]]:
    """The history rows of one W&B offline run file, decoded with wandb's own protobuf schema, keys without W&B's
    own (``_step``, ``_runtime``, ``_timestamp``).

    ``run.finish()`` can return before W&B's service process has written the last records (seen once in ~15 tries on
    a loaded machine: the file then lacked the last history row, which was there a moment later), so this waits up
    to ``timeout`` for the run's ``exit`` record, the last one W&B writes."""
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + timeout
    while True:
        records = []
        for raw in _offline_records(Path(path).read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, f"{path}: W&B wrote no exit record within {timeout:g} s"
        time.sleep(0.1)
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append({k: v for k, v in items.items() if not k.startswith("_")})
    return rows
