"""hpz.emulate_async=true: the key, its refusal on a GPU, and train.py on 4 ranks under the emulator.

The end-to-end part is two short train.py launches (tiny Llama, hpZ 2 over 2 emulated nodes of 2, gradient
accumulation 2, overlap_comm on so that DeepSpeed gathers on a stream of its own): ``stock`` records races in
metrics.jsonl (from step 2: the first step whose shards are built in fresh memory), its per-rank reports and its
summary line, ``ordered`` none while its shard writes were really deferred and waited for.
"""

from __future__ import annotations

import json
from pathlib import Path

import deepspeed.accelerator as ds_accelerator
import pytest

from tools.launcher import torchrun
from zerotrain import run_config
from zerotrain.errors import ConfigError
from zerotrain.hpz import async_emulator
from zerotrain.hpz.config import HpzConfig
from zerotrain.hpz.emulated_run import REPORT_DIR, EmulatedRun, race_position

STEPS = 3
MODES = ("stock", "ordered")


def test_emulate_async_is_a_key_of_the_hpz_section_off_by_default():
    assert run_config.parse_args(["recipe=tiny_llama"]).hpz.emulate_async is False
    assert run_config.parse_args(["recipe=tiny_llama", "hpz.emulate_async=true"]).hpz.emulate_async is True


def test_emulate_async_off_installs_nothing():
    assert EmulatedRun.start(HpzConfig(), {"stage": 3}) is None and not async_emulator.is_installed()


def test_emulate_async_on_a_gpu_is_a_config_error_naming_the_key(monkeypatch):
    class Cuda:
        _name = "cuda"

    monkeypatch.setattr(ds_accelerator, "get_accelerator", lambda: Cuda())
    with pytest.raises(ConfigError, match=r"hpz.emulate_async=true: .*'cuda'.*run on the CPU"):
        EmulatedRun.start(HpzConfig(emulate_async=True), {"stage": 3})
    assert not async_emulator.is_installed()


def test_race_position_is_the_trainers_step_and_micro_batch():
    # The labels carry DeepSpeed's global_steps (steps completed); the trainer logs 1-based steps.
    assert race_position("train backward step 0 micro 1") == (1, 1)
    assert race_position("train step 4 micro 0") == (5, 0)
    assert race_position("eval forward step 3") == (3, -1)
    assert race_position("") is None and race_position("my phase") is None


def metrics(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def emulated_runs(tmp_path_factory, shakespeare) -> dict[str, tuple[Path, str]]:
    out = tmp_path_factory.mktemp("emulated")
    runs = {}
    for mode in MODES:
        proc = torchrun(4, "train.py", "recipe=tiny_llama", "hpz.emulate_async=true", f"hpz.mode={mode}",
                        "zero.overlap_comm=true", f"train.steps={STEPS}", "train.grad_accum=2",
                        "train.log_interval=1", "train.eval_interval=0", "checkpoint.save_final=false",
                        "wandb.enabled=false", f"run.output_dir={out}", f"run.name={mode}",
                        f"data.train.0.path={shakespeare}", timeout=900)
        runs[mode] = out / mode, proc.stdout + proc.stderr
    return runs


def test_train_py_under_the_emulator_logs_races_for_stock_and_none_for_ordered(emulated_runs):
    stock, ordered = metrics(emulated_runs["stock"][0]), metrics(emulated_runs["ordered"][0])
    assert [r["step"] for r in stock] == [r["step"] for r in ordered] == list(range(1, STEPS + 1))
    # Step 1 reads the shards built while the engine was set up (complete: DeepSpeed synchronised since). The
    # first optimizer step drops them; step 2's forward rebuilds them in fresh memory and its first backward reads
    # them unordered: every rank races there, and the poison costs the step (DeepSpeed skips it: grad norm inf).
    assert stock[0]["hpz/races"] == 0 and "hpz/first_race_step" not in stock[0]
    assert stock[1]["hpz/races"] > 0 and stock[1]["hpz/racing_ranks"] == 4
    assert all(r["hpz/first_race_step"] == 2 and r["hpz/first_race_micro"] == 0 for r in stock[1:])
    assert stock[1]["skipped_steps"] == 1 and ordered[-1]["skipped_steps"] == 0
    assert not any("hpz/first_race_step" in r for r in ordered)
    assert stock[-1]["hpz/races_total"] == sum(r["hpz/races"] + r["hpz/freed_source_races"] for r in stock)
    assert all(r["hpz/races"] == r["hpz/freed_source_races"] == r["hpz/racing_ranks"] == 0 for r in ordered)
    assert ordered[-1]["hpz/races_total"] == 0
    # The emulator was at work in both: shard writes deferred in every step that built shards, and ordered really
    # waited for them.
    assert all(r["hpz/deferred_writes"] > 0 for r in ordered + stock[:2])  # stock step 3: step 2 skipped, no rebuild
    assert all(r["hpz/waits_issued"] > 0 and r["hpz/host_syncs"] == 0 for r in ordered)


def test_each_rank_writes_its_emulator_report_and_rank_0_logs_a_summary(emulated_runs):
    for mode in MODES:
        run_dir, output = emulated_runs[mode]
        reports = [json.loads((run_dir / REPORT_DIR / f"rank_{r}.json").read_text()) for r in range(4)]
        assert [rep["rank"] for rep in reports] == [0, 1, 2, 3]
        if mode == "stock":
            assert all(rep["report"]["races"] > 0 and rep["races"] for rep in reports)
            assert all(any("backward" in where for where in rep["report"]["races_by_where"]) for rep in reports)
        else:
            assert all(rep["report"]["races"] == 0 and not rep["races"] for rep in reports)
        total = metrics(run_dir)[-1]["hpz/races_total"]
        assert f"racy shard accesses since start: {total} on all 4 ranks" in output
        assert ("first race in step 2 micro-batch 0" in output) == (mode == "stock")
