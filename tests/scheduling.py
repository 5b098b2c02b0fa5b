"""How ``make test`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``): which tests must run in
one worker, and in what order the groups are handed out.

Most of the suite's wall time is not CPU time: measured 1369 s wall for 1322 CPU s of pytest and its launches (plus
the SLURM jobs' ~200, which slurmd starts), on 2 cores. The SLURM jobs wait on the scheduler, the timeout tests on
their timeouts, the fast tier and mypy use one core. Two workers fill that time with the other's work.

* **Groups** (``xdist_group`` marks, :func:`file_groups`): a test runs in the worker that set up its fixtures, so
  the tests of one file stay together (their module fixtures are one launch), and files sharing a session fixture
  defined under tests/ (the SLURM cluster, the hpZ launches, the comm launches, the data sets) are one group: each
  worker would otherwise launch it again, or start a second SLURM cluster on the first one's ports. Session fixtures
  in :data:`PER_WORKER` (cheap, used everywhere) are set up once in each worker instead.
* **Order** (:func:`longest_first`): groups are handed out longest first by the committed durations snapshot
  (``tests/durations.txt``, written by ``make durations``), so that no long group starts last and leaves one worker
  running it alone; a file the snapshot lacks counts as short. Within a group the order is pytest's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SNAPSHOT = TESTS / "durations.txt"
PER_WORKER = frozenset({"shakespeare"})  # the shipped corpus prepared: seconds, used by most launch tests
_FILE_LINE = re.compile(r"^\s*(\d+)\s+(?:\d+\s+)?\d+\s+(tests/\S+\.py)\s*$")


def _find(parent: dict[str, str], key: str) -> str:
    while parent.setdefault(key, key) != key:
        parent[key] = parent[parent[key]]
        key = parent[key]
    return key


def _shared_session_fixtures(item: pytest.Item) -> list[str]:
    """The session-scoped fixtures defined under tests/ that ``item`` uses, but :data:`PER_WORKER`'s."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    names = []
    for name in item.fixturenames:  # type: ignore[attr-defined]
        defs = info.name2fixturedefs.get(name) or ()
        if not defs or name in PER_WORKER:
            continue
        fixturedef = defs[-1]
        code = getattr(fixturedef.func, "__code__", None)
        if fixturedef.scope == "session" and code is not None and TESTS in Path(code.co_filename).parents:
            names.append(name)
    return names


def file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def file_groups(items: list[pytest.Item]) -> dict[str, str]:
    """The group of each test file: files linked by a shared session fixture are one group, named by its first file."""
    parent: dict[str, str] = {}
    for item in items:
        here = _find(parent, file_of(item))
        for name in _shared_session_fixtures(item):
            there = _find(parent, "fixture:" + name)
            if there != here:
                parent[there] = here
    files = {file_of(item) for item in items}
    members: dict[str, list[str]] = {}
    for f in files:
        members.setdefault(_find(parent, f), []).append(f)
    name_of = {root: sorted(fs)[0] for root, fs in members.items()}
    return {f: name_of[_find(parent, f)] for f in files}


def snapshot_seconds(path: Path = SNAPSHOT) -> dict[str, float]:
    """Seconds per test file in the durations snapshot's "per file" table (empty when there is none)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    seconds = {}
    for line in text.split("## per file", 1)[-1].split("\n## ", 1)[0].splitlines():
        m = _FILE_LINE.match(line)
        if m:
            seconds[m.group(2)] = float(m.group(1))
    return seconds


def longest_first(items: list[pytest.Item], groups: dict[str, str], seconds: dict[str, float]) -> None:
    """Reorder ``items`` in place: whole groups, longest first (ties: collection order); files stay contiguous."""
    cost: dict[str, float] = {}
    for f, group in groups.items():
        cost[group] = cost.get(group, 0.0) + seconds.get(f, 0.0)
    first_of_group: dict[str, int] = {}
    first_of_file: dict[str, int] = {}
    for i, item in enumerate(items):
        first_of_group.setdefault(groups[file_of(item)], i)
        first_of_file.setdefault(file_of(item), i)

    def key(item: pytest.Item) -> tuple[float, int, int]:
        group = groups[file_of(item)]
        return -cost[group], first_of_group[group], first_of_file[file_of(item)]

    items.sort(key=key)  # stable: a file's tests keep their order


def distributed_by_group(config: pytest.Config) -> bool:
    """Whether this process collects for ``--dist loadgroup`` workers: xdist sets ``loadgroup`` in each worker (where
    ``dist`` reads "no"); collection happens only there."""
    return bool(getattr(config.option, "loadgroup", False))


def schedule(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group and order the collected tests when the run is distributed by group (``--dist loadgroup``)."""
    if not distributed_by_group(config):
        return
    groups = file_groups(items)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[file_of(item)]))
    longest_first(items, groups, snapshot_seconds())
