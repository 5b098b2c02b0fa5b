"""Launch helpers for the hpZ tests (a module with a unique name, importable from test files).

Launching 4 CPU processes costs ~40 s here (imports plus DeepSpeed's first
engine build), so every multi-process check lives in one launch of
worker_suite.py and the tests read their part of its JSON. The launch uses the
CPU accelerator, gloo, ``OMP_NUM_THREADS=1`` and the repository's
torch-extension cache (DeepSpeed JIT-builds a shared-memory comm op at
``init_distributed``; ~90 s once).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch_utils import CPU_ENV

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

# ~3-4 min on an idle 2-core machine; generous because shared CI machines are often loaded.
SUITE_TIMEOUT_S = 900


def torchrun(script: Path, *args: str, nproc: int = 4, timeout: float = SUITE_TIMEOUT_S,
             env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           *args]
    full_env = {**os.environ, **CPU_ENV, **(env or {})}
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def stage(results: dict, section: str, name: str | None = None) -> dict:
    """A stage's result, failing with its recorded error when it crashed."""
    value = results[section] if name is None else results[section].get(name)
    if value is None:
        pytest.fail(f"stage {section}/{name} did not run; launch output tail:\n{results.get('output_tail')}")
    if isinstance(value, dict) and value.get("ok") is False and "error" in value and "where" not in value:
        pytest.fail(f"stage {section}/{name} crashed:\n{value['error']}")
    return value
