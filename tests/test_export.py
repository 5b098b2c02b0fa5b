"""The Hugging Face export of a run works from any directory, survives a moved data set, and is never half-written.

One short single-process run (2 steps, ~15 s) is launched the way a user does it: from its own directory, with the
data set given by a relative path; the data set is then moved away. Each test exports that run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
from pathlib import Path

import pytest
import torch

from tools.launcher import PYTHON, REPO, run

TEXT = " To be, or not to be:\n\tthat is  the question. 1603"  # leading space, newline, tab, two spaces, digits


@pytest.fixture(scope="module")
def moved_run(tmp_path_factory, shakespeare) -> tuple[Path, Path]:
    """(run directory, where its data set is now): trained from ``launch/`` with ``data.train.0.path=data/shakespeare``,
    then ``launch/data`` moved elsewhere."""
    root = tmp_path_factory.mktemp("export")
    launch = root / "launch"
    shutil.copytree(shakespeare, launch / "data" / "shakespeare")
    run([PYTHON, str(REPO / "train.py"), "recipe=tiny_llama", "zero=zero3_cpu", "train.steps=2",
                 "train.log_interval=1", "train.eval_interval=0", "wandb.enabled=false",
                 "data.train.0.path=data/shakespeare", "run.name=moved"], cwd=launch, timeout=600)
    shutil.move(launch / "data", root / "moved_away")
    return launch / "runs" / "moved", root / "moved_away" / "shakespeare"


def _training_ids(data: Path, text: str, bos: bool) -> list[int]:
    from zerotrain.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(data)
    return ([tokenizer.bos_id] if bos else []) + tokenizer.encode(text)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _assert_loads_with_the_training_tokenizer(export: Path, data: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer(TEXT, add_special_tokens=False)["input_ids"] == _training_ids(data, TEXT, bos=False)
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == _training_ids(data, TEXT, bos=True)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([ids])).logits).all()


def test_training_copies_the_tokenizer_into_the_run_directory(moved_run):
    run_dir, data = moved_run
    copy = run_dir / "tokenizer"
    assert (copy / "tokenizer.model").read_bytes() == (data / "tokenizer" / "tokenizer.model").read_bytes()
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(_files(copy))
    record = json.loads((copy / "source.json").read_text())
    assert record["launch_directory"] == str(run_dir.parent.parent)
    assert record["source"] == str(run_dir.parent.parent / "data" / "shakespeare" / "tokenizer" / "tokenizer.model")


def test_export_from_another_directory_after_the_data_set_moved(moved_run, tmp_path):
    run_dir, data = moved_run
    run([PYTHON, "-m", "zerotrain.export", str(run_dir), "hf"], cwd=tmp_path, timeout=300)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no partial directory left next to it
    _assert_loads_with_the_training_tokenizer(tmp_path / "hf", data)


def test_older_run_without_a_tokenizer_copy_exports_from_its_data_set_or_says_where_it_looked(
        moved_run, tmp_path, monkeypatch, capsys):
    """A run made before the copy existed: its data set is found relative to the directory the run was launched
    from (not the current one); when it is gone too, the error names the paths tried and nothing is written."""
    from zerotrain.export import main

    run_dir, data = moved_run
    launch = tmp_path / "launch"
    without_copy = shutil.copytree(run_dir, launch / "runs" / "moved",
                                   ignore=lambda directory, names: ["tokenizer"] if Path(directory) == run_dir else [])
    assert not (without_copy / "tokenizer").exists()
    shutil.copytree(data, launch / "data" / "shakespeare")
    monkeypatch.chdir(tmp_path)
    assert main([str(without_copy), "hf"]) == 0
    _assert_loads_with_the_training_tokenizer(tmp_path / "hf", data)

    shutil.rmtree(launch / "data")
    capsys.readouterr()
    assert main([str(without_copy), "hf_again"]) == 2
    error = capsys.readouterr().err
    assert "cannot find the tokenizer" in error and str(launch / "data" / "shakespeare") in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "launch"]


# The export CLI, killed by the given signal while it writes the tokenizer (the model weights are already written):
# what a kill -9, an OOM kill or a scancel at that moment does.
KILLED_WHILE_WRITING = """
import os, runpy, sys
from zerotrain.data import tokenizer
signum = int(sys.argv.pop(1))
def killed(self, out_dir):
    os.kill(os.getpid(), signum)
tokenizer.FileTokenizer.save_pretrained = tokenizer.SentencePieceTokenizer.save_pretrained = killed
runpy.run_module("zerotrain.export", run_name="__main__")
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_interrupted_export_keeps_the_older_export_and_leaves_no_partial_directory(moved_run, tmp_path, signum):
    from safetensors.torch import load_file, save_file

    from zerotrain.export import main

    run_dir, data = moved_run
    target = tmp_path / "hf"
    assert main([str(run_dir), str(target)]) == 0
    # An older export, e.g. of an earlier checkpoint: different weights.
    weights = {k: torch.zeros_like(v) for k, v in load_file(target / "model.safetensors").items()}
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    older = _files(target)

    killed = run([PYTHON, "-c", KILLED_WHILE_WRITING, str(int(signum)), str(run_dir), str(target)],
                         check=False, timeout=300)
    assert killed.returncode == (-signal.SIGKILL if signum == signal.SIGKILL else 128 + signal.SIGTERM), killed.stderr
    assert _files(target) == older, "the older export must be untouched"
    # SIGTERM unwinds and removes the partial export; after SIGKILL nothing can, and it stays hidden until the next
    # export of the same target removes it.
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "hf")
    assert leftovers == ([".hf.partial"] if signum == signal.SIGKILL else [])

    assert main([str(run_dir), str(target)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert _files(target)["model.safetensors"] != older["model.safetensors"]
    _assert_loads_with_the_training_tokenizer(target, data)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_have_the_mode_the_umask_gives_like_the_runs_other_files(moved_run, tmp_path, umask):
    from safetensors.torch import save_file

    from zerotrain.export import main

    run_dir, _ = moved_run
    previous = os.umask(umask)
    try:
        save_file({"w": torch.zeros(2)}, tmp_path / "plain.safetensors")  # the control: safetensors alone
        assert main([str(run_dir), str(tmp_path / "hf")]) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "plain.safetensors").stat().st_mode) == 0o600
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes
