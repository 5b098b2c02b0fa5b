"""The resume plan's contract, in one process without an engine (the real resumes, same and other world size, run in
tests/test_training.py and tests/test_resume_resize.py): what the plan asks of the DeepSpeed config, and what
executing it does when there is nothing to load or when checkpoint.resume=false meets existing checkpoints."""

from __future__ import annotations

import dataclasses

import pytest

from zerotrain import checkpoint
from zerotrain.errors import CheckpointError


def plan(root, **section):
    cfg = dataclasses.replace(checkpoint.CheckpointConfig(), **section)
    return checkpoint.plan_resume(cfg, root, rank=0, world_size=1, micro_batch_size=1, grad_accum=1)


def test_a_run_without_checkpoints_plans_an_ordinary_start_and_loads_nothing(tmp_path):
    p = plan(tmp_path / "checkpoints")
    assert p.enabled and not p.universal and p.deepspeed_config == {}
    assert checkpoint.execute_resume(None, p, rank=0, world_size=1) is None  # no engine needed: nothing to load


def test_only_a_universal_resume_changes_the_deepspeed_config(tmp_path):
    universal = checkpoint.ResumePlan(tmp_path, enabled=True, verify=True, universal=True)
    assert universal.deepspeed_config == {"checkpoint": {"load_universal": True}}
    assert dataclasses.replace(universal, universal=False).deepspeed_config == {}


def test_resume_false_over_checkpoints_is_refused_when_executed_not_when_planned(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / checkpoint.LATEST).write_text(checkpoint.tag_for(4))
    p = plan(root, resume=False)  # the plan reads nothing with resume=false
    assert not p.enabled and p.deepspeed_config == {}
    with pytest.raises(CheckpointError, match=r"holds checkpoints and checkpoint.resume=false: refusing"):
        checkpoint.execute_resume(None, p, rank=0, world_size=1)
    (root / checkpoint.LATEST).unlink()  # negative control: no checkpoint, nothing to refuse
    assert checkpoint.execute_resume(None, p, rank=0, world_size=1) is None
