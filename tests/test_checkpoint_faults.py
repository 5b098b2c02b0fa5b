"""Checkpoints under faults: a full disk, a flipped bit, a dangling ``latest``, a relaunch of a finished run or with
a changed config. Nothing complete is ever lost, and a relaunch that has nothing to do, or cannot work, writes nothing.

The disk is a real, small tmpfs mounted for the test (root only; skipped otherwise), so the failures are the ones
PyTorch and DeepSpeed really raise there, not simulated ones.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tools.launcher import PYTHON, run, torchrun
from zerotrain import config
from zerotrain.errors import StorageError
from zerotrain.run_config import compose

TINY = ["recipe=tiny_llama", "train.log_interval=1", "train.eval_interval=0", "wandb.enabled=false",
        "checkpoint.interval=2", "checkpoint.keep_last=3"]
CKPT_FILES_MB = 4.3  # one checkpoint of the tiny Llama: 2 x 2.1 MB of optimizer states plus small files


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def flip_a_bit(shard: Path) -> bytes:
    """Flip one bit inside the fp32 Adam moments (same size, still unpickles); returns the original bytes."""
    original = shard.read_bytes()
    data = bytearray(original)
    data[len(data) * 3 // 4] ^= 0x10
    shard.write_bytes(bytes(data))
    return original


def test_full_disk_fails_clearly_removes_the_partial_save_and_keeps_latest(small_disk, shakespeare):
    """Also, on the checkpoints this 2-rank run leaves: a flipped bit in rank 1's shard is named by the process that
    prints (rank 0), and a relaunch with a lower checkpoint.keep_last, as the message advises, makes room first."""
    args = [*TINY, "train.steps=6", f"run.output_dir={small_disk}", "run.name=full",
            f"data.train.0.path={shakespeare}"]
    proc = torchrun(2, "train.py", *args, check=False, timeout=900)
    out = proc.stdout + proc.stderr
    root = small_disk / "full" / "checkpoints"
    assert proc.returncode != 0, out
    assert f"no space left on {small_disk} while saving {root / 'step_00000006'}" in out, out[-3000:]
    assert "free, about" in out and "the partial save was removed and latest still points at step_00000004" in out
    traceback_frame = r"zerotrain/checkpoint/\w+\.py\", line"
    assert not re.search(traceback_frame, out), "a clear message, not a traceback through our code"
    assert (root / "latest").read_text() == "step_00000004"
    assert not list(root.glob(".*partial")), "the partial save must be removed: it would keep the disk full"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000004"]

    assert "lower checkpoint.keep_last (a save short of space first deletes the oldest checkpoints down to " \
           "keep_last - 1, never latest)" in out
    # The control of the relaunch below: with keep_last=3 nothing was deleted before the save (step 2 is still here).

    # Rank 1 verifies its own shards on resume; under torchrun only rank 0 prints, and it names rank 1's file.
    shard = root / "step_00000004" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    original = flip_a_bit(shard)
    relaunch = [*args, "checkpoint.keep_last=1"]
    corrupt = run([PYTHON, "-m", "zerotrain.launch.torchrun", "--standalone", "--nproc_per_node=2", "train.py",
                   *relaunch], check=False, timeout=900)
    out = corrupt.stdout + corrupt.stderr
    assert corrupt.returncode == 2, out[-3000:]
    named = rf"error: checkpoint file {re.escape(str(shard))} is corrupt: its CRC32 differs from the one recorded"
    assert re.search(named + r" when it was written \([0-9a-f]{8}, recorded [0-9a-f]{8}: a flipped bit", out), out
    assert "on another rank (see its message)" not in out and "Traceback" not in out
    shard.write_bytes(original)

    # The same disk, relaunched with checkpoint.keep_last=1: step 2 goes before the save of step 6, which fits.
    again = torchrun(2, "train.py", *relaunch, timeout=900)
    out = again.stdout + again.stderr
    assert "resumed from" in out and "free before saving step_00000006: deleted step_00000002 first " \
           "(checkpoint.keep_last=1), latest stays at step_00000004" in out, out[-3000:]
    assert sorted(losses(small_disk / "full")) == [1, 2, 3, 4, 5, 6]
    assert (root / "latest").read_text() == "step_00000006"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000006"]


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
    flip_a_bit(shard)
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


def snapshot(run_dir: Path) -> dict[str, tuple]:
    """Every path under the run directory with its kind, modification time and content hash."""
    return {str(p.relative_to(run_dir)): (p.is_dir(), p.stat().st_mtime_ns,
                                          None if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest())
            for p in [run_dir, *run_dir.rglob("*")]}


def test_relaunching_a_finished_run_says_so_and_writes_nothing(one_rank_run, tmp_path, shakespeare):
    run_dir = _copy(one_rank_run, tmp_path)
    before = snapshot(run_dir)
    args = [*TINY, f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}", f"data.train.0.path={shakespeare}"]
    # The same command, and one with keys a resume may change (logging, checkpointing, W&B).
    for extra in ([], ["train.log_interval=5", "checkpoint.keep_last=1", "wandb.tags=[again]"]):
        proc = run([PYTHON, "train.py", *args, "train.steps=2", *extra], check=False, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert (f"run {run_dir} is finished: its latest checkpoint {run_dir / 'checkpoints' / 'step_00000002'} is "
                f"at step 2 (train.steps=2). Nothing was written") in proc.stdout
        assert "world:" not in proc.stdout + proc.stderr, "it must stop before the process group exists"
        assert snapshot(run_dir) == before
    # The control: a relaunch with more steps resumes, and the snapshot sees what it writes.
    assert _resume(run_dir, shakespeare).returncode == 0
    after = snapshot(run_dir)
    assert after["config.yaml"] != before["config.yaml"] and "checkpoints/step_00000003" in after


def test_a_changed_model_shape_is_refused_before_anything_is_written(one_rank_run, tmp_path, shakespeare):
    run_dir = _copy(one_rank_run, tmp_path)
    before = snapshot(run_dir)
    proc = _resume(run_dir, shakespeare, "model.hidden_size=128", "optim.lr=1e-3")
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr
    assert f"run.name={run_dir.name} resumes from {run_dir / 'checkpoints' / 'step_00000002'}, but these keys" in err
    assert "model.hidden_size: 64 -> 128" in err and "optim.lr: " in err
    assert "(also changed, which is allowed: run.output_dir, train.steps)" in err and "Nothing was written" in err
    assert "Keys that may change on resume: run.output_dir, run.name, run.recipe, train.steps" in err
    assert "Traceback" not in err and "size of tensor" not in err
    assert snapshot(run_dir) == before, "config.yaml (and everything else) must be as it was"


def test_saving_the_config_on_a_full_disk_says_so_and_leaves_no_temporary(small_disk):
    cfg = compose("tiny_llama")
    target = small_disk / "run" / "config.yaml"
    config.save(cfg, target)
    saved = target.read_bytes()
    filler = small_disk / "filler"
    with open(filler, "wb", buffering=0) as f:  # fill the disk to the last block
        try:
            while True:
                f.write(b"\0" * (1 << 16))
        except OSError:
            pass
    with pytest.raises(StorageError, match=rf"no space left on {small_disk} while writing {target} \("):
        config.save(compose("tiny_llama", ["train.steps=7"]), target)
    assert target.read_bytes() == saved, "the old config must stay whole"
    assert sorted(p.name for p in target.parent.iterdir()) == ["config.yaml"], "no temporary may be left behind"
