"""Resuming on a different number of ranks: a 4-rank run (hpZ 2) saved at step 4 continues on 2 ranks.

Two launches, shared by the tests through module-scoped fixtures: the uninterrupted 4-rank reference (which also
saves the step-4 checkpoint), and one 2-rank launch (tests/workers/resume_with_and_without_repair.py) that resumes a
copy of that checkpoint through train.py's ``main`` and then resumes another copy with the repair of DeepSpeed's
universal load switched off (the negative control). Everything else (the refusals, the command-line conversion, the
checksums of the universal copy) runs in this process on the reference's checkpoint: conversion needs no process
group.

Tolerance, measured (fp32, tiny Llama, 8 steps): an uninterrupted 2-rank run with twice the accumulation differs
from the 4-rank one by at most 9.5e-7 per step (another summation order); the 4 -> 2 resume differs by at most
4.8e-7 (one ulp at a loss of 7). Without the repair it drifts to 8.4e-3 by step 8. TOLERANCE sits between.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tools.launcher import torchrun
from zerotrain import checkpoint, checkpoint_convert, durable
from zerotrain.errors import CheckpointError

STEPS, SAVED = 8, 4
ARGS = ["recipe=tiny_llama", f"train.steps={STEPS}", "train.log_interval=1", "train.eval_interval=0",
        "schedule.warmup_steps=4", "optim.lr=3e-3", f"checkpoint.interval={SAVED}", "checkpoint.keep_last=3",
        "wandb.enabled=false"]
TOLERANCE = 5e-6  # 5x the measured world-size noise, 1700x below the drift without the repair
# tiny_llama: train.micro_batch_size=4, grad_accum=1 on 4 ranks = 16 sequences; on 2 ranks grad_accum=2 keeps it
ON_TWO_RANKS = ["train.grad_accum=2"]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def loader_state(run_dir: Path, step: int) -> dict:
    rank0 = run_dir / "checkpoints" / checkpoint.tag_for(step) / checkpoint.OURS / "rank_00000.pt"
    return torch.load(rank0, weights_only=False)["loader"]


def crc_manifest(tag_dir: Path) -> dict[str, int]:
    """Every file under a checkpoint directory with its CRC32, as it is on disk now."""
    return {str(p.relative_to(tag_dir)): durable.file_crc32(p) for p in sorted(tag_dir.rglob("*")) if p.is_file()}


def at_saved_step(reference: Path, dest: Path) -> Path:
    """A copy of the reference run as it was when it saved step SAVED (latest pointing there, no later files)."""
    shutil.copytree(reference, dest)
    root = dest / "checkpoints"
    for later in (p for p in root.glob("step_*") if p.name != checkpoint.tag_for(SAVED)):
        shutil.rmtree(later)
    durable.atomic_write_text(root / checkpoint.LATEST, checkpoint.tag_for(SAVED))
    (dest / "metrics.jsonl").unlink()
    return dest


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shakespeare):
    """4 ranks, hpZ 2, 8 steps in one go, checkpoints at steps 4 and 8."""
    out = tmp_path_factory.mktemp("runs")
    torchrun(4, "train.py", *ARGS, f"run.output_dir={out}", "run.name=four", f"data.train.0.path={shakespeare}",
             timeout=900)
    return out / "four"


@pytest.fixture(scope="module")
def resumes(reference, tmp_path_factory, shakespeare) -> dict:
    """The step-4 checkpoint of the reference resumed on 2 ranks to step 8 (converted automatically), ``resized``,
    and the same resume of another copy with zerotrain.checkpoint.universal.repair switched off, ``unrepaired``."""
    runs = {name: at_saved_step(reference, tmp_path_factory.mktemp(name) / "two") for name in ("resized", "unrepaired")}
    source = runs["resized"] / "checkpoints" / checkpoint.tag_for(SAVED)
    before = crc_manifest(source)
    args = [" ".join([*ARGS, *ON_TWO_RANKS, f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}",
                      f"data.train.0.path={shakespeare}"]) for run_dir in runs.values()]
    proc = torchrun(2, "tests/workers/resume_with_and_without_repair.py", *args, timeout=900)
    return {**runs, "before": before, "after": crc_manifest(source), "log": proc.stdout + proc.stderr}


@pytest.fixture(scope="module")
def resized(resumes):
    return resumes["resized"], resumes["before"], resumes["after"], resumes["log"]


@pytest.fixture(scope="module")
def unrepaired(resumes):
    return resumes["unrepaired"], resumes["log"]


def test_resume_on_two_ranks_continues_the_four_rank_curve(reference, resized):
    run_dir, _, _, log = resized
    tag_dir = run_dir / "checkpoints" / checkpoint.tag_for(SAVED)
    assert f"converted {tag_dir} (4 ranks) to the universal checkpoint" in log, log[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / checkpoint.tag_for(SAVED)} at step {SAVED}" in log
    expected, got = losses(reference), losses(run_dir)
    assert sorted(got) == list(range(SAVED + 1, STEPS + 1)), "the resume starts at the step after the checkpoint"
    worst = max(abs(got[s] - expected[s]) for s in got)
    assert worst <= TOLERANCE, f"resumed curve differs by {worst:.2e}: {got} vs {expected}"


def test_the_repair_of_deepspeeds_universal_load_is_what_keeps_the_curve(reference, unrepaired):
    run_dir = unrepaired[0]
    expected, got = losses(reference), losses(run_dir)
    drift = max(abs(got[s] - expected[s]) for s in got)
    assert drift > 100 * TOLERANCE, f"without the repair the curve should drift; it differs by {drift:.2e} only"


def test_data_position_is_kept_in_global_samples(reference, resized):
    run_dir = resized[0]
    # Every rank of the new world starts where the old world stopped, counted in samples of all ranks together...
    universal = checkpoint.universal_dir(run_dir / "checkpoints", checkpoint.tag_for(SAVED))
    assert not universal.parent.exists(), "the next save removes the universal copy: it served its one resume"
    assert loader_state(reference, SAVED)["samples_seen"] == SAVED * 16
    # ...and after the same number of steps both worlds have taken the same samples (the losses show which ones).
    assert loader_state(run_dir, STEPS) == loader_state(reference, STEPS)
    assert loader_state(run_dir, STEPS)["samples_seen"] == STEPS * 16
    meta = json.loads((run_dir / "checkpoints" / checkpoint.tag_for(STEPS) / "zerotrain" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["tokens"] == STEPS * 16 * 128


def test_the_original_checkpoint_is_not_touched(resized):
    _, before, after, _ = resized
    assert before == after, "the conversion reads the 4-rank checkpoint and writes only beside it"


# ----------------------------------------------------------------------------------------------------------------
# In this process, on the reference's step-4 checkpoint
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def saved(reference, tmp_path) -> Path:
    return at_saved_step(reference, tmp_path / "four") / "checkpoints"


def test_resuming_with_another_global_batch_is_refused_with_the_override_that_keeps_it(saved):
    with pytest.raises(CheckpointError) as e:
        checkpoint.prepare_resume(saved, rank=0, world_size=2, micro_batch_size=4, grad_accum=1)
    assert "global batch of 16 sequences" in str(e.value) and "relaunch with train.grad_accum=2" in str(e.value)
    assert not (saved / checkpoint.UNIVERSAL).exists()


def test_convert_on_resize_false_refuses_and_names_the_command(saved):
    with pytest.raises(CheckpointError) as e:
        checkpoint.prepare_resume(saved, rank=0, world_size=2, micro_batch_size=4, grad_accum=2,
                                          convert_on_resize=False)
    assert f"python -m zerotrain.checkpoint_convert {saved.parent}" in str(e.value)
    assert not (saved / checkpoint.UNIVERSAL).exists()


def test_a_corrupt_source_file_is_named_and_nothing_is_converted(saved):
    # Emulated here as rank 0 of 2, which checks old ranks 0 and 2's files (each new rank checks its share).
    shard = saved / checkpoint.tag_for(SAVED) / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) * 3 // 4] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {shard} is corrupt: its CRC32 differs")):
        checkpoint.prepare_resume(saved, rank=0, world_size=2, micro_batch_size=4, grad_accum=2)
    assert not (saved / checkpoint.UNIVERSAL).exists() or not any((saved / checkpoint.UNIVERSAL).iterdir())


def test_command_line_conversion_writes_a_checksummed_copy_once(saved, capsys):
    assert checkpoint_convert.main([str(saved.parent)]) == 0
    copy = checkpoint.universal_dir(saved, checkpoint.tag_for(SAVED))
    assert f"universal checkpoint: {copy}" in capsys.readouterr().out
    meta = checkpoint.read_meta(copy, verify_rank=0, world_size=1)  # every file of the copy against its CRC32
    assert meta["universal"]["source_world_size"] == 4 and meta["step"] == SAVED
    assert any(name.startswith("zero/model.layers.0.") and name.endswith("/exp_avg.pt") for name in meta["files"])
    assert (saved / checkpoint.UNIVERSAL / "latest_universal").read_text() == copy.name
    assert not list((saved / checkpoint.UNIVERSAL).glob(".*")), "no staging directory left behind"
    # The resume finds the copy current and does not convert again.
    stamp = (copy / "zerotrain" / "meta.json").stat().st_mtime_ns
    assert checkpoint.prepare_resume(saved, rank=0, world_size=2, micro_batch_size=4, grad_accum=2)
    assert (copy / "zerotrain" / "meta.json").stat().st_mtime_ns == stamp

    # A flipped bit in the copy is caught like one in any checkpoint, naming the remedy.
    moment = next(copy.glob("zero/model.layers.0.mlp.up_proj.weight/exp_avg.pt"))
    data = bytearray(moment.read_bytes())
    data[len(data) * 3 // 4] ^= 0x10
    moment.write_bytes(bytes(data))
    remedy = f"{re.escape(str(moment))} is corrupt.*Delete {re.escape(str(copy))} and relaunch"
    with pytest.raises(CheckpointError, match=remedy):
        checkpoint.read_meta(copy, verify_rank=0, world_size=1)


def test_same_world_size_needs_no_conversion(saved):
    assert not checkpoint.prepare_resume(saved, rank=0, world_size=4, micro_batch_size=4, grad_accum=1)
    assert not (saved / checkpoint.UNIVERSAL).exists()
