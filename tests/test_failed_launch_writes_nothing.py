"""A launch that fails a check leaves its run directory exactly as it was, and a run's tokenizer is bound to its data.

One short single-process run (2 steps, one checkpoint) is made the way a user does it: from its own directory, with
``data.train.0.path=data/ds``. Each case then gets a directory of its own holding a copy of that run and of its data
set, with one fault put in (a missing tokenizer file, a truncated shard, a changed shard byte, a flipped byte in a
checkpoint, a data set prepared with another tokenizer, an unbalanced YAML override), and relaunches the same
command from there. All the relaunches run in one process (tests/workers/train_py_cases.py: train.py's ``main`` per
case), so the imports are paid once. Every case's directory is compared, file by file (kind, mode, mtime, sha256),
before and after: a failed launch creates nothing and changes nothing. The controls: the same relaunch with nothing
wrong resumes, and the snapshot sees what it writes; a run without a checkpoint may take another data set's
tokenizer, and says so.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from tools.launcher import PYTHON, REPO, run

ARGS = ["recipe=tiny_llama", "zero=zero3_cpu", "train.log_interval=1", "train.eval_interval=0", "wandb.enabled=false",
        "data.train.0.path=data/ds", "run.name=r"]
WORKER = REPO / "tests" / "workers" / "train_py_cases.py"


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root``: whether a directory, its mode, modification time and (files) content hash."""
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_mode, p.stat().st_mtime_ns,
                                       None if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest())
            for p in [root, *sorted(root.rglob("*"))]}


def _first_train_shard(data: Path, named: Path | None = None) -> Path:
    """The first train shard of the data set ``data``, as ``named / <its path in the manifest>``."""
    manifest = json.loads((data / "manifest.json").read_text())
    return (named or data) / manifest["splits"]["train"]["shards"][0]["files"]["tokens"]["path"]


def _flip_byte(path: Path, where: float = 0.75) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x10
    path.write_bytes(bytes(data))


def _missing_tokenizer(case: Path) -> None:
    (case / "data" / "ds" / "tokenizer" / "tokenizer.model").unlink()  # tokenizer.json stays: no fallback to it


def _truncated_shard(case: Path) -> None:
    shard = _first_train_shard(case / "data" / "ds")
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 4096)


def _changed_shard_byte(case: Path) -> None:
    _flip_byte(_first_train_shard(case / "data" / "ds"), where=0.5)


def _flipped_checkpoint_byte(case: Path) -> None:
    _flip_byte(case / "runs" / "r" / "checkpoints" / "step_00000002" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")


# name -> (the fault put into the case's copy, extra arguments). Each relaunch asks for one more step (train.steps=3).
FAULTS = {
    "missing_tokenizer": (_missing_tokenizer, []),
    "truncated_shard": (_truncated_shard, []),
    "changed_shard_byte": (_changed_shard_byte, []),
    "flipped_checkpoint_byte": (_flipped_checkpoint_byte, []),
    "other_tokenizer": (None, []),  # data/ds replaced by a data set prepared with another tokenizer
    "bad_override": (None, ["optim.betas=[0.9"]),
}


FLOPS_PROFILER = ["deepspeed.flops_profiler.enabled=true", "deepspeed.flops_profiler.profile_step=1",
                  "deepspeed.flops_profiler.output_file=flops.txt"]


@pytest.fixture(scope="module")
def launches(tmp_path_factory, shakespeare):
    root = tmp_path_factory.mktemp("untouched")
    # Another tokenizer: 1024 pieces trained on a slice of the corpus (the run's has 2048).
    (root / "slice.txt").write_text((REPO / "data/corpus/shakespeare_milton.txt").read_text()[:200_000])
    other = root / "other"
    run([PYTHON, "data/prepare.py", f"input={root / 'slice.txt'}", f"output={other}", "valid_fraction=0.05",
         "tokenizer.train_vocab_size=1024", "progress=false"], timeout=600)
    base = root / "base"
    shutil.copytree(shakespeare, base / "data" / "ds")
    run([PYTHON, str(REPO / "train.py"), *ARGS, "train.steps=2"], cwd=base, timeout=900)

    cases, before = [], {}
    for name, (fault, extra) in {**FAULTS, "control": (None, [])}.items():
        case = root / name
        shutil.copytree(other if name == "other_tokenizer" else base / "data" / "ds", case / "data" / "ds")
        shutil.copytree(base / "runs", case / "runs")
        if fault:
            fault(case)
        cases.append({"name": name, "cwd": str(case), "argv": [*ARGS, "train.steps=3", *extra]})
        if name == "missing_tokenizer":  # the same fault on a new run: not even its directory is created
            cases.append({"name": "missing_tokenizer_new_run", "cwd": str(case),
                          "argv": [*ARGS, "train.steps=3", "run.name=new"]})
    # Before its first checkpoint a run may change its data set's tokenizer: its copy is replaced, and that is said.
    fresh = root / "no_checkpoint_yet"
    shutil.copytree(base / "runs", fresh / "runs")
    shutil.rmtree(fresh / "runs" / "r" / "checkpoints")
    shutil.copytree(other, fresh / "data" / "other")
    cases.append({"name": "no_checkpoint_yet", "cwd": str(fresh),
                  "argv": [*ARGS, "train.steps=2", "data.train.0.path=data/other"]})
    # A nested key of the deepspeed section given as an override (no YAML block) reaches the engine DeepSpeed builds.
    flops = root / "nested_deepspeed_key"
    shutil.copytree(base / "data" / "ds", flops / "data" / "ds")
    cases.append({"name": "nested_deepspeed_key", "cwd": str(flops),
                  "argv": [*ARGS, "run.name=flops", "train.steps=2", "checkpoint.save_final=false", *FLOPS_PROFILER]})
    for case in cases:
        before.setdefault(case["cwd"], snapshot(Path(case["cwd"])))

    out = root / "out"
    out.mkdir()
    (root / "cases.json").write_text(json.dumps(cases))
    run([PYTHON, str(WORKER), root / "cases.json", out], timeout=1200)
    codes = json.loads((out / "results.json").read_text())
    logs = {case["name"]: (out / f"{case['name']}.log").read_text() for case in cases}
    return {"root": root, "base": base, "other": other, "codes": codes, "logs": logs, "before": before,
            "after": {cwd: snapshot(Path(cwd)) for cwd in before}}


def _assert_failed_and_untouched(launches, name: str, message: str) -> None:
    code, log = launches["codes"][name], launches["logs"][name]
    assert code == 2, log[-3000:]
    assert message in log, log[-3000:]
    assert "Traceback" not in log and "world:" not in log, log[-3000:]
    case = str(launches["root"] / name.removesuffix("_new_run"))
    assert launches["after"][case] == launches["before"][case], "nothing may be created or changed"


def test_a_missing_tokenizer_file_writes_nothing_in_an_existing_or_a_new_run(launches):
    message = "data/ds/tokenizer/tokenizer.model: missing from the prepared data set data/ds"
    _assert_failed_and_untouched(launches, "missing_tokenizer", message)
    _assert_failed_and_untouched(launches, "missing_tokenizer_new_run", message)
    assert not (launches["root"] / "missing_tokenizer" / "runs" / "new").exists()


def test_a_truncated_shard_writes_nothing(launches):
    shard = _first_train_shard(launches["base"] / "data" / "ds", named=Path("data/ds"))
    _assert_failed_and_untouched(launches, "truncated_shard", f"{shard}: sha256 does not match")


def test_a_changed_shard_byte_writes_nothing(launches):
    shard = _first_train_shard(launches["base"] / "data" / "ds", named=Path("data/ds"))
    _assert_failed_and_untouched(launches, "changed_shard_byte", f"{shard}: sha256 does not match")


def test_a_failed_resume_writes_nothing_not_even_config_yaml(launches):
    shard = Path("runs/r/checkpoints/step_00000002/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    _assert_failed_and_untouched(launches, "flipped_checkpoint_byte",
                                 f"checkpoint file {shard} is corrupt: its CRC32 differs")


def test_an_unbalanced_yaml_override_is_named_and_writes_nothing(launches):
    _assert_failed_and_untouched(launches, "bad_override", "optim.betas=[0.9")


def test_a_relaunch_on_a_data_set_with_another_tokenizer_is_refused_naming_both(launches):
    from zerotrain.data.tokenizer import file_sha256

    ours = file_sha256(launches["base"] / "data" / "ds" / "tokenizer" / "tokenizer.model")
    theirs = file_sha256(launches["other"] / "tokenizer" / "tokenizer.model")
    _assert_failed_and_untouched(launches, "other_tokenizer", "data.train.0.path=data/ds has another tokenizer")
    log = launches["logs"]["other_tokenizer"]
    assert f"data/ds/tokenizer/tokenizer.model (sha256 {theirs})" in log, log[-3000:]
    assert (f"its checkpoint runs/r/checkpoints/step_00000002 was trained with "
            f"{launches['base'] / 'data' / 'ds' / 'tokenizer' / 'tokenizer.model'}, which has sha256 {ours}") in log


def test_control_the_same_relaunch_with_nothing_wrong_resumes_and_the_snapshot_sees_it(launches):
    code, log = launches["codes"]["control"], launches["logs"]["control"]
    assert code == 0 and "resumed from" in log, log[-3000:]
    case = str(launches["root"] / "control")
    before, after = launches["before"][case], launches["after"][case]
    assert after["runs/r/config.yaml"] != before["runs/r/config.yaml"]
    assert "runs/r/checkpoints/step_00000003" in after and "runs/r/checkpoints/step_00000003" not in before
    meta = json.loads((Path(case) / "runs/r/checkpoints/step_00000003/zerotrain/meta.json").read_text())
    assert meta["extra"]["tokenizer"]["sha256"] == after["data/ds/tokenizer/tokenizer.model"][3]


def test_before_the_first_checkpoint_the_run_takes_the_new_tokenizer_and_says_so(launches, tmp_path):
    from zerotrain.export import main as export

    code, log = launches["codes"]["no_checkpoint_yet"], launches["logs"]["no_checkpoint_yet"]
    assert code == 0, log[-3000:]
    run_dir = launches["root"] / "no_checkpoint_yet" / "runs" / "r"
    assert f"the run directory's tokenizer {Path('runs/r/tokenizer')} (sha256 " in log, log[-3000:]
    assert "is replaced by data/other/tokenizer/tokenizer.model" in log and "no checkpoint yet" in log
    theirs = (launches["other"] / "tokenizer" / "tokenizer.model").read_bytes()
    assert (run_dir / "tokenizer" / "tokenizer.model").read_bytes() == theirs
    # What an export ships is the tokenizer the run trained with, the new one.
    assert export([str(run_dir), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == theirs


def test_an_export_refuses_a_tokenizer_that_is_not_the_checkpoints(launches, tmp_path, capsys):
    from zerotrain.export import main as export

    run_dir = shutil.copytree(launches["base"] / "runs" / "r", tmp_path / "r")
    assert export([str(run_dir), str(tmp_path / "hf")]) == 0  # the control: the run's own copy
    shutil.rmtree(run_dir / "tokenizer")
    shutil.copytree(launches["other"] / "tokenizer", run_dir / "tokenizer")
    capsys.readouterr()
    assert export([str(run_dir), str(tmp_path / "hf_wrong")]) == 2
    error = capsys.readouterr().err
    assert f"the tokenizer {run_dir / 'tokenizer' / 'tokenizer.model'} (sha256 " in error, error
    assert f"is not the one checkpoint {run_dir / 'checkpoints' / 'step_00000002'} was trained with: " in error
    assert "Nothing was exported" in error and not (tmp_path / "hf_wrong").exists()


def test_a_checkpoint_from_before_the_binding_is_checked_against_the_runs_copy(launches, tmp_path):
    """Checkpoints saved before they recorded the tokenizer: the run's copy stands for it."""
    from zerotrain import checkpoint, run_tokenizer
    from zerotrain.errors import DataError

    run_dir = shutil.copytree(launches["base"] / "runs" / "r", tmp_path / "r")
    tag_dir = run_dir / "checkpoints" / "step_00000002"
    meta = checkpoint.read_meta(tag_dir)
    del meta["extra"]["tokenizer"]
    run_tokenizer.check_relaunch(launches["base"] / "data" / "ds", run_dir, (tag_dir, meta))  # its own data set
    with pytest.raises(DataError, match=rf"but its copy {run_dir / 'tokenizer' / 'tokenizer.model'} \(the "
                                        rf"tokenizer of its checkpoint {tag_dir}\) has sha256 [0-9a-f]{{64}}"):
        run_tokenizer.check_relaunch(launches["other"], run_dir, (tag_dir, meta))


def test_a_nested_deepspeed_override_reaches_the_engine(launches):
    code, log = launches["codes"]["nested_deepspeed_key"], launches["logs"]["nested_deepspeed_key"]
    assert code == 0, log[-3000:]
    case = launches["root"] / "nested_deepspeed_key"
    saved = json.loads((case / "runs" / "flops" / "deepspeed_config.json").read_text())
    assert saved["flops_profiler"] == {"enabled": True, "profile_step": 1, "output_file": "flops.txt"}
    # DeepSpeed's profiler ran (its step 1 is our second) and wrote where the override said: the engine had the key.
    assert "Flops Profiler" in (case / "flops.txt").read_text()
