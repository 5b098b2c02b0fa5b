"""zerotrain/ and benchmarks/gpu_check.py pass the pinned mypy with the repository's configuration.

The point is code no CPU test runs: the CUDA-only branches of the hpZ ordering, gpu_check's sections. mypy runs
in-process (``mypy.api``), so the fast tier starts no process; its incremental cache (``.mypy_cache`` at the
repository root) makes runs after the first take seconds.
"""

from __future__ import annotations

import re

import pytest
from mypy import api

from tools.launcher import REPO

CONFIG = REPO / "pyproject.toml"


def run_mypy(*args: str) -> tuple[str, int]:
    stdout, stderr, status = api.run(["--config-file", str(CONFIG), *args])
    return stdout + stderr, status


def test_configured_check_passes(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(REPO)  # the configuration's ``files`` are relative to the repository root
    report, status = run_mypy()
    assert status == 0, f"mypy found type errors (fix them, don't silence them):\n{report}"
    # Every file the configuration names was checked: the package and the GPU check.
    expected = len(list((REPO / "zerotrain").rglob("*.py"))) + 1
    checked = re.search(r"no issues found in (\d+) source files", report)
    assert checked and int(checked.group(1)) == expected, report


def test_a_planted_error_fails(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Negative control: the same configuration rejects a wrong type, and names the file, line and error code."""
    monkeypatch.chdir(REPO)
    planted = tmp_path / "planted.py"
    planted.write_text("def gathered(numel: int) -> int:\n    return numel\n\n\ngathered('7B')\n")
    report, status = run_mypy("--cache-dir", str(tmp_path / "cache"), str(planted))
    assert status == 1, report
    assert re.search(r"planted\.py:5: error: .*\[arg-type\]", report), report
