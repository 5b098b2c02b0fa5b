"""scripts/paper_sweep.sh --dry-run (no SLURM needed) and the paper recipes it submits: four variants of one recipe,
same seed and data, one W&B group; each variant's overrides compose into the intended ZeRO-3 / hpZ mode."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from tools.launcher import REPO
from zerotrain import config, run_config

SCRIPT = REPO / "scripts" / "paper_sweep.sh"
TRAIN_SBATCH = str(REPO / "slurm" / "train.sbatch")
MODELS = {"llama2_7b": 2, "llama2_7b_mmlu": 2, "llama2_13b": 2, "llama2_70b": 8, "falcon_7b": 2, "falcon_40b": 4}
VARIANTS = ["zero3", "hpz-legacy", "hpz-sync", "hpz-ordered"]  # the paper's baseline is DeepSpeed <= 0.13.4


def dry_run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    # --no-check: these tests look at the commands; the paper's data sets exist only on the cluster.
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", "--no-check", *args], capture_output=True, text=True,
                          check=check, timeout=60)


def commands(*args: str) -> list[list[str]]:
    return [shlex.split(line) for line in dry_run(*args).stdout.splitlines() if line.strip()]


def recipe_args(job: list[str]) -> tuple[str, list[str]]:
    at = job.index(TRAIN_SBATCH)
    return job[at + 1], job[at + 2:]


def option(job: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in job if a.startswith(f"--{name}=")]


def test_dry_run_prints_four_sbatch_commands_in_one_group():
    jobs = commands("--group", "paper-7b-t", "--time=2:00:00", "llama2_7b", "train.steps=20", "wandb.tags=[a b]")
    assert len(jobs) == 4
    names = []
    for job, variant in zip(jobs, VARIANTS):
        assert job[:2] == ["sbatch", "--parsable"]
        assert option(job, "nodes") == ["2"] and option(job, "gpus-per-node") == ["8"]
        assert option(job, "ntasks-per-node") == ["8"] and option(job, "time") == ["2:00:00"]
        recipe, overrides = recipe_args(job)
        assert recipe == "paper_llama2_7b"
        assert overrides[:2] == ["train.steps=20", "wandb.tags=[a b]"]  # common overrides, quoting kept
        assert "wandb.group=paper-7b-t" in overrides and f"wandb.name={variant}" in overrides
        assert not any(o.startswith(("run.seed=", "data.")) for o in overrides)  # same seed and data: the recipe's
        names.append(next(o for o in overrides if o.startswith("run.name=")))
    assert names == [f"run.name=paper-7b-t-{v}" for v in VARIANTS]


def test_node_count_per_model_and_overrides():
    for model, nodes in MODELS.items():
        jobs = commands("--group", "g", model)
        assert {tuple(option(j, "nodes")) for j in jobs} == {(str(nodes),)}, model
    jobs = commands("--group", "g", "--nodes", "3", "--variants", "zero3,hpz-ordered", "paper-falcon-40b")
    assert len(jobs) == 2 and all(option(j, "nodes") == ["3"] for j in jobs)
    assert recipe_args(jobs[0])[0] == "paper_falcon_40b"


def test_stock_is_not_the_default_but_can_be_asked_for():
    jobs = commands("--group", "g", "--variants", "hpz-stock,hpz-legacy", "llama2_7b")
    assert [[o for o in recipe_args(j)[1] if o.startswith("hpz.mode=")] for j in jobs] == [
        ["hpz.mode=stock"], ["hpz.mode=legacy"]]


def test_default_group_is_dated_and_shared():
    jobs = commands("falcon_7b")
    groups = {o for j in jobs for o in recipe_args(j)[1] if o.startswith("wandb.group=")}
    assert len(groups) == 1 and groups.pop().startswith("wandb.group=paper-falcon-7b-")


def test_unknown_model_is_refused():
    proc = dry_run("llama3_8b", check=False)
    assert proc.returncode == 2 and "unknown model 'llama3_8b'" in proc.stderr and not proc.stdout


@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_submitted_variant_composes_to_its_mode(model):
    """The overrides the sweep submits, composed as train.py would: the four runs differ only in ZeRO-3 vs hpZ,
    the hpZ mode and their names; the paper's optimizer, precision and cluster profile everywhere."""
    composed = {}
    for job, variant in zip(commands("--group", "g", model), VARIANTS):
        recipe, overrides = recipe_args(job)
        composed[variant] = run_config.compose(recipe, overrides)
    zero3 = composed["zero3"]
    assert zero3.zero.zero_hpz_partition_size == 1
    for mode in ("legacy", "sync", "ordered"):
        cfg = composed[f"hpz-{mode}"]
        assert cfg.zero.zero_hpz_partition_size == "auto" and cfg.hpz.mode == mode
    for cfg in composed.values():
        assert cfg.run.seed == zero3.run.seed and cfg.data == zero3.data and cfg.wandb.group == "g"
        assert cfg.model.pretrained_path and cfg.model.family in ("llama", "falcon")
        assert cfg.optim.lr == pytest.approx(2e-5) and list(cfg.optim.betas) == [0.9, 0.999]
        assert cfg.optim.eps == pytest.approx(1e-8) and cfg.optim.weight_decay == 0.0
        assert cfg.schedule.name == "constant" and cfg.schedule.warmup_steps > 0
        assert cfg.train.precision == "bf16" and cfg.cluster.name == "ethernet" and cfg.zero.stage == 3
        assert cfg.train.nan_policy == "continue"  # a diverging variant's NaN steps are logged
        assert comparable(cfg) == comparable(zero3)


def comparable(cfg) -> dict:
    """The config less what the variants are meant to differ in."""
    out = config.as_container(cfg)
    del out["zero"]["zero_hpz_partition_size"], out["hpz"], out["run"]["name"], out["wandb"]["name"]
    return out
