"""Every test process, and every process it launches, runs with the CPU environment of tools/launcher.py."""

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import scheduling
from tiers import SpawnGuard, mark_tiers

from tools import durations
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


def _tmpfs(mount: Path, options: str, needs: str) -> Iterator[Path]:
    """A real tmpfs mounted at ``mount`` for one test (root only: skipped otherwise), unmounted after it."""
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip(f"needs root to mount {needs}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 10 MB tmpfs: room for two checkpoints of the tiny model, not three."""
    yield from _tmpfs(tmp_path / "disk", "size=10m", "a small tmpfs")


@pytest.fixture
def read_only_dir(tmp_path):
    """``tmp_path / "ro"``: a read-only file system."""
    yield from _tmpfs(tmp_path / "ro", "ro,size=1m", "a read-only file system")


# ---- the test tiers (tests/tiers.py): launch, slurm, and the guard on the fast tier --------------------------------

_SPAWN_GUARD = SpawnGuard()


@pytest.hookimpl(tryfirst=True)  # before xdist's, which turns the xdist_group marks into the "@group" scopes
def pytest_collection_modifyitems(config, items):
    mark_tiers(items)
    scheduling.schedule(config, items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    durations.start(item)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item):
    report = yield
    report.user_properties = [*report.user_properties, *durations.phase_properties(item)]  # a copy: per phase
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _SPAWN_GUARD.watch(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _SPAWN_GUARD.watch(item))
