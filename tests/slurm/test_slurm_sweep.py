"""slurm/sweep.sh submits one job per variant: same recipe, overrides and seed, one W&B group; it refuses to submit
anything that would fail (unknown recipe, overrides that do not compose, missing data), and its --dry-run prints
commands that can be pasted into a shell."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SWEEP = REPO / "slurm" / "sweep.sh"


def dry_run(*args: str) -> list[list[str]]:
    """The printed commands, without the pre-flight check (these tests look at the commands, not at the data)."""
    out = subprocess.run(["bash", str(SWEEP), "--dry-run", "--no-check", *args], capture_output=True, text=True,
                         check=True).stdout
    return [shlex.split(line) for line in out.splitlines() if line]


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


def test_dry_run_lines_paste_into_a_shell_unchanged(tmp_path):
    """Each printed line, run by bash, gives sbatch exactly the arguments the sweep would (quotes, $, spaces)."""
    tricky = ["wandb.tags=[a b]", "run.note=it's $HOME `x`", "wandb.notes=tab\there"]
    out = subprocess.run(["bash", str(SWEEP), "--dry-run", "--no-check", "--variants", "zero3", "--", "tiny_llama",
                          *tricky],
                         capture_output=True, text=True, check=True).stdout
    (line,) = out.splitlines()
    echo = tmp_path / "bin"
    echo.mkdir()
    (echo / "sbatch").write_text('#!/bin/bash\nprintf "%s\\0" "$@"\n')
    (echo / "sbatch").chmod(0o755)
    got = subprocess.run(["bash", "-c", line], env={**os.environ, "PATH": f"{echo}:{os.environ['PATH']}"},
                         capture_output=True, text=True, check=True).stdout.rstrip("\0").split("\0")
    script = got.index(str(REPO / "slurm" / "train.sbatch"))
    assert got[script + 1 : script + 5] == ["tiny_llama", *tricky]


def test_sweep_subset_and_unknown_variant():
    assert len(dry_run("--variants", "zero3,hpz-ordered", "--", "tiny_llama")) == 2
    (legacy,) = dry_run("--variants", "hpz-legacy", "--", "tiny_llama")  # the paper's baseline: on request
    assert "hpz.mode=legacy" in legacy and "zero.zero_hpz_partition_size=auto" in legacy
    result = subprocess.run(["bash", str(SWEEP), "--dry-run", "--variants", "nope", "--", "x"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 2 and "unknown variant 'nope'" in result.stderr


def test_unknown_recipe_is_refused_even_in_a_dry_run():
    result = subprocess.run(["bash", str(SWEEP), "--dry-run", "--", "llama2_7b"], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 2 and not result.stdout
    assert "no recipe 'llama2_7b'" in result.stderr and "llama2_7b_pretrain" in result.stderr


def test_readme_sweep_example_names_a_recipe_that_exists():
    readme = (REPO / "slurm" / "README.md").read_text()
    example = readme[readme.index("slurm/sweep.sh --group"):]
    recipe = example[example.index(" -- ") + 4:].split()[0]
    assert (REPO / "recipes" / f"{recipe}.yaml").is_file(), recipe


# ---- the pre-flight check, with a recording sbatch on PATH: what would really be submitted ----------------------


def sweep_with_fake_sbatch(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch-calls.jsonl"
    bin_dir.mkdir(exist_ok=True)
    recorder = bin_dir / "sbatch"
    recorder.write_text(f'#!/bin/bash\n"{sys.executable}" -c \'import json, sys; print(json.dumps(sys.argv[1:]))\''
                        f' "$@" >> "{calls}"\necho 4242\n')
    recorder.chmod(0o755)
    # The interpreter running the tests checks (the checkout's .venv is the default, absent from a worktree).
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ZEROTRAIN_PYTHON": sys.executable}
    result = subprocess.run(["bash", str(SWEEP), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                            check=False, timeout=300)
    submitted = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return result, submitted


def prepared_data(tmp_path: Path) -> Path:
    data = tmp_path / "prepared"
    data.mkdir()
    (data / "manifest.json").write_text("{}")  # all the pre-flight check looks for (the trainer checks the rest)
    return data


def test_preflight_refuses_a_bad_override_and_submits_nothing(tmp_path):
    data = prepared_data(tmp_path)
    args = ("--variants", "zero3,hpz-ordered", "--", "tiny_llama", f"data.train.0.path={data}", "optim.lr=-1")
    result, submitted = sweep_with_fake_sbatch(tmp_path, *args)
    assert result.returncode == 2 and submitted == [], result.stdout + result.stderr
    assert "pre-flight check of variant zero3 failed" in result.stderr and "optim.lr" in result.stderr
    assert "nothing submitted" in result.stderr

    # Negative control: without the check the same sweep goes straight to sbatch, two jobs that would fail.
    result, submitted = sweep_with_fake_sbatch(tmp_path, "--no-check", *args)
    assert result.returncode == 0 and len(submitted) == 2


def test_preflight_passes_a_good_sweep_and_submits_every_variant(tmp_path):
    data = prepared_data(tmp_path)
    result, submitted = sweep_with_fake_sbatch(tmp_path, "--group", "ok", "--", "tiny_llama",
                                               f"data.train.0.path={data}", "train.steps=5")
    assert result.returncode == 0, result.stderr
    assert [job[1] for job in submitted] == [f"--job-name=ok-{v}" for v in ("zero3", "hpz-stock", "hpz-sync",
                                                                             "hpz-ordered")]
    assert "zero3: job 4242" in result.stdout and (tmp_path / "logs").is_dir()


def test_a_dry_run_runs_the_preflight_check_and_prints_nothing_that_would_be_refused(tmp_path):
    data = prepared_data(tmp_path)
    env = {**os.environ, "ZEROTRAIN_PYTHON": sys.executable}
    args = ["bash", str(SWEEP), "--dry-run", "--variants", "zero3", "--", "tiny_llama", f"data.train.0.path={data}"]
    refused = subprocess.run([*args, "train.stepz=5"], env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert "pre-flight check of variant zero3 failed" in refused.stderr
    assert "Did you mean 'train.steps'?" in refused.stderr and "nothing submitted" in refused.stderr
    # The controls: a good sweep prints its command; --no-check prints the bad one unchecked (as every dry run did).
    good = subprocess.run([*args, "train.steps=5"], env=env, capture_output=True, text=True, timeout=300)
    assert good.returncode == 0 and len(good.stdout.splitlines()) == 1, good.stderr
    unchecked = subprocess.run([*args[:3], "--no-check", *args[3:], "train.stepz=5"], env=env, capture_output=True,
                               text=True, timeout=300)
    assert unchecked.returncode == 0 and "train.stepz=5" in unchecked.stdout
