"""The one way the tests and the benchmarks start processes: a command, a torchrun job, or N "nodes" of torchrun.

    run([PYTHON, "train.py", "recipe=tiny_llama"], timeout=300)      # -> CompletedProcess; LaunchError if exit != 0
    torchrun(4, "train.py", "recipe=tiny_llama", timeout=900)       # torchrun --standalone --nproc_per_node 4
    launch_nodes(2, 2, "tests/comm/worker_comm.py", "out.json")     # 2 x torchrun --nnodes 2, rendezvous 127.0.0.1

Nothing a launch starts outlives the call: on a timeout, on Ctrl-C or SIGTERM/SIGHUP, when another node of the same
launch fails (its peers would wait for it until the timeout), and after a normal exit (stragglers), every process of
the launch is killed with SIGKILL — torchrun, its workers, and anything they spawned. A hung collective therefore
costs one timeout, never a machine full of orphans. Killing the command's process group is not enough: torchrun
(torch.distributed.elastic) starts every worker in a session of its own. So each command starts in its own session
*and* with a variable ``ZEROTRAIN_LAUNCH_<id>`` in its environment, which every descendant inherits, in whatever
session and whoever its parent is by then; the kill takes the group, then every process whose environment holds the
launch's variable (``/proc/<pid>/environ``), until none is left.

Output is captured (stdout and stderr apart, as ``subprocess.run(capture_output=True)``); failures and timeouts
raise :class:`LaunchError` whose message ends with the tail of the output.

Every process gets :data:`CPU_ENV` over the caller's environment, then the call's ``env``. Nothing touches
``sys.path`` or ``PYTHONPATH``: ``zerotrain`` and ``tools`` are installed (``pip install -e .``), and a worker
script finds the helper modules next to it because Python puts a script's own directory first on ``sys.path``.

Not to be confused with :mod:`zerotrain.launch`, which runs *inside* a job (rank layout, rendezvous checks).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# What every DeepSpeed process of the tests and benchmarks needs on a CPU-only machine (measured traps: without
# OMP_NUM_THREADS=1 the processes oversubscribe the cores several times over; DeepSpeed JIT-builds its comm op into
# TORCH_EXTENSIONS_DIR once per checkout). Nothing may reach the Hugging Face hub or the W&B server.
CPU_ENV = {
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions"),
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}

OUTPUT_TAIL_CHARS = 6000
POLL_S = 0.1
DRAIN_JOIN_S = 10.0  # after the kill, how long to wait for the pipes to close (a process that dropped the tag)
KILL_ROUNDS_S = 10.0  # how long to keep killing a launch's processes (each round catches what forked meanwhile)
TAG_PREFIX = "ZEROTRAIN_LAUNCH_"
_FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

Arg = str | Path


class LaunchError(RuntimeError):
    """A launched command exited non-zero (``check=True``) or ran past its timeout. ``results`` holds what every
    process of the launch returned (killed ones with a negative return code)."""

    def __init__(self, message: str, results: Sequence[subprocess.CompletedProcess]):
        super().__init__(message)
        self.results = list(results)


class LaunchTimeout(LaunchError):
    """The launch ran past its timeout; its process groups were killed."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's choice), for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: Sequence[Arg], *, timeout: float = 600, cwd: Arg = REPO, env: Mapping[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run one command (in its own process group) with :data:`CPU_ENV`; see the module docstring."""
    return _launch([[str(a) for a in args]], [dict(env or {})], timeout=timeout, cwd=cwd, check=check)[0]


def torchrun(nproc: int, script: Arg, *args: Arg, **kwargs) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node N script args...``; keyword arguments as for :func:`run`."""
    return run([PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args],
               **kwargs)


def launch_nodes(nnodes: int, nproc_per_node: int, script: Arg, *args: Arg, timeout: float = 600, cwd: Arg = REPO,
                 env: Mapping[str, str] | None = None,
                 check: bool = True) -> list[subprocess.CompletedProcess]:
    """``script args`` as ``nnodes`` torchrun launches of ``nproc_per_node`` ranks each on this host (static
    rendezvous on 127.0.0.1), node i with ``ZEROTRAIN_NODE_NAME=node<i>`` so ``zerotrain.launch.layout`` sees
    ``nnodes`` nodes. One result per node; the first node to fail stops the others."""
    port = free_port()
    commands = [[PYTHON, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={i}",
                 f"--nproc_per_node={nproc_per_node}", "--master_addr=127.0.0.1", f"--master_port={port}",
                 str(script), *map(str, args)] for i in range(nnodes)]
    envs = [{"ZEROTRAIN_NODE_NAME": f"node{i}", **(env or {})} for i in range(nnodes)]
    return _launch(commands, envs, timeout=timeout, cwd=cwd, check=check)


# ----------------------------------------------------------------------------------------------------------------
# The core: start every command in its own session, wait, kill all it started, collect the output
# ----------------------------------------------------------------------------------------------------------------


class _Drain:
    """Reads a pipe to its end in a thread (several processes' pipes must be read at once, or one fills up and its
    writer blocks). Raw os.read: whatever arrived is kept even if the pipe never closes."""

    def __init__(self, pipe):
        self.pipe, self.chunks = pipe, []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        fd = self.pipe.fileno()
        while chunk := os.read(fd, 65536):
            self.chunks.append(chunk)

    def text(self) -> str:
        self.thread.join(DRAIN_JOIN_S)
        if not self.thread.is_alive():  # else a process that dropped the tag still holds the pipe: leave it
            self.pipe.close()
        return b"".join(self.chunks).decode(errors="replace")


class _Forwarded(BaseException):
    """SIGTERM/SIGHUP arrived while we waited: kill the launched groups, then let the signal do what it would."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _tagged_pids(tag: str) -> list[int]:
    """Processes whose environment holds ``tag`` (Linux /proc; elsewhere none: the group kill is all there is)."""
    needle = b"\0" + tag.encode() + b"="
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle in b"\0" + environ:  # a zombie's environ reads empty: it has exited already
            found.append(int(entry))
    return found


def _kill_tree(procs: list[subprocess.Popen], tag: str) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group's id is the leader's pid (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass  # the whole group is gone already
    deadline = time.monotonic() + KILL_ROUNDS_S
    while (pids := _tagged_pids(tag)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    for proc in procs:
        proc.wait()


def _wait(procs: list[subprocess.Popen], deadline: float) -> bool:
    """Until every process has exited, one has failed, or the deadline passed; False on the deadline."""
    while True:
        codes = [p.poll() for p in procs]  # every one, every time: poll() is what notices (and reaps) an exit
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)


def _launch(commands: list[list[str]], envs: list[dict[str, str]], timeout: float, cwd: Arg,
            check: bool) -> list[subprocess.CompletedProcess]:
    tag = TAG_PREFIX + secrets.token_hex(8)
    base_env = {**os.environ, **CPU_ENV, tag: "1"}
    procs: list[subprocess.Popen] = []
    drains: list[tuple[_Drain, _Drain]] = []
    finished = True
    forwarded = _install_forwarding()
    try:
        deadline = time.monotonic() + timeout
        for argv, env in zip(commands, envs):
            proc = subprocess.Popen(argv, cwd=cwd, env={**base_env, **env}, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            procs.append(proc)
            drains.append((_Drain(proc.stdout), _Drain(proc.stderr)))
        finished = _wait(procs, deadline)
    except _Forwarded as signalled:
        _kill_tree(procs, tag)
        _restore_forwarding(forwarded)
        os.kill(os.getpid(), signalled.signum)  # the previous disposition now: by default this process ends here
        raise SystemExit(128 + signalled.signum) from None  # a handler that returned: stop the caller all the same
    finally:
        _kill_tree(procs, tag)  # on every path: the timeout, a failed peer, Ctrl-C, stragglers of a clean exit
        _restore_forwarding(forwarded)
    results = [subprocess.CompletedProcess(argv, proc.returncode, out.text(), err.text())
               for argv, proc, (out, err) in zip(commands, procs, drains)]
    if not finished:
        raise LaunchTimeout(_report(f"ran past its {timeout:g} s timeout; its processes were killed", results),
                            results)
    if check and any(r.returncode != 0 for r in results):
        raise LaunchError(_report("failed", results), results)
    return results


def _install_forwarding() -> dict:
    """Turn SIGTERM/SIGHUP into an exception while we wait (main thread only: Python delivers signals there), so
    the launched groups, which are in their own sessions and do not get a signal sent to ours, are killed too."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, _frame):
        raise _Forwarded(signum)

    return {sig: signal.signal(sig, handler) for sig in _FORWARDED_SIGNALS}


def _restore_forwarding(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    previous.clear()


def _report(what: str, results: Sequence[subprocess.CompletedProcess]) -> str:
    tail = OUTPUT_TAIL_CHARS // len(results)
    parts = []
    for i, r in enumerate(results):
        name = " ".join(r.args) if len(results) == 1 else f"node {i}: {' '.join(r.args)}"
        parts.append(f"{name}\nexit code {r.returncode}\n--- output tail ---\n{(r.stdout + r.stderr)[-tail:]}")
    return f"launch {what}\n" + "\n".join(parts)
