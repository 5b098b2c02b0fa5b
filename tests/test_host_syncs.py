"""The training loop asks for no host sync of its own between logged lines (issue 19, item 4).

A real Trainer (2 CPU ranks, real DeepSpeed ZeRO-3) runs with every host-sync entry point patched to count its
caller (tests/workers/count_host_syncs.py). With train.log_interval=5, zerotrain's frames make no sync call at a
step that neither logs nor saves; with log_interval=1 (every step is a log step: what every step cost before) the
same counter sees zerotrain's syncs at every step, so it does see them. Both runs share one launch (the fix first,
so that it runs as in a fresh process; the control after it, in the same processes).
"""

from __future__ import annotations

import json

import pytest

from tools.launcher import torchrun

STEPS = 10
LOG_INTERVALS = (5, 1)  # the fix, then the control
HOST_SYNCS = ("Tensor.item", "Tensor.cpu", "Tensor.tolist", "Tensor.numpy", "Tensor.__bool__", "Tensor.__float__",
              "Tensor.__int__", "cuda.synchronize", "accelerator.synchronize")
# Known and not this loop's: the per-step agreement on a stop signal (launch/preemption.py _agree_max, a MAX
# all-reduce and .item() every step) is its own follow-up; it is listed, not counted.
NOT_COUNTED = ("zerotrain/launch/preemption.py:",)


@pytest.fixture(scope="module")
def rows_by_interval(tmp_path_factory, shakespeare) -> dict[int, list[dict]]:
    """Each log interval's counted calls, from one 2-rank launch training one run per interval."""
    tmp_path = tmp_path_factory.mktemp("host_syncs")
    out = tmp_path / "syncs.json"
    runs = [a for n in LOG_INTERVALS for a in ("+run", f"train.log_interval={n}", f"run.name=syncs{n}")]
    torchrun(2, "tests/workers/count_host_syncs.py", str(out), "recipe=tiny_llama", f"train.steps={STEPS}",
             "train.eval_interval=0", "checkpoint.interval=0", "checkpoint.save_final=false", "wandb.enabled=false",
             f"run.output_dir={tmp_path}", f"data.train.0.path={shakespeare}", *runs, timeout=600)
    results = json.loads(out.read_text())["runs"]
    assert [r["steps"] for r in results] == [STEPS] * len(LOG_INTERVALS)
    return {n: r["rows"] for n, r in zip(LOG_INTERVALS, results)}


def zerotrain_syncs_per_step(rows: list[dict]) -> dict[int, int]:
    per_step = {s: 0 for s in range(1, STEPS + 1)}
    for r in rows:
        if r["owner"] == "zerotrain" and r["kind"] in HOST_SYNCS and not r["where"].startswith(NOT_COUNTED):
            per_step[r["step"]] += r["calls"]
    return per_step


@pytest.mark.parametrize("log_interval", LOG_INTERVALS, ids=["fix", "control_every_step_logs"])
def test_no_host_sync_of_ours_between_log_steps(rows_by_interval, log_interval):
    rows = rows_by_interval[log_interval]
    per_step = zerotrain_syncs_per_step(rows)
    ours = sorted({(r["kind"], r["where"]) for r in rows if r["owner"] == "zerotrain" and r["kind"] in HOST_SYNCS})
    log_steps = [s for s in per_step if s % log_interval == 0 or s == STEPS]
    assert all(per_step[s] >= 1 for s in log_steps), (per_step, ours)  # the counter sees our reduction
    if log_interval == 1:
        return  # the control: a sync at every step
    between = {s: n for s, n in per_step.items() if s not in log_steps}
    assert between and all(n == 0 for n in between.values()), (between, ours)
