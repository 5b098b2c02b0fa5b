"""Every test process, and every process it launches, runs with the CPU environment of tools/launcher.py."""

import os
from pathlib import Path

import pytest

from tools.launcher import CPU_ENV, PYTHON, run

os.environ.update(CPU_ENV)


def prepare_shipped_corpus(out_dir: Path, vocab_size: int = 2048) -> Path:
    """The shipped corpus through the real prepare command (the same one `make data` runs)."""
    if not (out_dir / "manifest.json").is_file():
        run([PYTHON, "data/prepare.py", "input=data/corpus/shakespeare_milton.txt", f"output={out_dir}",
             f"tokenizer.train_vocab_size={vocab_size}", "valid_fraction=0.02", "progress=false"], timeout=600)
    return out_dir


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory):
    """The shipped corpus prepared once per test session (tokenizer of 2048 pieces, 2% validation split)."""
    return prepare_shipped_corpus(tmp_path_factory.mktemp("prepared") / "shakespeare")
