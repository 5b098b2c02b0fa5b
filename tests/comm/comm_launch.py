"""Launch helpers for the comm tests: N emulated nodes on this host as N ``torchrun --nnodes N`` launches.

No namespaces here: each launch gets ``ZEROTRAIN_NODE_NAME=node<i>`` (read by ``zerotrain.launch.layout``), so the
trainer's layout, hpZ group checks and the comm accounting see N nodes while gloo talks over 127.0.0.1.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from launch_utils import CPU_ENV as COMM_ENV  # the one CPU environment of the test suite
from launch_utils import REPO

HERE = Path(__file__).resolve().parent



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(script: Path, *args: str, nnodes: int = 2, nproc_per_node: int = 2, timeout: float = 600,
                 env: dict | None = None) -> tuple[list[int], str, float]:
    """Run ``script args`` as ``nnodes`` torchrun launches of ``nproc_per_node`` ranks each (static rendezvous on
    127.0.0.1). Returns (exit codes, combined output, wall seconds)."""
    port = free_port()
    procs = []
    t0 = time.time()
    for i in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={i}",
               f"--nproc_per_node={nproc_per_node}", "--master_addr=127.0.0.1", f"--master_port={port}",
               str(script), *args]
        full_env = {**os.environ, **COMM_ENV, "ZEROTRAIN_NODE_NAME": f"node{i}", **(env or {})}
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, timeout - (time.time() - t0)))
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n".join(f"--- node{i} ---\n{o}" for i, o in enumerate(outputs))
    return [p.returncode for p in procs], text, time.time() - t0
