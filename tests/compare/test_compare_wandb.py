"""A real W&B offline run, written in-process by the trainer's own MetricsLogger (metrics.jsonl + W&B), killed and
resumed like a requeued job, twice. The W&B run holds each step once (read back from W&B's own offline files);
tools.compare reads the run directory's metrics.jsonl; the rows the logger sent to W&B, read back through the
wandb.Api path (a stand-in for the server's history), give the same curve bitwise; a directory with only W&B's
binary files is refused with a message saying what to use instead."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from compare_helpers import FakeApi, FakeHistoryRun, offline_history, record
from omegaconf import OmegaConf
from wandb.sdk.wandb_run import Run as WandbRun

from tools import compare
from tools.compare import CompareError
from zerotrain import config
from zerotrain.config import as_container
from zerotrain.loggers import WANDB_STEP_KEY, MetricsLogger
from zerotrain.run_config import Config

LOSSES = {1: 2.5, 2: 2.25, 3: 1.0 / 3.0, 4: 2.0, 5: math.nan, 6: 0.1 + 0.2}
GROUP = "cmp-group"


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    """(run directory, the rows logged to W&B). Steps 1-5 logged, 'preempted' with the last checkpoint at step 3;
    resumed from it, killed again after step 4; resumed from it again, to the end. The launches recompute steps 4-5
    (with the same values, as the trainer does); metrics.jsonl is trimmed on each resume, and W&B, which cannot take
    rows back, is sent each step once."""
    work = tmp_path_factory.mktemp("wandb_offline")
    sent: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        for var, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
            mp.setenv(var, str(work / sub))
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_DISABLE_GIT", "true")
        mp.setenv("WANDB_CONSOLE", "off")
        mp.setenv("WANDB_X_DISABLE_STATS", "true")  # no system-metrics sampler: faster start and finish
        mp.setenv("WANDB_X_DISABLE_META", "true")
        real_log = WandbRun.log

        def recording_log(self, data, *args, **kwargs):  # records what goes to W&B, then logs it for real
            sent.append(dict(data))
            return real_log(self, data, *args, **kwargs)

        mp.setattr(WandbRun, "log", recording_log)
        cfg = OmegaConf.structured(Config)
        cfg.run.name, cfg.run.output_dir = "cmp-run", str(work)
        cfg.wandb.mode, cfg.wandb.group, cfg.wandb.project = "offline", GROUP, "zerotrain-test"
        cfg.train.steps = 6
        run_dir = work / cfg.run.name
        run_dir.mkdir()
        config.save(cfg, run_dir / "config.yaml")  # as the trainer does at start

        sections = {"run_name": cfg.run.name, "run_config": as_container(cfg), "total_steps": cfg.train.steps}
        wandb = OmegaConf.to_object(cfg.wandb)
        first = MetricsLogger(wandb, run_dir, is_main=True, resume_step=None, wandb_run_id=None, **sections)
        run_id = first.wandb_run_id
        for step in range(1, 6):
            first.log_train(step, metrics(step, LOSSES[step]))
            if step == 3:
                first.log_event(3, {"val/loss": 1.75, "val/ppl": math.exp(1.75)}, "validation")
        first.close()

        second = MetricsLogger(wandb, run_dir, is_main=True, resume_step=3, wandb_run_id=run_id, **sections)
        second.log_train(4, metrics(4, LOSSES[4]))
        second.close()

        third = MetricsLogger(wandb, run_dir, is_main=True, resume_step=3, wandb_run_id=run_id, **sections)
        for step in range(4, 7):
            third.log_train(step, metrics(step, LOSSES[step]))
        third.close()
    assert sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")), "the W&B offline run was not written"
    return run_dir, sent


def metrics(step: int, loss: float) -> dict:
    out = record(step, loss, step_time=0.5 + 0.125 * step)
    del out["step"]
    return out


def test_the_wandb_run_holds_each_step_once_after_two_resumes(wandb_run):
    run_dir, sent = wandb_run
    segments = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(segments) == 3, "one offline segment per launch"
    rows = [row for segment in segments for row in offline_history(segment)]
    train = [(row[WANDB_STEP_KEY], row["loss"]) for row in rows if "loss" in row]
    assert [step for step, _ in train] == [1, 2, 3, 4, 5, 6], train
    assert all(loss == LOSSES[step] or (math.isnan(loss) and math.isnan(LOSSES[step])) for step, loss in train)
    assert [(row[WANDB_STEP_KEY], row["val/loss"]) for row in rows if "val/loss" in row] == [(3, 1.75)]
    # The launches logged step 4 three times and step 5 twice; metrics.jsonl, trimmed on each resume, and W&B hold
    # them once (without the remembered mark the third launch would send step 5 again: its metrics.jsonl ended at 4).
    assert [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())] == \
        [1, 2, 3, 3, 4, 5, 6]
    assert len(sent) == len(rows) == 7


def test_resumed_run_reads_back_exactly_from_metrics_jsonl(wandb_run):
    run_dir, _ = wandb_run
    run = compare.load_run_dir(run_dir)
    assert run.group == GROUP and run.replaced == 0  # the group from config.yaml; the file was trimmed on resume
    assert run.steps == [1, 2, 3, 4, 5, 6]
    for step, loss in zip(run.steps, run.losses):
        assert loss == LOSSES[step] or (math.isnan(loss) and math.isnan(LOSSES[step])), step
    assert run.first_bad() == (5, "NaN") and run.val == [(3, 1.75)]
    assert run.records[0]["mfu"] is None and run.records[0]["tokens_per_s"] == pytest.approx(1000 / 0.625)
    assert run.elapsed()[-1] == pytest.approx(sum(0.5 + 0.125 * s for s in range(1, 7)))


def test_rows_sent_to_wandb_read_back_through_the_api_equal_metrics_jsonl_bitwise(wandb_run):
    run_dir, sent = wandb_run
    assert all(WANDB_STEP_KEY in row and "step" not in row for row in sent)
    # What scan_history returns for them: W&B's row counter _step (it keeps counting across the restart) + our keys.
    history = [{"_step": i, **row} for i, row in enumerate(sent)]
    api = FakeApi([FakeHistoryRun("cmp-run", history)])
    (from_wandb,) = compare.load_wandb_group("zerotrain-test", GROUP, api=api)
    assert from_wandb.replaced == 0  # steps 4 and 5, recomputed after the restarts, were not sent again
    from_jsonl = compare.load_run_dir(run_dir, name="jsonl")
    parity = compare.check_parity(from_jsonl, from_wandb)
    assert parity.ok, parity.message
    assert compare.check_parity(from_jsonl, from_wandb, key="step_time_s").ok
    assert from_wandb.val == from_jsonl.val == [(3, 1.75)]


def test_run_dir_with_only_wandb_files_is_refused_with_guidance(wandb_run, tmp_path, capsys):
    run_dir, _ = wandb_run
    only = tmp_path / "only-wandb"
    shutil.copytree(run_dir / "wandb", only / "wandb", symlinks=True)
    guidance = r"metrics\.jsonl.*--group GROUP --project PROJECT"
    with pytest.raises(CompareError, match=guidance):
        compare.load_run_dir(only)
    with pytest.raises(CompareError, match=guidance):
        compare.load_run_dir(next(only.glob("wandb/offline-run-*/run-*.wandb")))
    assert compare.main([str(only)]) == 2
    assert "W&B's binary run files are not read" in capsys.readouterr().err


def test_local_group_reads_config_yaml_and_skips_dirs_without_one(wandb_run, tmp_path):
    run_dir, _ = wandb_run
    root = tmp_path / "runs"
    shutil.copytree(run_dir, root / "with-config", symlinks=True)
    shutil.copytree(run_dir / "wandb", root / "only-wandb" / "wandb", symlinks=True)
    (root / "unrelated").mkdir(parents=True)
    runs = compare.find_local_group(root, GROUP)
    assert [r.name for r in runs] == ["with-config"] and runs[0].steps == [1, 2, 3, 4, 5, 6]
    with pytest.raises(CompareError, match="config.yaml naming W&B group 'other'"):
        compare.find_local_group(root, "other")
