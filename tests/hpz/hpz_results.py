"""Reading the hpZ suite's results (a module with a unique name, importable from test files).

Launching 4 CPU processes costs ~40 s here (imports plus DeepSpeed's first engine build), so every multi-process
check lives in one launch of worker_suite.py (conftest.py's ``hpz_suite`` fixture) and each test reads its stage.
"""

from __future__ import annotations

import pytest


def stage(results: dict, section: str, name: str | None = None) -> dict:
    """A stage's result, failing with its recorded error when it crashed."""
    value = results[section] if name is None else results[section].get(name)
    if value is None:
        pytest.fail(f"stage {section}/{name} did not run; launch output tail:\n{results.get('output_tail')}")
    if isinstance(value, dict) and value.get("ok") is False and "error" in value and "where" not in value:
        pytest.fail(f"stage {section}/{name} crashed:\n{value['error']}")
    return value


def emulated_run(results: dict, spec: str) -> dict:
    """One run of the emulator launch (``hpz_emulated``: ``"<kind>:<dtype>:<mode>"``, ``"matrix:<option>:..."``),
    failing with the launch's output when it is missing or with its error when it crashed."""
    value = results["runs"].get(spec)
    if value is None:
        pytest.fail(f"run {spec} missing; launch output tail:\n{results.get('output_tail')}")
    if "error" in value:
        pytest.fail(f"run {spec} crashed:\n{value['error']}")
    return value


def races(r: dict) -> list:
    """Racy shard reads per rank of one emulated run."""
    return [e["races"] for e in r["emulator"]]
