"""data/prepare.py end to end, as a user runs it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tools.launcher import PYTHON, REPO, run
from zerotrain.data.loader import build_loader

CORPUS = REPO / "data" / "corpus" / "shakespeare_milton.txt"


def run_cli(*arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": ""}  # the script must find zerotrain by itself (the installed package)
    return run([PYTHON, REPO / "data" / "prepare.py", *arguments], cwd=cwd, env=env, timeout=120, check=False)


def test_cli_prepares_a_slice_of_the_shipped_corpus(tmp_path):
    result = run_cli(f"input={CORPUS}", "output=prepared/tiny", "tokenizer.train_vocab_size=400",
                     "max_documents=40", "valid_fraction=0.1", "progress=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "wrote prepared/tiny (train:" in result.stdout and "tokens/s" in result.stdout
    manifest = json.loads((tmp_path / "prepared" / "tiny" / "manifest.json").read_text())
    splits = manifest["splits"]
    assert splits["train"]["num_documents"] + splits["valid"]["num_documents"] == 40
    loader = build_loader([(str(tmp_path / "prepared" / "tiny"), 1.0)], "train", 128, 2, vocab_size=400)
    assert next(loader)["input_ids"].max() < 400


def test_cli_misspelt_argument_exits_2_with_a_suggestion(tmp_path):
    result = run_cli(f"input={CORPUS}", "output=out", "tokenizer.train_vocab_sise=400", cwd=tmp_path)
    assert result.returncode == 2
    assert "data/prepare.py" in result.stderr and "'tokenizer.train_vocab_sise'" in result.stderr
    assert "Did you mean 'tokenizer.train_vocab_size'?" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_cli_bad_value_and_missing_input_exit_2(tmp_path):
    result = run_cli(f"input={CORPUS}", "output=out", "valid_fraction=1.5", cwd=tmp_path)
    assert result.returncode == 2 and "valid_fraction=1.5 must be in [0, 1)" in result.stderr
    result = run_cli("input=missing.txt", "output=out", cwd=tmp_path)
    assert result.returncode == 2 and "input file missing.txt does not exist" in result.stderr
    result = run_cli(f"input={CORPUS}", cwd=tmp_path)
    assert result.returncode == 2 and "required arguments missing: output" in result.stderr
