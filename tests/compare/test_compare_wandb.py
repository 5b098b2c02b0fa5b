"""A real W&B offline run, written in-process by the trainer's own MetricsLogger (metrics.jsonl + W&B), killed and
resumed like a requeued job, then read back from its run-*.wandb transaction logs: the W&B curve equals the
metrics.jsonl curve exactly (the parity check passes between the two sources)."""

from __future__ import annotations

import math
import shutil

import pytest
from omegaconf import OmegaConf

from compare_helpers import record
from zerotrain import compare
from zerotrain.compare import CompareError
from zerotrain.config import as_container
from zerotrain.loggers import MetricsLogger
from zerotrain.run_config import Config

LOSSES = {1: 2.5, 2: 2.25, 3: 1.0 / 3.0, 4: 2.0, 5: math.nan, 6: 0.1 + 0.2}


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    """Run directory: steps 1-5 logged, 'preempted' after the step-3 checkpoint, resumed: steps 4-6 logged again
    with other values (the second launch recomputes them). W&B keeps both copies of steps 4-5; metrics.jsonl is
    trimmed on resume."""
    work = tmp_path_factory.mktemp("wandb_offline")
    with pytest.MonkeyPatch.context() as mp:
        for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
            mp.setenv(var, str(work / sub))
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_DISABLE_GIT", "true")
        mp.setenv("WANDB_CONSOLE", "off")
        mp.setenv("WANDB_X_DISABLE_STATS", "true")  # no system-metrics sampler: faster start and finish
        mp.setenv("WANDB_X_DISABLE_META", "true")
        cfg = OmegaConf.structured(Config)
        cfg.run.name, cfg.run.output_dir = "cmp-run", str(work)
        cfg.wandb.mode, cfg.wandb.group, cfg.wandb.project = "offline", "cmp-group", "zerotrain-test"
        cfg.train.steps = 6
        run_dir = work / cfg.run.name
        run_dir.mkdir()

        sections = {"run_name": cfg.run.name, "run_config": as_container(cfg), "total_steps": cfg.train.steps}
        wandb = OmegaConf.to_object(cfg.wandb)
        first = MetricsLogger(wandb, run_dir, is_main=True, resume_step=None, wandb_run_id=None, **sections)
        run_id = first.wandb_run_id
        for step in range(1, 6):
            first.log_train(step, metrics(step, LOSSES[step] + 1.0 if step >= 4 else LOSSES[step]))
        first.log_event(3, {"val/loss": 1.75, "val/ppl": math.exp(1.75)}, "validation")
        first.close()

        second = MetricsLogger(wandb, run_dir, is_main=True, resume_step=3, wandb_run_id=run_id, **sections)
        for step in range(4, 7):
            second.log_train(step, metrics(step, LOSSES[step]))
        second.close()
    return run_dir


def metrics(step: int, loss: float) -> dict:
    out = record(step, loss, step_time=0.5 + 0.125 * step)
    del out["step"]
    return out


def test_offline_run_reads_back_exactly(wandb_run):
    files = compare.wandb_files(wandb_run)
    assert len(files) == 2 and all(f.name.startswith("run-") for f in files)  # one per launch, oldest first
    run = compare.load_run_dir(wandb_run, source="wandb")
    assert run.group == "cmp-group" and run.replaced == 2  # steps 4 and 5, logged again after the restart
    assert run.steps == [1, 2, 3, 4, 5, 6]
    for step, loss in zip(run.steps, run.losses):
        assert loss == LOSSES[step] or (math.isnan(loss) and math.isnan(LOSSES[step])), step
    assert run.first_bad() == (5, "NaN") and run.val == [(3, 1.75)]
    assert run.records[0]["mfu"] is None and run.records[0]["tokens_per_s"] == pytest.approx(1000 / 0.625)
    assert run.elapsed()[-1] == pytest.approx(sum(0.5 + 0.125 * s for s in range(1, 7)))


def test_wandb_and_jsonl_agree_bitwise(wandb_run):
    jsonl = compare.load_run_dir(wandb_run, name="jsonl", source="jsonl")
    wandb = compare.load_run_dir(wandb_run, name="wandb", source="wandb")
    parity = compare.check_parity(jsonl, wandb)
    assert parity.ok, parity.message
    assert compare.check_parity(jsonl, wandb, key="step_time_s").ok
    # Without metrics.jsonl the directory falls back to its W&B files.
    (wandb_run / "metrics.jsonl").rename(wandb_run / "metrics.jsonl.bak")
    try:
        assert compare.load_run_dir(wandb_run).losses[:4] == jsonl.losses[:4]
    finally:
        (wandb_run / "metrics.jsonl.bak").rename(wandb_run / "metrics.jsonl")


def test_truncated_and_foreign_files(wandb_run, tmp_path):
    last = compare.wandb_files(wandb_run)[-1]
    full = compare.read_wandb_file(last)
    cut = tmp_path / last.name
    data = last.read_bytes()
    cut.write_bytes(data[: data.rfind(b"train/step")])  # killed while writing its last history record
    partial = compare.read_wandb_file(cut)
    assert partial.run_id == full.run_id and partial.rows == full.rows[:-1] and len(full.rows) == 3

    foreign = tmp_path / "run-x.wandb"
    foreign.write_bytes(b"not a wandb file at all")
    with pytest.raises(CompareError, match="not a W&B run file"):
        compare.read_wandb_file(foreign)


def test_local_group_finds_offline_run_without_config(wandb_run, tmp_path):
    root = tmp_path / "runs"
    shutil.copytree(wandb_run / "wandb", root / "only-wandb" / "wandb", symlinks=True)
    (root / "unrelated").mkdir(parents=True)
    runs = compare.find_local_group(root, "cmp-group")
    assert [r.name for r in runs] == ["only-wandb"] and runs[0].steps == [1, 2, 3, 4, 5, 6]
