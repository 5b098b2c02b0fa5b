"""pytest fixtures for the hpZ tests: one shared torchrun launch per worker (suite, emulator) per session."""

from __future__ import annotations

import json
import time

import pytest

from hpz_launch import HERE, torchrun


@pytest.fixture(scope="session")
def hpz_suite(tmp_path_factory) -> dict:
    """Results of worker_suite.py: {"parity": ..., "defects": ..., "trainer": ..., "seconds": ...}."""
    work = tmp_path_factory.mktemp("hpz_suite")
    out = work / "out.json"
    t0 = time.time()
    proc = torchrun(HERE / "worker_suite.py", str(out), env={"HPZ_TMP": str(work)})
    wall = time.time() - t0
    if not out.is_file():
        raise AssertionError(f"worker_suite.py wrote no results (exit {proc.returncode}, {wall:.0f} s)\n"
                             f"{(proc.stdout + proc.stderr)[-6000:]}")
    results = json.loads(out.read_text())
    results["launch_wall_seconds"] = round(wall, 1)
    results["returncode"] = proc.returncode
    results["output_tail"] = (proc.stdout + proc.stderr)[-4000:]
    print(f"\nhpZ suite launch: {wall:.1f} s wall; stages: {results.get('seconds')}")
    return results


@pytest.fixture(scope="session")
def hpz_emulated(tmp_path_factory) -> dict:
    """Results of worker_emulator.py (DeepSpeed's real engine under the emulated asynchronous accelerator)."""
    out = tmp_path_factory.mktemp("hpz_emulated") / "out.json"
    t0 = time.time()
    proc = torchrun(HERE / "worker_emulator.py", str(out))
    wall = time.time() - t0
    if not out.is_file():
        raise AssertionError(f"worker_emulator.py wrote no results (exit {proc.returncode}, {wall:.0f} s)\n"
                             f"{(proc.stdout + proc.stderr)[-6000:]}")
    results = json.loads(out.read_text())
    results["launch_wall_seconds"] = round(wall, 1)
    results["output_tail"] = (proc.stdout + proc.stderr)[-4000:]
    print(f"\nhpZ emulator launch: {wall:.1f} s wall ({results.get('seconds')} s of runs)")
    return results
