"""Fixtures for the SLURM tests: a real two-node SLURM cluster on this host, and a small prepared data set.

The cluster (tests/slurm/cluster.sh) is started once per session by the first test that asks for it and stopped
at the end (set ZT_SLURM_KEEP=1 to leave it running for inspection). Its first start installs Debian's
slurmctld/slurmd/munge packages, which needs root and the package mirror; without root the cluster tests skip.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_testlib import CLUSTER_SH, CORPUS, SLURM_ROOT, SlurmCluster, report

from tools.launcher import PYTHON, run


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (packages, daemons)")
    started = time.monotonic()
    result = subprocess.run(["bash", str(CLUSTER_SH), "up"], check=False, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.fail(f"tests/slurm/cluster.sh up failed:\n{result.stdout}\n{result.stderr}")
    report(f"cluster up in {time.monotonic() - started:.1f} s")
    env = {**os.environ, "SLURM_CONF": str(SLURM_ROOT / "etc" / "slurm.conf")}
    yield SlurmCluster(env=env)
    if os.environ.get("ZT_SLURM_KEEP") != "1":
        subprocess.run(["bash", str(CLUSTER_SH), "down"], check=False, capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A small prepared data set (300 KB of the shipped corpus, the tiny model's 2048-token vocabulary)."""
    out = tmp_path_factory.mktemp("data")
    (out / "slice.txt").write_text(CORPUS.read_text(encoding="utf-8")[:300_000], encoding="utf-8")
    run([PYTHON, "data/prepare.py", f"input={out / 'slice.txt'}", f"output={out / 'tiny'}",
         "tokenizer.train_vocab_size=2048", "progress=false"], timeout=300)
    return out / "tiny"
