"""tools.launcher leaves nothing behind: a timeout, Ctrl-C, SIGTERM or a failed node kills the whole process tree
(a child and the grandchild it spawned, also one in a session of its own, as torchrun starts its workers), where
plain ``subprocess.run(timeout=...)`` kills only the child."""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tools.launcher import PYTHON, LaunchError, LaunchTimeout, launch_nodes, run

# A child that starts a grandchild (in the child's process group, or in a session of its own as torch elastic starts
# every worker), says who they are, waits.
TREE = """
import os, pathlib, subprocess, sys, time
grandchild = subprocess.Popen(["sleep", "300"], start_new_session=sys.argv[2] == "own-session")
pathlib.Path(sys.argv[1]).write_text(f"{os.getpid()} {grandchild.pid}")
time.sleep(300)
"""
GRANDCHILD = ["same-group", "own-session"]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its exit status is left to collect


def tree_pids(pidfile: Path, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while not pidfile.is_file() or len(pidfile.read_text().split()) != 2:
        assert time.monotonic() < deadline, "the child never started its grandchild"
        time.sleep(0.05)
    return [int(p) for p in pidfile.read_text().split()]


def assert_gone(pids: list[int], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], f"still running: {[p for p in pids if alive(p)]} of {pids}"


@pytest.mark.parametrize("grandchild", GRANDCHILD)
def test_timeout_kills_the_child_and_its_grandchild(tmp_path, grandchild):
    pidfile = tmp_path / "pids"
    started = time.monotonic()
    with pytest.raises(LaunchTimeout, match="ran past its 6 s timeout") as error:
        run([PYTHON, "-c", TREE, pidfile, grandchild], timeout=6)
    assert time.monotonic() - started < 30
    assert error.value.results[0].returncode == -signal.SIGKILL
    assert_gone(tree_pids(pidfile, timeout=0))


def test_negative_control_plain_subprocess_run_leaves_the_grandchild_running(tmp_path):
    """Why the launcher exists: subprocess.run's timeout kills the child only."""
    pidfile = tmp_path / "pids"
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([PYTHON, "-c", TREE, str(pidfile), "same-group"], timeout=6, check=False)
    child, grandchild = tree_pids(pidfile, timeout=0)
    try:
        assert not alive(child) and alive(grandchild)
    finally:
        os.kill(grandchild, signal.SIGKILL)
    assert_gone([grandchild])


def test_negative_control_killing_the_process_group_leaves_an_own_session_grandchild(tmp_path):
    """Why the launcher also kills by its environment tag: a group kill misses what torchrun starts (own sessions)."""
    pidfile = tmp_path / "pids"
    proc = subprocess.Popen([PYTHON, "-c", TREE, str(pidfile), "own-session"], start_new_session=True)
    child, grandchild = tree_pids(pidfile)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    try:
        assert not alive(child) and alive(grandchild)
    finally:
        os.kill(grandchild, signal.SIGKILL)
    assert_gone([grandchild])


@pytest.fixture
def python_sigint_handler():
    """A suite started in the background (`make test &`) inherits SIGINT ignored, and then interrupt_main() does
    nothing: Python's own Ctrl-C handler for the test, the inherited one restored after it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("grandchild", GRANDCHILD)
def test_ctrl_c_kills_the_tree(tmp_path, grandchild, python_sigint_handler):
    pidfile = tmp_path / "pids"
    found: list[int] = []

    def interrupt_once_started():
        found.extend(tree_pids(pidfile))
        _thread.interrupt_main()  # what Ctrl-C does: KeyboardInterrupt in the main thread

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run([PYTHON, "-c", TREE, pidfile, grandchild], timeout=300)
    assert_gone(found)


CALLER = "import sys; from tools.launcher import run; run([sys.executable, '-c', *sys.argv[1:]], timeout=300)"


def test_sigterm_to_the_caller_kills_the_tree_and_then_the_caller(tmp_path):
    """The tree is in its own session, so a SIGTERM to the caller's group (CI's `timeout`) does not reach it: the
    launcher kills it, then the caller ends as SIGTERM would have ended it."""
    pidfile = tmp_path / "pids"
    caller = subprocess.Popen([PYTHON, "-c", CALLER, TREE, str(pidfile), "own-session"], cwd=tmp_path)
    try:
        pids = tree_pids(pidfile)
        caller.send_signal(signal.SIGTERM)
        assert caller.wait(timeout=30) == -signal.SIGTERM
    finally:
        caller.kill()
    assert_gone(pids)


def test_failure_raises_with_the_output_tail_and_check_false_returns():
    script = "import sys; print('to stdout'); print('to stderr', file=sys.stderr); sys.exit(3)"
    with pytest.raises(LaunchError, match=r"(?s)exit code 3.*to stdout.*to stderr"):
        run([PYTHON, "-c", script])
    proc = run([PYTHON, "-c", script], check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "to stdout\n", "to stderr\n")


def test_a_failed_node_stops_the_other_nodes(tmp_path):
    """Two torchrun 'nodes' (torchrun puts each worker in a session of its own): node 1's rank fails at once, node
    0's would wait forever; the launch ends at once, node 0's worker with it."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os, pathlib, sys, time\n"
                      "print(os.environ['ZEROTRAIN_NODE_NAME'], os.environ['RANK'], flush=True)\n"
                      "pathlib.Path(sys.argv[1], os.environ['RANK']).write_text(str(os.getpid()))\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    while not pathlib.Path(sys.argv[1], '0').exists():  # node 0's worker is up\n"
                      "        time.sleep(0.05)\n"
                      "    sys.exit(1)\n"
                      "time.sleep(300)\n")
    started = time.monotonic()
    with pytest.raises(LaunchError, match="node 1") as error:
        launch_nodes(2, 1, worker, tmp_path, timeout=300)
    assert time.monotonic() - started < 120
    node0, node1 = error.value.results
    assert node1.returncode == 1 and "node1 1" in node1.stdout
    assert node0.returncode != 0 and "node0 0" in node0.stdout  # killed (or ended by its failed peer)
    assert_gone([int((tmp_path / "0").read_text())])
