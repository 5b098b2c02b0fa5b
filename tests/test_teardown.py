"""A rank's exit code survives the C++ teardown (zerotrain/launch/teardown.py).

The abort it guards against ("terminate called without an active exception", exit 134, in gloo's teardown at
interpreter finalization) is intermittent: seen in three full-suite runs, once each after an export, a collective
timeout and a preemption checkpoint, never in 20 tries in a row. The tests below make it certain instead: the child's
interpreter finalization aborts the process (an object in a module's globals that calls ``os.abort`` when it is
collected, as a library's destructor does), which is exactly the part of the exit ``exit_with`` skips. Without
``exit_with`` (the negative control) the same child exits 134.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tools.launcher import PYTHON, run

CHILD = """
import atexit, os, sys

class AbortsInFinalization:  # a library object whose destructor aborts, as gloo's teardown did
    def __del__(self):
        os.abort()

LIBRARY_STATE = AbortsInFinalization()
atexit.register(lambda: print("atexit ran", flush=True))

def main():
    print("main ran", flush=True)
    {body}

if __name__ == "__main__":
    if sys.argv[1] == "exit_with":
        from zerotrain.launch.teardown import exit_with
        exit_with(main)
    sys.exit(main())
"""


def child(tmp_path: Path, body: str, how: str):
    script = tmp_path / f"child_{how}.py"
    script.write_text(CHILD.format(body=textwrap.indent(body, "    ").strip()))
    return run([PYTHON, str(script), how], check=False, timeout=120)


@pytest.mark.parametrize("code", [0, 5, 75])
def test_the_code_main_returns_is_the_exit_code_even_when_finalization_aborts(tmp_path, code):
    proc = child(tmp_path, f"return {code}", "exit_with")
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.splitlines() == ["main ran", "atexit ran"]  # the atexit functions ran; finalization did not

    # Negative control: the same child ending through sys.exit is killed by its finalization.
    plain = child(tmp_path, f"return {code}", "sys.exit")
    assert plain.returncode == -6 or plain.returncode == 134, plain.stderr


def test_an_exception_is_printed_and_exits_1_and_ctrl_c_exits_130_in_one_line(tmp_path):
    proc = child(tmp_path, "raise ValueError('a bug')", "exit_with")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ValueError: a bug" in proc.stderr

    proc = child(tmp_path, "raise KeyboardInterrupt", "exit_with")
    assert proc.returncode == 130
    assert proc.stderr.strip() == "interrupted"

    proc = child(tmp_path, "raise SystemExit('a message')", "exit_with")
    assert (proc.returncode, proc.stderr.strip()) == (1, "a message")


RANKS = """
import atexit, os, sys
import torch, torch.distributed as dist

def main():
    dist.init_process_group("gloo")
    dist.new_group([0, 1])
    dist.all_reduce(torch.ones(4))
    # One write(2) per line: the two ranks share the launcher's pipe, and print's pieces interleave there.
    atexit.register(lambda: os.write(1, f"initialized at exit: {dist.is_initialized()}\\n".encode()))
    return int(os.environ["CODE"])

from zerotrain.launch.teardown import exit_with
exit_with(main)
"""


@pytest.mark.parametrize("code,destroyed", [(75, True), (5, False)])
def test_process_groups_are_destroyed_after_an_agreed_outcome_and_left_after_a_failure(tmp_path, code, destroyed):
    """After 0 or 75 (every rank got there together) the groups are destroyed before the atexit functions run; after
    a failure they are left alone: a group whose peer is stopped would wait in its destructor."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    proc = run([PYTHON, "-m", "zerotrain.launch.torchrun", "--standalone", "--nproc_per_node=2", str(script)],
               env={"CODE": str(code)}, check=False, timeout=180)
    assert proc.returncode == code, proc.stderr[-3000:]
    assert proc.stdout.count(f"initialized at exit: {not destroyed}") == 2, proc.stdout
