"""Every test process, and every process it launches, runs with the CPU environment of tests/launch_utils.py."""

import os

import pytest

from launch_utils import CPU_ENV, prepare_shipped_corpus

os.environ.update(CPU_ENV)


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory):
    """The shipped corpus prepared once per test session (tokenizer of 2048 pieces, 2% validation split)."""
    return prepare_shipped_corpus(tmp_path_factory.mktemp("prepared") / "shakespeare")
