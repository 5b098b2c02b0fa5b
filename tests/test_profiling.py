"""The ``profile`` section, NCCL's flight recorder key and the step-time breakdown, without a launch (fast tier).

The launched checks (one trace per rank of a 4-rank hpZ run, the breakdown's keys in its metrics.jsonl) ride on the
runs tests/test_training.py already launches.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerAction

from zerotrain import profiling, run_config, step_timing
from zerotrain.config import ConfigError
from zerotrain.distributed import flight_recorder_env


@pytest.mark.parametrize("override, expected", [
    ("profile.steps=[-1]", "profile.steps=[-1] is out of range: item 0 (-1) must be >= 1"),
    ("profile.steps=[3,0]", "profile.steps=[3,0] is out of range: item 1 (0) must be >= 1"),
    ("profile.memory_snapshot_steps=[0]", "profile.memory_snapshot_steps=[0] is out of range"),
    ("profile.active=0", "profile.active=0 is out of range: it must be >= 1"),
    ("profile.wait=-1", "profile.wait=-1 is out of range: it must be >= 0"),
    ("cluster.nccl_flight_recorder=-5", "cluster.nccl_flight_recorder=-5 is out of range"),
    ("profile.with_stak=true", "profile.with_stak"),
])
def test_bad_profile_values_are_refused_naming_the_key(override, expected):
    with pytest.raises(ConfigError) as err:
        run_config.compose("tiny_llama", [override])
    assert expected in str(err.value), str(err.value)


def test_profiling_is_off_by_default_and_composes_when_asked_for():
    default = run_config.parse_args(["recipe=tiny_llama"])
    assert not default.profile.active_any and default.cluster.nccl_flight_recorder == 0
    cfg = run_config.parse_args(["recipe=tiny_llama", "profile.enabled=true", "profile.steps=[3,4]",
                                 "profile.record_shapes=true", "profile.memory_snapshot_on_oom=true"])
    assert cfg.profile.active_any and cfg.profile.steps == [3, 4] and cfg.profile.wants_memory_history


def test_step_schedule_records_exactly_the_chosen_steps_one_trace_per_consecutive_run():
    # Profiler step k is training step 2 + k (a launch resumed after step 1).
    action = profiling.step_schedule([3, 4, 7], first_step=2)
    got = {2 + k: action(k) for k in range(8)}
    assert got == {2: ProfilerAction.WARMUP, 3: ProfilerAction.RECORD, 4: ProfilerAction.RECORD_AND_SAVE,
                   5: ProfilerAction.NONE, 6: ProfilerAction.WARMUP, 7: ProfilerAction.RECORD_AND_SAVE,
                   8: ProfilerAction.NONE, 9: ProfilerAction.NONE}


def test_trace_range_is_a_named_range_only_while_a_profiler_records():
    assert isinstance(profiling.trace_range("x"), type(profiling._NO_RANGE))  # nothing to pay when off
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with profiling.trace_range("zerotrain/test_range"):
            torch.ones(4).sum()
    assert "zerotrain/test_range" in {e.name for e in prof.events()}


def test_flight_recorder_env_names_the_buffer_the_dump_and_its_place(tmp_path):
    assert flight_recorder_env(0, tmp_path) == {}
    env = flight_recorder_env(2000, tmp_path / "run")
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == env["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert Path(env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]) == (tmp_path / "run" / "nccl_flight_recorder" / "rank_")


def test_host_breakdown_shares_take_comm_wait_out_of_its_phase():
    spent: dict[str, float] = {}

    def sleep(what: str, seconds: float) -> None:  # what each part really took (a loaded machine oversleeps)
        started = time.perf_counter()
        time.sleep(seconds)
        spent[what] = spent.get(what, 0.0) + time.perf_counter() - started

    times = step_timing.StepTimes("cpu")
    started = time.perf_counter()
    with times.step():
        with times.phase("forward"):
            sleep("forward", 0.02)
            times.timed(sleep, "comm_wait", 0.04)  # a collective waited on during forward
        with times.phase("backward"):
            sleep("backward", 0.06)
        with times.phase("optimizer"):
            sleep("optimizer", 0.02)
        sleep("none", 0.02)  # in no phase (data, bookkeeping)
    step = time.perf_counter() - started
    times.timed(time.sleep, 0.05)  # outside a step: not counted
    shares = times.read()
    assert set(shares) == set(step_timing.KEYS)
    assert all(0 <= v <= 1 for v in shares.values()) and sum(shares.values()) <= 1 + 1e-9
    assert sum(shares.values()) < 1 - spent["none"] / step + 0.01  # the part in no phase is in no share
    for key in ("forward", "comm_wait", "backward", "optimizer"):
        assert abs(shares[f"time/{key}_share"] - spent[key] / step) < 0.02, (shares, spent, step)
    assert times.read() == {}, "a read forgets the steps it reported"


def test_without_the_subtraction_forward_would_hold_the_wait():
    # Negative control: the same forward with the wait timed as a plain call shows it as forward time.
    times = step_timing.StepTimes("cpu")
    with times.step(), times.phase("forward"):
        time.sleep(0.02)
        time.sleep(0.04)
    shares = times.read()
    assert shares["time/comm_wait_share"] == 0 and shares["time/forward_share"] > 0.9


def _run_steps(profiler: profiling.Profiler, steps: range) -> None:
    for step in steps:
        profiler.begin(step)
        with profiling.trace_range(f"test/step_{step}"):
            torch.ones(64, 64) @ torch.ones(64, 64)
        profiler.end(step)
    profiler.close()


def test_profiler_writes_the_chosen_window_with_torchs_exporter_and_publishes_it(tmp_path):
    published = []
    cfg = profiling.ProfileConfig(enabled=True, steps=[2, 3], gzip=True, wandb_artifact=True)
    profiler = profiling.Profiler(cfg, tmp_path, rank=0, publish=lambda path, name: published.append((path, name)))
    _run_steps(profiler, range(1, 6))
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["profile/step_3/rank_0.json.gz"]  # no partial file left, one window
    names = {e.get("name") for e in json.loads(gzip.open(tmp_path / files[0]).read())["traceEvents"]}
    assert {"test/step_2", "test/step_3"} <= names and not names & {"test/step_1", "test/step_4"}
    assert published == [(tmp_path / files[0], "trace-step_3")]


def test_a_window_cut_short_by_the_end_of_the_run_is_written_at_close(tmp_path):
    profiler = profiling.Profiler(profiling.ProfileConfig(enabled=True, steps=[4, 5]), tmp_path, rank=3)
    _run_steps(profiler, range(1, 5))  # the run ends after step 4
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json")] == ["profile/step_4/rank_3.json"]
