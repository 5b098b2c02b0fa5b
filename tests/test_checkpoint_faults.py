"""Checkpoints under faults: a full disk, a flipped bit, a dangling ``latest``. Nothing complete is ever lost.

The disk is a real, small tmpfs mounted for the test (root only; skipped otherwise), so the failures are the ones
PyTorch and DeepSpeed really raise there, not simulated ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tools.launcher import PYTHON, run, torchrun

TINY = ["recipe=tiny_llama", "train.log_interval=1", "train.eval_interval=0", "wandb.enabled=false",
        "checkpoint.interval=2", "checkpoint.keep_last=3"]
CKPT_FILES_MB = 4.3  # one checkpoint of the tiny Llama: 2 x 2.1 MB of optimizer states plus small files


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.fixture
def small_disk(tmp_path):
    """A 10 MB tmpfs: room for two checkpoints of the tiny model, not three."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_fails_clearly_removes_the_partial_save_and_keeps_latest(small_disk, shakespeare):
    args = [*TINY, "train.steps=6", f"run.output_dir={small_disk}", "run.name=full",
            f"data.train.0.path={shakespeare}"]
    proc = torchrun(2, "train.py", *args, check=False, timeout=900)
    out = proc.stdout + proc.stderr
    root = small_disk / "full" / "checkpoints"
    assert proc.returncode != 0, out
    assert f"no space left on {small_disk} while saving {root / 'step_00000006'}" in out, out[-3000:]
    assert "free, about" in out and "the partial save was removed and latest still points at step_00000004" in out
    assert "zerotrain/checkpoint.py\", line" not in out, "a clear message, not a traceback through our code"
    assert (root / "latest").read_text() == "step_00000004"
    assert not list(root.glob(".*partial")), "the partial save must be removed: it would keep the disk full"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000004"]

    # With room again the same command resumes from step 4 and finishes.
    subprocess.run(["mount", "-o", "remount,size=40m", str(small_disk)], check=True)
    again = torchrun(2, "train.py", *args, timeout=900)
    assert "resumed from" in again.stdout + again.stderr
    assert sorted(losses(small_disk / "full")) == [1, 2, 3, 4, 5, 6]
    assert (root / "latest").read_text() == "step_00000006"


def test_low_space_skip_policy_skips_the_save_and_the_run_completes(small_disk, shakespeare):
    proc = run([PYTHON, "train.py", *TINY, "train.steps=6", "checkpoint.low_space=skip",
                        f"run.output_dir={small_disk}", "run.name=skip", f"data.train.0.path={shakespeare}"],
                       timeout=600)
    out = proc.stdout + proc.stderr
    root = small_disk / "skip" / "checkpoints"
    assert "skipping the checkpoint of step step_00000006 (checkpoint.low_space=skip); latest stays at " \
           "step_00000004" in out, out[-3000:]
    assert (root / "latest").read_text() == "step_00000004" and not list(root.glob(".*partial"))


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory, shakespeare):
    out = tmp_path_factory.mktemp("runs")
    run([PYTHON, "train.py", *TINY, "train.steps=2", f"run.output_dir={out}", "run.name=base",
                 f"data.train.0.path={shakespeare}"], timeout=600)
    return out / "base"


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / run_dir.name
    shutil.copytree(run_dir, copy)
    return copy


def _resume(run_dir: Path, shakespeare: Path, *extra: str) -> subprocess.CompletedProcess:
    return run([PYTHON, "train.py", *TINY, "train.steps=3", f"run.output_dir={run_dir.parent}",
                        f"run.name={run_dir.name}", f"data.train.0.path={shakespeare}", *extra],
                       check=False, timeout=600)


def test_a_flipped_bit_in_an_optimizer_shard_is_caught_on_resume(one_rank_run, tmp_path, shakespeare):
    run_dir = _copy(one_rank_run, tmp_path)
    shard = run_dir / "checkpoints" / "step_00000002" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) * 3 // 4] ^= 0x10  # inside the fp32 Adam moments: same size, still unpickles
    shard.write_bytes(bytes(data))
    proc = _resume(run_dir, shakespeare)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"checkpoint file {shard} is corrupt: its CRC32 differs" in proc.stderr
    assert "Traceback" not in proc.stderr

    # The control: without verification the same checkpoint resumes silently (with different numbers).
    control = _resume(run_dir, shakespeare, "checkpoint.verify=false")
    assert control.returncode == 0 and "resumed from" in control.stdout + control.stderr


def test_latest_naming_a_missing_directory_is_reported_as_missing(one_rank_run, tmp_path, shakespeare):
    run_dir = _copy(one_rank_run, tmp_path)
    (run_dir / "checkpoints" / "latest").write_text("step_00000099")
    proc = _resume(run_dir, shakespeare)
    assert proc.returncode == 2
    assert "names step_00000099, but" in proc.stderr and "does not exist" in proc.stderr
    assert "Other complete checkpoints: step_00000002" in proc.stderr
    assert "interrupted while saving" not in proc.stderr


def test_a_partial_save_left_by_a_kill_is_removed_by_the_next_save(one_rank_run, tmp_path, shakespeare):
    run_dir = _copy(one_rank_run, tmp_path)
    stale = run_dir / "checkpoints" / ".step_00000003.partial"
    (stale / "zerotrain").mkdir(parents=True)
    (stale / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"half a file")
    proc = _resume(run_dir, shakespeare)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not stale.exists() and (run_dir / "checkpoints" / "latest").read_text() == "step_00000003"
