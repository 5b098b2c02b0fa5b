"""Helpers for the SLURM tests: paths, and thin wrappers over the SLURM client commands (see conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CLUSTER_SH = HERE / "cluster.sh"
SLURM_ROOT = Path(os.environ.get("ZT_SLURM_ROOT", "/tmp/zerotrain-slurm"))
CORPUS = REPO / "data" / "corpus" / "shakespeare_milton.txt"


def report(message: str) -> None:
    print(f"[slurm tests] {message}", file=sys.stderr, flush=True)


@dataclass
class SlurmCluster:
    """Thin wrappers over the SLURM client commands, with this cluster's SLURM_CONF in the environment."""

    env: dict[str, str]

    def run(self, *cmd: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check, timeout=timeout, **kw)

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> int:
        result = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env={**self.env, **(env or {})},
                                capture_output=True, text=True, check=True, timeout=60)
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, Reason, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait(self, job_id: int, states: tuple[str, ...], timeout: float, poll: float = 1.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if info.get("JobState") in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                raise AssertionError(f"job {job_id} ended {info.get('JobState')} (exit {info.get('ExitCode')})")
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s")
            time.sleep(poll)
