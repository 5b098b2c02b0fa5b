"""slurm/sweep.sh submits one job per variant: same recipe, overrides and seed, one W&B group."""

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def dry_run(*args: str) -> list[list[str]]:
    out = subprocess.run(["bash", str(REPO / "slurm" / "sweep.sh"), "--dry-run", *args],
                         capture_output=True, text=True, check=True).stdout
    return [line.rstrip("\0").split("\0") for line in out.splitlines() if line]


def test_sweep_submits_zero3_and_three_hpz_modes_in_one_group(tmp_path):
    jobs = dry_run("--group", "cmp1", "--nodes=2", "--time=1:00:00", "--", "tiny_llama", "train.steps=50",
                   "wandb.tags=[a b]")
    assert len(jobs) == 4
    for job in jobs:
        assert job[:2] == ["sbatch", "--parsable"] and "--nodes=2" in job and "--time=1:00:00" in job
        script = job.index(str(REPO / "slurm" / "train.sbatch"))
        assert job[script + 1 : script + 4] == ["tiny_llama", "train.steps=50", "wandb.tags=[a b]"]
        assert "wandb.group=cmp1" in job and not any(a.startswith("run.seed=") for a in job)
    variants = [next(a for a in job if a.startswith("wandb.name=")).split("=", 1)[1] for job in jobs]
    assert variants == ["zero3", "hpz-stock", "hpz-sync", "hpz-ordered"]
    assert "zero.zero_hpz_partition_size=1" in jobs[0]
    for job, mode in zip(jobs[1:], ["stock", "sync", "ordered"]):
        assert "zero.zero_hpz_partition_size=auto" in job and f"hpz.mode={mode}" in job
    assert len({next(a for a in job if a.startswith("run.name=")) for job in jobs}) == 4


def test_sweep_subset_and_unknown_variant():
    assert len(dry_run("--variants", "zero3,hpz-ordered", "--", "tiny_llama")) == 2
    (legacy,) = dry_run("--variants", "hpz-legacy", "--", "tiny_llama")  # the paper's baseline: on request
    assert "hpz.mode=legacy" in legacy and "zero.zero_hpz_partition_size=auto" in legacy
    result = subprocess.run(["bash", str(REPO / "slurm" / "sweep.sh"), "--dry-run", "--variants", "nope", "--", "x"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "unknown variant 'nope'" in result.stderr
