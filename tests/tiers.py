"""The test tiers: which tests start processes (``launch``), which need the local SLURM cluster (``slurm``), and the
guard that keeps the fast tier (neither) honest.

Marking (``mark_tiers``, from ``pytest_collection_modifyitems``): a test is ``launch`` when its function, one of the
fixtures it uses (its whole fixture closure: ``shakespeare``, a module's ``one_rank_run``...), or a helper those call,
refers to something that starts a process: ``tools.launcher`` (``run``, ``torchrun``, ``launch_nodes``), the
``subprocess``, ``multiprocessing`` or ``torch.multiprocessing`` modules, or ``os.system``/``fork``/``spawn*``/
``exec*``/``posix_spawn*``. Helpers are followed through the globals they are looked up in (functions and classes
defined under tests/, e.g. ``slurm_testlib``); library code (zerotrain, tools) is not followed: a test that launches
only through it carries ``@pytest.mark.launch`` itself. A test that uses the ``slurm_cluster`` fixture is ``slurm``.

The guard (``SpawnGuard``, an audit hook, ``sys.addaudithook``): while a test outside both tiers is set up or run,
any process it starts that runs our code or a cluster (a fork, ``os.system``/``exec``/``spawn``, or a
``subprocess.Popen``/``os.posix_spawn`` of an interpreter, a launcher, a shell or a SLURM command: ``SLOW_PROGRAMS``)
is refused with :class:`UnmarkedLaunch` naming the test and the command, and the test fails even if
something caught that error. It is on in every run (``make test`` too): a new test that launches without being
detected fails on its first run instead of silently slowing ``make test-fast`` down. The teardown phase is not
watched: a session fixture's teardown (stopping the SLURM cluster) runs in whatever test happens to be the last.
"""

from __future__ import annotations

import dis
import os
import sys
import types
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

import tools.launcher

TESTS = Path(__file__).resolve().parent
LAUNCH, SLURM = "launch", "slurm"
SLURM_FIXTURES = frozenset({"slurm_cluster"})
SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.fork", "os.forkpty", "os.system", "os.exec",
                          "os.spawn", "pty.spawn"})

# What the guard refuses: a process that runs our code or a cluster (an interpreter, a launcher, a shell, SLURM), the
# launches that cost a fast test seconds. A library probing its environment with a small tool (matplotlib's
# ``fc-list`` on a cold font cache, a compiler's ``--version``) is allowed: whether it happens depends on the machine's
# caches, not on the test, and it costs milliseconds.
SLOW_PROGRAMS = frozenset({"torchrun", "deepspeed", "sh", "bash", "dash", "srun", "sbatch", "salloc", "scontrol",
                           "scancel", "squeue", "sacct", "slurmd", "slurmctld", "munged", "ip", "tc"})

_LAUNCHING_MODULES = frozenset({"subprocess", "multiprocessing", "torch.multiprocessing", "tools.launcher"})
_LAUNCHING_OBJECTS = {tools.launcher.run, tools.launcher.torchrun, tools.launcher.launch_nodes, os.system, os.fork,
                      os.posix_spawn, os.posix_spawnp, os.spawnv, os.spawnl, os.execv, os.execvp, os.execve}


class UnmarkedLaunch(RuntimeError):
    """A test outside the ``launch`` and ``slurm`` tiers started a process."""


def _launches(obj: object) -> bool:
    if isinstance(obj, types.ModuleType):
        return obj.__name__ in _LAUNCHING_MODULES
    try:
        return obj in _LAUNCHING_OBJECTS
    except TypeError:  # unhashable
        return False


def _defined_in_tests(obj: object) -> bool:
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    path = getattr(module, "__file__", None)
    return path is not None and Path(path).resolve().is_relative_to(TESTS)


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _functions_of(obj: object) -> Iterator[types.FunctionType]:
    """The Python functions behind a function, a fixture wrapper or a class (its methods)."""
    obj = getattr(obj, "__wrapped__", obj)
    if isinstance(obj, types.FunctionType):
        yield obj
    elif isinstance(obj, type):
        for value in vars(obj).values():
            value = getattr(value, "__func__", value)
            if isinstance(value, types.FunctionType):
                yield value


def refers_to_a_launch(obj: object, seen: set[int] | None = None) -> bool:
    """``obj`` (a test, a fixture's function, a class) refers to a way of starting a process, directly or through
    functions and classes defined under tests/ that it names as globals."""
    seen = set() if seen is None else seen
    for function in _functions_of(obj):
        if id(function) in seen:
            continue
        seen.add(id(function))
        for code in _code_objects(function.__code__):
            for instruction in dis.get_instructions(code):
                if instruction.opname not in ("LOAD_GLOBAL", "LOAD_NAME"):
                    continue
                name = instruction.argval
                value = function.__globals__.get(name)
                if _launches(value):
                    return True
                if _defined_in_tests(value) and refers_to_a_launch(value, seen):
                    return True
    return False


def _fixture_functions(item: pytest.Item) -> Iterator[tuple[str, object]]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    for name in info.names_closure:
        for fixturedef in info.name2fixturedefs.get(name, ()):
            yield name, fixturedef.func


def mark_tiers(items: list[pytest.Item]) -> None:
    """Add the ``launch`` and ``slurm`` marks (see the module docstring) to the collected tests."""
    for item in items:
        fixtures = list(_fixture_functions(item))
        if any(name in SLURM_FIXTURES for name, _ in fixtures):
            item.add_marker(SLURM)
        function = getattr(item, "function", None)
        if item.get_closest_marker(LAUNCH) is None and (
                refers_to_a_launch(function) or any(refers_to_a_launch(f) for _, f in fixtures)):
            item.add_marker(LAUNCH)


def in_fast_tier(item: pytest.Item) -> bool:
    return item.get_closest_marker(LAUNCH) is None and item.get_closest_marker(SLURM) is None


class SpawnGuard:
    """The audit hook of the module docstring. ``watching`` is the fast-tier test being set up or run, or None."""

    def __init__(self) -> None:
        self.watching: pytest.Item | None = None
        self.seen: list[str] = []
        sys.addaudithook(self._hook)

    @staticmethod
    def _is_slow(event: str, args: tuple) -> bool:
        if event not in ("subprocess.Popen", "os.posix_spawn"):
            return True  # fork, system, exec*, spawn*: always a process of our own
        program = args[0] or args[1]  # Popen: (executable or None, args, ...); posix_spawn: (path, argv, env)
        if isinstance(program, (list, tuple)):
            program = program[0] if program else ""
        name = os.path.basename(os.fsdecode(program)).split()[0] if program else ""
        return not name or name.startswith("python") or name in SLOW_PROGRAMS

    def _hook(self, event: str, args: tuple) -> None:
        if self.watching is None or event not in SPAWN_EVENTS or not self._is_slow(event, args):
            return
        what = f"{event} {args[1] if event == 'subprocess.Popen' else args[0] if args else ''}"
        self.seen.append(what)
        raise UnmarkedLaunch(f"{self.watching.nodeid} is in the fast tier but started a process ({what[:300]}): mark "
                             "it @pytest.mark.launch (tests/tiers.py says how tests are marked)")

    def watch(self, item: pytest.Item) -> Generator[None, object, object]:
        """Watch ``item`` during one phase (the body of a ``wrapper=True`` hook: ``return (yield from ...)``); fail
        it if it started a process."""
        if not in_fast_tier(item):
            return (yield)
        self.watching, self.seen = item, []
        try:
            result = yield
        finally:
            self.watching = None
        if self.seen:
            pytest.fail(f"{item.nodeid} is in the fast tier but started a process: {self.seen[0][:300]}; mark it "
                        "@pytest.mark.launch (tests/tiers.py)", pytrace=False)
        return result
