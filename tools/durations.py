"""Run the test suite and write the durations snapshot (``make durations`` -> ``tests/durations.txt``).

The snapshot is what a contributor reads to know what a tier costs and where the time goes: the wall time of the
whole run, the time per tier (fast, launch, slurm: the marks ``tests/tiers.py`` sets), per file, and the slowest
tests. A test's time is its setup, call and teardown together, so a module fixture that launches a run is charged to
the first test that uses it, as pytest charges it. Beside the wall seconds, CPU seconds (user + system, of pytest and
of every process it waited for: a torchrun launch's ranks included, a SLURM job's tasks not, slurmd starts those):
on 2 cores the suite cannot take less wall time than half its CPU seconds, so that is the column to cut. On
xdist workers (``make durations`` passes make test's ``-n 2``) a test's seconds include the other worker's load.

    python tools/durations.py --out tests/durations.txt [pytest arguments...]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

SLOWEST = 30


class Recorder:
    """A pytest plugin (in the process that reports: the xdist controller, or the only one): each test's tier and
    its wall and CPU time over the three phases, from what :func:`phase_properties` put on its reports."""

    def __init__(self) -> None:
        self.tier: dict[str, str] = {}
        self.seconds: dict[str, float] = defaultdict(float)
        self.outcome: dict[str, str] = {}
        self.cpu: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid = _GROUP_SUFFIX.sub("", report.nodeid)  # xdist's loadgroup appends "@<group>"
        self.seconds[nodeid] += report.duration
        for key, value in report.user_properties:
            if key == CPU_KEY:
                self.cpu[nodeid] += float(value)
            elif key == TIER_KEY:
                self.tier[nodeid] = str(value)
        if report.when == "call" or report.outcome != "passed":
            self.outcome[nodeid] = report.outcome


# ---- in the process that runs the test (tests/conftest.py calls these): the phase's CPU time and the test's tier
CPU_KEY, TIER_KEY = "durations_cpu_s", "durations_tier"
_GROUP_SUFFIX = re.compile(r"@tests/[^@]*\.py$")


def start(item: pytest.Item) -> None:
    """Before the test's setup."""
    item.stash[_MARK] = cpu_seconds()


def phase_properties(item: pytest.Item) -> list[tuple[str, object]]:
    """What to add to a phase's report: the CPU seconds since the last phase ended, and the test's tier."""
    now = cpu_seconds()
    spent = now - item.stash.get(_MARK, now)
    item.stash[_MARK] = now
    marks = {m.name for m in item.iter_markers()}
    tier = "slurm" if "slurm" in marks else "launch" if "launch" in marks else "fast"
    return [(CPU_KEY, round(spent, 3)), (TIER_KEY, tier)]


_MARK = pytest.StashKey[float]()


def cpu_seconds() -> float:
    """User + system seconds of this process and of the children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def render(recorder: Recorder, wall: float, exit_code: int) -> str:
    ran = [nodeid for nodeid in recorder.seconds if nodeid in recorder.tier]
    lines = [f"# tests/durations.txt: written by `make durations` on {time.strftime('%Y-%m-%d')}, "
             f"{os.cpu_count()} CPU core(s), Python {platform.python_version()}; pytest exit status {exit_code}",
             f"# whole run: {wall:.0f} s wall, {sum(recorder.cpu[n] for n in ran):.0f} CPU s, for {len(ran)} tests",
             "", "## per tier", "", f"{'tier':<8} {'tests':>6} {'seconds':>8} {'CPU s':>8}"]
    for tier in ("fast", "launch", "slurm"):
        members = [n for n in ran if recorder.tier[n] == tier]
        lines.append(f"{tier:<8} {len(members):>6} {sum(recorder.seconds[n] for n in members):>8.0f} "
                     f"{sum(recorder.cpu[n] for n in members):>8.0f}")
    per_file: dict[str, list[str]] = defaultdict(list)
    for nodeid in ran:
        per_file[nodeid.split("::")[0]].append(nodeid)
    lines += ["", "## per file (seconds, CPU seconds, tests)", ""]
    for path, ids in sorted(per_file.items(), key=lambda kv: -sum(recorder.seconds[n] for n in kv[1])):
        lines.append(f"{sum(recorder.seconds[n] for n in ids):>7.0f} {sum(recorder.cpu[n] for n in ids):>7.0f} "
                     f"{len(ids):>4}  {path}")
    lines += ["", f"## the {SLOWEST} slowest tests (seconds, CPU seconds, tier)", ""]
    for nodeid in sorted(ran, key=lambda n: -recorder.seconds[n])[:SLOWEST]:
        lines.append(f"{recorder.seconds[nodeid]:>7.1f} {recorder.cpu[nodeid]:>7.1f}  {recorder.tier[nodeid]:<6}  "
                     f"{nodeid}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the snapshot")
    args, pytest_args = parser.parse_known_args(argv)
    recorder = Recorder()
    start = time.monotonic()
    exit_code = pytest.main(list(pytest_args), plugins=[recorder])
    text = render(recorder, time.monotonic() - start, int(exit_code))
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(args.out)
    print(f"durations: wrote {args.out}", file=sys.stderr)
    return int(exit_code)


if __name__ == "__main__":
    sys.exit(main())
