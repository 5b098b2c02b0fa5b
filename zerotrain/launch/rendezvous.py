"""Check the rendezvous address before creating the process group, and fail in bounded time with a useful message.

Without this, a wrong MASTER_ADDR shows up as every rank hanging inside ``init_process_group`` for the store's
timeout (tens of minutes) and then an opaque socket error. Here each rank instead:

1. resolves MASTER_ADDR (bounded: a broken DNS server can make getaddrinfo hang), then
2. rank 0 checks it can listen on MASTER_PORT; every other rank polls a TCP connection to MASTER_ADDR:MASTER_PORT
   until rank 0's store answers or the deadline passes (rank 0 may still be importing when others get here).

A failure raises :class:`RendezvousError` naming the rank, its node, the address and what to check. There is
never a fallback to localhost: a multi-node job that silently rendezvoused locally would train N separate models.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping

from zerotrain.errors import RendezvousError

# Rank 0 must import torch/DeepSpeed before its store listens; on a cold shared file system that can take minutes.
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "ZEROTRAIN_RENDEZVOUS_TIMEOUT"


def rank_and_node(environ: Mapping[str, str]) -> str:
    node = environ.get("SLURMD_NODENAME") or socket.gethostname()
    return f"rank {environ.get('RANK', '?')} on node {node}"


def resolve(host: str, timeout_s: float) -> list[str]:
    """Resolve ``host`` to its addresses, giving up after ``timeout_s`` (getaddrinfo itself has no timeout)."""
    result: dict[str, object] = {}

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            result["addresses"] = sorted({str(info[4][0]) for info in infos})
        except OSError as e:
            result["error"] = e

    thread = threading.Thread(target=lookup, daemon=True)  # daemon: a hung lookup must not block exit
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"resolving '{host}' took longer than {timeout_s:.0f} s")
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["addresses"]  # type: ignore[return-value]


def is_loopback(addresses: list[str]) -> bool:
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def wait_until_reachable(host: str, port: int, timeout_s: float, interval_s: float = 0.5) -> None:
    """Poll a TCP connection to host:port until one succeeds; raise the last error after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            # The probe connects and closes at once; torch's TCPStore shrugs off such clients.
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, remaining))):
                return
        except OSError as e:
            if time.monotonic() + interval_s >= deadline:
                raise TimeoutError(f"no answer within {timeout_s:.0f} s (last error: {e})") from e
            time.sleep(interval_s)


def check_port_free(port: int) -> None:
    """Rank 0 will listen on ``port``: fail now if another process already does (a clash of derived ports)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does: TIME_WAIT is fine
        probe.bind(("", port))


def _timeout(environ: Mapping[str, str], timeout_s: float | None) -> float:
    if timeout_s is not None:
        return timeout_s
    return float(environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


def _hints(host: str, port: int) -> str:
    return (
        f"Check: (1) rank 0's log: did it crash or hang before creating the process group? "
        f"(2) `getent hosts {host}` on this node gives an address of the master node that this node can route to "
        f"(not 127.x unless all ranks run on one machine); "
        f"(3) no firewall blocks TCP port {port} between the nodes; "
        f"(4) the socket interface settings (NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME in the cluster config) name "
        f"an interface that exists on every node. Raise cluster.init_timeout_s (or set {TIMEOUT_ENV}) to wait longer "
        f"for a slow-starting rank 0."
    )


def check_rendezvous(environ: Mapping[str, str] = os.environ, timeout_s: float | None = None) -> None:
    """Verify MASTER_ADDR/MASTER_PORT are usable from this rank; call just before ``init_process_group``.

    Raises :class:`RendezvousError` within about ``timeout_s`` seconds (default 300, or $ZEROTRAIN_RENDEZVOUS_TIMEOUT).
    """
    timeout = _timeout(environ, timeout_s)
    where = rank_and_node(environ)
    host, port_text = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if not host or not port_text:
        raise RendezvousError(
            f"{where}: MASTER_ADDR/MASTER_PORT are not set. Launch with slurm/train.sbatch (srun) or torchrun; "
            "there is deliberately no default address."
        )
    port = int(port_text)
    try:
        addresses = resolve(host, min(timeout, 30.0))
    except (OSError, TimeoutError) as e:
        raise RendezvousError(
            f"{where}: cannot resolve the rendezvous host MASTER_ADDR={host!r}: {e}. "
            f"Check that the node names SLURM uses resolve on the compute nodes (`getent hosts {host}`), "
            "or that MASTER_ADDR was not inherited from the submitting shell."
        ) from None

    rank = int(environ.get("RANK", "0"))
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"  # torchrun already listens
    if rank == 0 and not agent_store:
        try:
            check_port_free(port)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise RendezvousError(
                f"{where}: rendezvous port {port} is already in use on the master node {host}. Another job on "
                "this node derived the same port; export ZEROTRAIN_MASTER_PORT=<free port> and resubmit."
            ) from None
        return

    if is_loopback(addresses) and environ.get("NODE_RANK", "0") != "0":
        # Legitimate only when several emulated nodes share one machine (the test cluster); on a real cluster
        # this node would be talking to itself, so say so before the connection attempt times out.
        print(
            f"[zerotrain.launch] warning: {where}: MASTER_ADDR={host} resolves to loopback {addresses} on a node "
            "other than the master's; fine for a single-machine test cluster, wrong anywhere else.",
            file=sys.stderr,
            flush=True,
        )
    try:
        wait_until_reachable(host, port, timeout)
    except TimeoutError as e:
        raise RendezvousError(
            f"{where}: cannot reach the rendezvous {host}:{port} ({', '.join(addresses)}) — {e}. "
            + _hints(host, port)
        ) from None
