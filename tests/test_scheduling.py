"""make test's grouping and order (tests/scheduling.py), on this session's own collection: the files that share a
session fixture run in one worker, the rest file by file, and the longest groups are handed out first."""

from __future__ import annotations

import pytest
import scheduling


def test_files_sharing_a_session_fixture_are_one_group_and_the_others_their_own(request):
    items = request.session.items
    groups = scheduling.file_groups(items)
    if "tests/slurm/test_slurm_cluster.py" not in groups:
        pytest.skip("a run of a subset of the suite: the files this checks were not collected")
    slurm = {f for f in groups if f.startswith("tests/slurm/") and any(
        "slurm_cluster" in i.fixturenames for i in items if scheduling.file_of(i) == f)}
    assert len(slurm) >= 3 and len({groups[f] for f in slurm}) == 1  # one SLURM cluster
    assert groups["tests/comm/test_grad_reduce.py"] == groups["tests/comm/test_comm_bytes.py"]  # comm_launches
    assert groups["tests/hpz/test_hpz_emulated.py"] == groups["tests/hpz/test_hpz_matrix.py"]  # hpz_emulated
    assert groups["tests/test_config.py"] == "tests/test_config.py"  # no shared fixture: alone
    # `shakespeare` is per worker: it links nothing (else every launch test would be in one group).
    assert groups["tests/test_training.py"] == "tests/test_training.py"


def test_longest_groups_first_and_each_file_stays_contiguous(request):
    items = list(request.session.items)
    groups = scheduling.file_groups(items)
    seconds = {f: float(i) for i, f in enumerate(sorted(groups))}  # any costs: here by name
    scheduling.longest_first(items, groups, seconds)
    order = [scheduling.file_of(i) for i in items]
    runs = [f for i, f in enumerate(order) if i == 0 or order[i - 1] != f]
    assert len(runs) == len(set(runs))  # every file's tests in one run
    cost = {}
    for f, g in groups.items():
        cost[g] = cost.get(g, 0.0) + seconds[f]
    handed = list(dict.fromkeys(groups[f] for f in runs))
    assert [cost[g] for g in handed] == sorted((cost[g] for g in handed), reverse=True)
    assert len(items) == len(request.session.items)  # reordered, nothing lost


def test_the_snapshot_is_read_per_file():
    seconds = scheduling.snapshot_seconds()
    assert seconds and all(f.startswith("tests/") and f.endswith(".py") for f in seconds)
    assert seconds.get("tests/hpz/test_hpz_emulated.py", 0) > seconds.get("tests/test_hub.py", 0)


def test_under_make_test_every_test_runs_in_its_group(request):
    """xdist schedules by the "@<group>" suffix its own collection hook adds from the marks: a test without it would
    be a unit of its own, and its module and session fixtures set up again in the other worker."""
    if not scheduling.distributed_by_group(request.config):
        pytest.skip("not a run on xdist workers (make test)")
    groups = scheduling.file_groups(request.session.items)
    for item in request.session.items:
        assert item.nodeid.endswith("@" + groups[scheduling.file_of(item)]), item.nodeid
