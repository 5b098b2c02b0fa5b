"""Run a command on N emulated nodes of this Linux host: one network namespace per node, shaped links between them.

    sudo .venv/bin/python -m tools.emulate --nodes 2 --nproc-per-node 2 --rate 100mbit --delay 1ms \\
        train.py recipe=tiny_llama train.steps=20 zero=zero3_hpz_cpu
    sudo .venv/bin/python -m tools.emulate --nodes 2 --rate 50mbit -- \\
        .venv/bin/python -m torch.distributed.run --nnodes {nnodes} --node_rank {node_rank} --nproc_per_node 2 \\
        --master_addr {master_addr} --master_port {master_port} train.py recipe=tiny_llama
    sudo .venv/bin/python -m tools.emulate --cleanup      # remove leftovers of a SIGKILLed run

(``sudo .venv/bin/zerotrain-emulate ...`` is the same command, installed by ``pip install -e .``.)

With ``--nproc-per-node K`` the command is a script and its arguments, launched on every node with
``torchrun --nnodes N --node_rank i --nproc_per_node K --master_addr <node 0> --master_port P``. Without it the
command runs as given on every node, with ``{node_rank} {nnodes} {master_addr} {master_port} {node_name}
{ifname}`` substituted. Every node's processes get ``ZEROTRAIN_NODE_NAME=node<i>`` (zerotrain's rank-to-node
layout), ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME=eth0``, ``MASTER_ADDR``/``MASTER_PORT``. Output lines are
prefixed with ``[node i]``; an error message every node reports (a config or layout error) is shown once. The exit
status is the first non-zero node's (0 when all succeed, 130 on Ctrl-C): with ``--nproc-per-node`` the failed rank's
own code (``zerotrain.launch.torchrun``: 2 for a user error, 75 for a preemption), not torchrun's 1.

Needs root, ``ip`` and ``tc`` (iproute2). Everything it creates (``zt-<tag>-*`` namespaces, their veths and bridge,
addresses in 10.213.0.0/24 that exist only inside them) is deleted when the command ends, fails, or is interrupted
(Ctrl-C, SIGTERM, SIGHUP). See docs/emulated_cluster.md.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from tools.emulate import (
    IFNAME,
    EmulatedCluster,
    EmulatorError,
    SignalExit,
    check_host,
    cleanup_stale,
    install_signal_handlers,
    parse_delay,
    parse_rate,
    torchrun_argv,
)

MASTER_PORT = 29500  # the namespaces are fresh: no port is taken


# A zerotrain error as a rank prints it ("error: ...") or a node's launcher repeats it for a rank whose node has no
# rank 0 ("error (rank 2): ..."): on a real cluster each node has its own log, here the streams merge into one.
_ERROR_LINE = re.compile(r"^error(?: \(rank \d+\))?: (.*)$")


class _SeenErrors:
    """The error messages already shown, across the nodes' output threads: the same one is printed once."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def first(self, message: str) -> bool:
        with self._lock:
            new = message not in self._seen
            self._seen.add(message)
            return new


def _pump(stream, prefix: str, sink, errors: _SeenErrors) -> None:
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        match = _ERROR_LINE.match(text.rstrip("\n"))
        if match and not errors.first(match.group(1)):
            continue
        sink.write(prefix + text)
        sink.flush()
    stream.close()


def build_argv(args, cluster: EmulatedCluster, node: int) -> list[str]:
    if args.nproc_per_node:
        return torchrun_argv(args.python, cluster, node, args.nproc_per_node, MASTER_PORT, args.command)
    fields = {"node_rank": node, "nnodes": cluster.nodes, "master_addr": cluster.master_addr,
              "master_port": MASTER_PORT, "node_name": f"node{node}", "ifname": IFNAME}
    return [part.format(**fields) for part in args.command]


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    parser.add_argument("--nproc-per-node", type=int, default=0,
                        help="launch the command through torchrun with this many ranks per node")
    parser.add_argument("--rate", default=None, help="inter-node bandwidth per node and direction: 100mbit, 1gbit; "
                                                     "default unshaped")
    parser.add_argument("--delay", default="0ms", help="one-way inter-node delay, e.g. 1ms (needs sch_netem)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for --nproc-per-node launches")
    parser.add_argument("--log-dir", type=Path, default=None, help="also write node<i>.log files here")
    parser.add_argument("--cleanup", action="store_true", help="delete leftover zt-* namespaces and exit")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    logging.basicConfig(level=logging.INFO, format="[emulate] %(message)s")
    log = logging.getLogger("tools.emulate")

    try:
        check_host()
    except EmulatorError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = cleanup_stale()
        print("removed: " + (", ".join(removed) if removed else "nothing"))
        return 0
    if not args.command:
        parser.error("no command given")
    try:
        rate, delay = parse_rate(args.rate), parse_delay(args.delay)
    except ValueError as e:
        parser.error(str(e))

    install_signal_handlers()
    cluster = EmulatedCluster(nodes=args.nodes, rate_mbit=rate, delay_ms=delay)
    status = 0
    try:
        cluster.setup()
        log.info("%d nodes, inter-node links: %s; namespaces %s", args.nodes, cluster.describe_link(),
                 ", ".join(cluster.namespaces))
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
        procs, pumps, errors = [], [], _SeenErrors()
        for i in range(args.nodes):
            env = cluster.node_env(i, MASTER_PORT)
            sink = sys.stdout
            if args.log_dir:
                sink = _Tee(sys.stdout, open(args.log_dir / f"node{i}.log", "w"))
            p = cluster.popen(i, build_argv(args, cluster, i), env=env, stdout=-1, stderr=-2)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[node{i}] ", sink, errors), daemon=True)
            t.start()
            procs.append(p)
            pumps.append(t)
        # Wait for all; the first failure stops the rest (a dead node would leave the others hanging).
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed:
                status = failed[0].returncode
                log.error("a node exited with %d: stopping the others", status)
                break
            time.sleep(0.2)
        for t in pumps:
            t.join(timeout=5)
        if not status:
            status = next((p.returncode for p in procs if p.returncode), 0)
        bytes_ = cluster.link_bytes() if rate is not None else {}
        if bytes_:
            log.info("bytes through the shaped links: %s", bytes_)
    except KeyboardInterrupt:
        log.error("interrupted: cleaning up")
        status = 130
    except SignalExit as e:
        log.error("%s: cleaning up", e)
        status = 128 + e.signum
    except EmulatorError as e:
        print(f"error: {e}", file=sys.stderr)
        status = 2
    finally:
        cluster.close()
        log.info("removed namespaces %s", ", ".join(cluster.namespaces))
    return status


class _Tee:
    def __init__(self, *sinks):
        self.sinks = sinks

    def write(self, text: str) -> None:
        for s in self.sinks:
            s.write(text)

    def flush(self) -> None:
        for s in self.sinks:
            s.flush()


if __name__ == "__main__":
    sys.exit(main(prog="python -m tools.emulate"))
