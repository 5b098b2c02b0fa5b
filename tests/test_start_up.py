"""Before a run trains: the run directory is checked before anything exists, and DeepSpeed's start-up noise is cut
to what a user needs (its deprecated-collective warnings hidden, its one-off JIT build announced)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tools.launcher import PYTHON, REPO, run
from zerotrain import distributed
from zerotrain.errors import StorageError
from zerotrain.run_dir import check_writable


def test_a_file_where_the_run_directory_or_a_parent_goes_is_refused(tmp_path):
    (tmp_path / "taken").write_text("")
    for run_dir in (tmp_path / "taken", tmp_path / "taken" / "runs" / "run"):
        with pytest.raises(StorageError, match=f"{tmp_path / 'taken'} is a file, not a directory"):
            check_writable(run_dir)
    check_writable(tmp_path / "missing" / "parents" / "run")  # created later, as before, under a writable directory
    assert not (tmp_path / "missing").exists(), "the check only reads"


def test_a_read_only_output_directory_is_refused(read_only_dir):
    with pytest.raises(StorageError, match=f"run directory {read_only_dir / 'run'}: cannot create it: its parent "
                                           f"{read_only_dir} is a read-only file system"):
        check_writable(read_only_dir / "run")
    with pytest.raises(StorageError, match=f"its parent {read_only_dir} is a read-only file system"):
        check_writable(read_only_dir / "missing" / "run")


def test_train_py_refuses_an_unusable_output_directory_before_any_process_group(tmp_path, shakespeare):
    (tmp_path / "taken").write_text("")
    proc = run([PYTHON, "train.py", "recipe=tiny_llama", f"data.train.0.path={shakespeare}",
                f"run.output_dir={tmp_path / 'taken'}", "wandb.enabled=false"], check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: run directory {tmp_path / 'taken' / 'tiny-llama'}: {tmp_path / 'taken'} is a file" in proc.stderr
    assert "Traceback" not in proc.stderr and "world:" not in proc.stdout + proc.stderr


def _deprecated_collective_call() -> None:
    """torch 2.13 warns (FutureWarning) before it finds there is no process group: the call DeepSpeed makes."""
    with pytest.raises((ValueError, RuntimeError)):
        dist.all_gather_into_tensor(torch.zeros(2), torch.zeros(1))


def test_only_the_deprecated_collective_warnings_are_hidden():
    assert not dist.is_initialized()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _deprecated_collective_call()  # the control: without the filter it warns
        assert [w.category for w in caught] == [FutureWarning]
        assert "`torch.distributed.all_gather_into_tensor` is deprecated" in str(caught[0].message)
        distributed.quiet_deprecated_collectives()
        _deprecated_collective_call()
        # Other warnings still show, from the same torch module too.
        warnings.warn_explicit("`torch.distributed.something_else` is deprecated", FutureWarning, "c10d_logger.py",
                               1, module="torch.distributed.c10d_logger")
        warnings.warn("some other FutureWarning", FutureWarning)
    assert [str(w.message) for w in caught[1:]] == ["`torch.distributed.something_else` is deprecated",
                                                    "some other FutureWarning"]


def test_the_comm_op_build_is_announced_only_when_it_will_happen(tmp_path, monkeypatch):
    cache = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if not (cache / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").is_file():
        pytest.skip(f"the comm op is not built in {cache} yet (a first multi-process test builds it)")
    assert distributed.pending_comm_op_build() is None  # built: nothing to say
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "fresh"))
    assert distributed.pending_comm_op_build() == tmp_path / "fresh" / "deepspeed_shm_comm"
    assert str(REPO / ".cache" / "torch_extensions") == str(cache)  # what tools.launcher gives every run


def test_a_config_saved_under_an_older_schema_is_compared_on_the_keys_both_have():
    from zerotrain import config
    from zerotrain.errors import ConfigError
    from zerotrain.run_config import parse_args
    from zerotrain.run_dir import check_resumable

    args = ["recipe=tiny_llama", "data.train.0.path=/data"]
    saved = config.to_yaml(parse_args(args)).replace("\ntrain:\n", "\ntrain:\n  a_removed_key: 5\n", 1)
    check_resumable(parse_args([*args, "train.steps=99"]), Path("/runs/r/checkpoints/step_00000002"), saved)
    with pytest.raises(ConfigError, match=r"cannot change on resume: train\.seq_len: 128 -> 64\. Nothing was"):
        check_resumable(parse_args([*args, "train.seq_len=64"]), Path("/runs/r/checkpoints/step_00000002"), saved)


def test_the_batch_split_may_change_on_resume_only_when_the_global_batch_stays(monkeypatch):
    """4 ranks x grad_accum 1 saved; relaunched on 2 ranks the split must change (grad_accum 2), and may."""
    from zerotrain import config
    from zerotrain.errors import CheckpointError, ConfigError
    from zerotrain.run_config import parse_args
    from zerotrain.run_dir import check_resumable

    args = ["recipe=tiny_llama", "data.train.0.path=/data", "train.micro_batch_size=2", "train.grad_accum=1"]
    saved, tag = config.to_yaml(parse_args(args)), Path("/runs/r/checkpoints/step_00000004")
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_resumable(parse_args([*args, "train.grad_accum=2"]), tag, saved, saved_world_size=4)
    with pytest.raises(CheckpointError, match=r"global batch of 8 sequences.*relaunch with train\.grad_accum=2"):
        check_resumable(parse_args([*args, "train.grad_accum=3"]), tag, saved, saved_world_size=4)
    # Without the checkpoint's world size (the control) a changed split is an ordinary refused key.
    with pytest.raises(ConfigError, match=r"train\.grad_accum: 1 -> 2"):
        check_resumable(parse_args([*args, "train.grad_accum=2"]), tag, saved)
