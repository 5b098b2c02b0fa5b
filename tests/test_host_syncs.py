"""The training loop asks for no host sync of its own between logged lines (issue 19, item 4).

A real Trainer (2 CPU ranks, real DeepSpeed ZeRO-3) runs with every host-sync entry point patched to count its
caller (tests/workers/count_host_syncs.py). With train.log_interval=5, zerotrain's frames make no sync call at a
step that neither logs nor saves; with log_interval=1 (every step is a log step: what every step cost before) the
same counter sees zerotrain's syncs at every step, so it does see them.
"""

from __future__ import annotations

import json

import pytest

from tools.launcher import torchrun

STEPS = 10
HOST_SYNCS = ("Tensor.item", "Tensor.cpu", "Tensor.tolist", "Tensor.numpy", "Tensor.__bool__", "Tensor.__float__",
              "Tensor.__int__", "cuda.synchronize", "accelerator.synchronize")
# Known and not this loop's: the per-step agreement on a stop signal (launch/preemption.py _agree_max, a MAX
# all-reduce and .item() every step) is its own follow-up; it is listed, not counted.
NOT_COUNTED = ("zerotrain/launch/preemption.py:",)


def zerotrain_syncs_per_step(tmp_path, shakespeare, log_interval: int) -> tuple[dict[int, int], list[dict]]:
    out = tmp_path / f"syncs_{log_interval}.json"
    torchrun(2, "tests/workers/count_host_syncs.py", str(out), "recipe=tiny_llama", f"train.steps={STEPS}",
             f"train.log_interval={log_interval}", "train.eval_interval=0", "checkpoint.interval=0",
             "checkpoint.save_final=false", "wandb.enabled=false", f"run.output_dir={tmp_path}",
             f"run.name=syncs{log_interval}", f"data.train.0.path={shakespeare}", timeout=600)
    rows = json.loads(out.read_text())["rows"]
    per_step = {s: 0 for s in range(1, STEPS + 1)}
    for r in rows:
        if r["owner"] == "zerotrain" and r["kind"] in HOST_SYNCS and not r["where"].startswith(NOT_COUNTED):
            per_step[r["step"]] += r["calls"]
    return per_step, rows


@pytest.mark.parametrize("log_interval", [5, 1], ids=["fix", "control_every_step_logs"])
def test_no_host_sync_of_ours_between_log_steps(tmp_path, shakespeare, log_interval):
    per_step, rows = zerotrain_syncs_per_step(tmp_path, shakespeare, log_interval)
    ours = sorted({(r["kind"], r["where"]) for r in rows if r["owner"] == "zerotrain" and r["kind"] in HOST_SYNCS})
    log_steps = [s for s in per_step if s % log_interval == 0 or s == STEPS]
    assert all(per_step[s] >= 1 for s in log_steps), (per_step, ours)  # the counter sees our reduction
    if log_interval == 1:
        return  # the control: a sync at every step
    between = {s: n for s, n in per_step.items() if s not in log_steps}
    assert between and all(n == 0 for n in between.values()), (between, ours)
