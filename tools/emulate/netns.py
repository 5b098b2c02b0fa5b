"""N emulated nodes on one Linux host: a network namespace per node, a bridge between them, shaped links.

Topology (all names start with ``zt-<tag>``; nothing is created in the host's own network namespace)::

    zt-<tag>-n0 (node 0)          zt-<tag>-sw (switch)            zt-<tag>-n1 (node 1)
    lo  <- ranks of node 0        br0                             lo  <- ranks of node 1
    eth0 10.213.0.10/24 ==veth== p0 -- br0 -- p1 ==veth== eth0 10.213.0.11/24
         ^ egress shaped (uplink)    ^ egress shaped (downlink)

* Inter-node traffic leaves a node through its ``eth0`` (uplink: rate + one-way delay on its egress qdisc) and
  enters the other node through the switch port ``p<j>`` (downlink: rate on its egress qdisc). Every direction of
  every node pair therefore crosses exactly one shaped uplink and one shaped downlink: a node's NIC has ``rate`` each
  way, as a real node on an Ethernet switch would.
* Intra-node traffic never touches ``eth0``: ranks of one node all live in the node's namespace, and a connection
  to the namespace's own address (10.213.0.1x, what gloo binds with ``GLOO_SOCKET_IFNAME=eth0``) is routed through
  the namespace's loopback by Linux's local routing table, unshaped. So gloo needs nothing special: every rank binds
  ``eth0``; same-node peers meet over ``lo`` at memory speed, other-node peers over the shaped veth.
* The switch is its own namespace (not the host's): no bridge, veth or address appears in the host's network
  stack, nothing routes between 10.213.0.0/24 and the outside (there is no gateway), so the traffic cannot leave the
  host, and the host's firewall (Docker's FORWARD DROP with br_netfilter, ...) cannot interfere. Each cluster has
  its own bridge, so several emulators may run at once with the same addresses.

Shaping uses ``netem`` (``delay`` + ``rate``) when the kernel has it, else ``tbf`` (rate only; a kernel without
``sch_netem`` cannot add delay, and the emulator says so once). ``rate=None`` leaves the links unshaped.

Cleanup: :meth:`EmulatedCluster.close` (also ``__exit__``) kills every process still inside the namespaces
(the processes this emulator started: the namespaces are its own), then deletes the namespaces; deleting a namespace
deletes its veth ends and its bridge. It runs with SIGINT/SIGTERM blocked so a second Ctrl-C cannot interrupt it;
:func:`install_signal_handlers` turns SIGTERM/SIGHUP into exceptions so ``finally`` blocks run.
:func:`cleanup_stale` removes leftovers of a run that was SIGKILLed (``python -m tools.emulate --cleanup``).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger("tools.emulate")

PREFIX = "zt-"
SUBNET = "10.213.0"  # 10.213.0.0/24, only ever inside the emulator's own namespaces
FIRST_HOST = 10
IFNAME = "eth0"  # the node's interface inside its namespace: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
MAX_NODES = 200
_NETEM_WARNED = False


class EmulatorError(RuntimeError):
    """The emulator cannot run here (not root, no ip/tc, no namespaces) or a command failed; the message says why."""


def parse_rate(text: Optional[str]) -> Optional[float]:
    """'100mbit', '1gbit', '500kbit', '100' (mbit) -> Mbit/s; None/'', 'none', 'unshaped', '0' -> None."""
    if text is None:
        return None
    t = str(text).strip().lower()
    if t in ("", "none", "unshaped", "off", "0", "inf"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(gbit|mbit|kbit|g|m|k)?(?:ps|/s)?", t)
    if not m:
        raise ValueError(f"rate {text!r}: expected e.g. 100mbit, 1gbit, 500kbit")
    value, unit = float(m.group(1)), (m.group(2) or "mbit")[0]
    return value * {"g": 1000.0, "m": 1.0, "k": 0.001}[unit]


def parse_delay(text: Optional[str]) -> float:
    """'1ms', '500us', '0.5' (ms) -> milliseconds."""
    if text is None:
        return 0.0
    t = str(text).strip().lower()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(ms|us|s)?", t)
    if not m:
        raise ValueError(f"delay {text!r}: expected e.g. 1ms, 200us")
    return float(m.group(1)) * {"ms": 1.0, "us": 0.001, "s": 1000.0}[m.group(2) or "ms"]


def check_host() -> None:
    """Refuse clearly when the emulator cannot work here."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        raise EmulatorError("the cluster emulator needs Linux (network namespaces)")
    if os.geteuid() != 0:
        raise EmulatorError("the cluster emulator needs root (it creates network namespaces, veth pairs and tc "
                            "qdiscs): run it with sudo, or as root in a VM/container with CAP_NET_ADMIN and "
                            "CAP_SYS_ADMIN")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise EmulatorError(f"the cluster emulator needs {' and '.join(missing)} (iproute2): "
                            "apt-get install iproute2")


def _run(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise EmulatorError(f"`{' '.join(args)}` failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
    return proc


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_namespace_processes(namespaces: Sequence[str], grace_s: float = 5.0) -> None:
    """SIGTERM every process in the namespaces, then SIGKILL what is left after ``grace_s``."""
    pids = {pid for ns in namespaces for pid in namespace_pids(ns)} - {os.getpid()}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + (grace_s if sig == signal.SIGTERM else 2.0)
        while time.time() < deadline:
            pids = {pid for ns in namespaces for pid in namespace_pids(ns)} - {os.getpid()}
            if not pids:
                return
            time.sleep(0.1)


def cleanup_stale(tag: Optional[str] = None) -> list[str]:
    """Delete emulator namespaces left by a killed run (all ``zt-*``, or those of one ``tag``); kill their
    processes first. Returns the deleted names."""
    prefix = PREFIX + (f"{tag}-" if tag else "")
    stale = [ns for ns in list_namespaces() if ns.startswith(prefix)]
    _kill_namespace_processes(stale)
    for ns in stale:
        _run(["ip", "netns", "del", ns], check=False)
    return stale


def _has_netem(ns: str, dev: str) -> bool:
    proc = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", "0ms"],
                check=False)
    if proc.returncode == 0:
        _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        return True
    return False


@dataclass
class EmulatedCluster:
    """``nodes`` namespaces on one bridge; inter-node links at ``rate_mbit`` (None: unshaped) and ``delay_ms``."""

    nodes: int
    rate_mbit: Optional[float] = None
    delay_ms: float = 0.0
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    mtu: int = 1500
    created: list[str] = field(default_factory=list)
    netem: Optional[bool] = None  # whether delays can be emulated (found out at set-up)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_NODES:
            raise EmulatorError(f"nodes={self.nodes}: expected 1..{MAX_NODES}")
        if not re.fullmatch(r"[0-9a-z]{1,8}", self.tag):
            raise EmulatorError(f"tag {self.tag!r}: 1-8 lowercase letters/digits")

    # -- names -------------------------------------------------------------------------------------------------
    @property
    def switch_ns(self) -> str:
        return f"{PREFIX}{self.tag}-sw"

    def node_ns(self, i: int) -> str:
        return f"{PREFIX}{self.tag}-n{i}"

    def node_ip(self, i: int) -> str:
        return f"{SUBNET}.{FIRST_HOST + i}"

    @property
    def master_addr(self) -> str:
        return self.node_ip(0)

    @property
    def namespaces(self) -> list[str]:
        return [self.switch_ns] + [self.node_ns(i) for i in range(self.nodes)]

    # -- set-up / tear-down ------------------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        self.setup()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def setup(self) -> None:
        check_host()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _add_ns(self, ns: str) -> None:
        proc = _run(["ip", "netns", "add", ns], check=False)
        if proc.returncode != 0:
            raise EmulatorError(f"cannot create network namespace {ns}: {proc.stderr.strip()} (needs root with "
                                "CAP_SYS_ADMIN; in a container run it --privileged)")
        self.created.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _setup(self) -> None:
        sw = self.switch_ns
        self._add_ns(sw)
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i in range(self.nodes):
            ns = self.node_ns(i)
            self._add_ns(ns)
            port = f"p{i}"
            # Created inside the switch namespace with its peer moved straight into the node's: never in the host's.
            _run(["ip", "-n", sw, "link", "add", port, "mtu", str(self.mtu), "type", "veth", "peer", "name", IFNAME,
                  "mtu", str(self.mtu), "netns", ns])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.node_ip(i)}/24", "dev", IFNAME])
            _run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
        self.shape(self.rate_mbit, self.delay_ms)
        log.info("emulated cluster %s: %d nodes (%s), inter-node %s", self.tag, self.nodes,
                 ", ".join(f"{self.node_ns(i)}={self.node_ip(i)}" for i in range(self.nodes)), self.describe_link())

    def describe_link(self) -> str:
        if self.rate_mbit is None:
            return "unshaped"
        delay = f", {self.delay_ms:g} ms one-way delay" if self.delay_ms and self.netem else ""
        return f"{self.rate_mbit:g} Mbit/s per node each way{delay}"

    def _qdisc_args(self, rate_mbit: float, delay_ms: float) -> list[str]:
        rate = f"{rate_mbit * 1000:.0f}kbit"
        if delay_ms and self.netem:
            # netem's own rate: one qdisc does both; a queue deep enough for a few hundred ms at this rate.
            bdp_packets = int(rate_mbit * 1e6 / 8 * 0.5 / self.mtu) + 1000
            return ["netem", "delay", f"{delay_ms * 1000:.0f}us", "rate", rate, "limit", str(bdp_packets)]
        # tbf: burst >= one GSO super-packet (veth passes 64 KiB segments) and ~4 ms of traffic; 200 ms of queue.
        burst = max(96 * 1024, int(rate_mbit * 1e6 / 8 * 0.004))
        return ["tbf", "rate", rate, "burst", str(burst), "latency", "200ms"]

    def shape(self, rate_mbit: Optional[float], delay_ms: float = 0.0) -> None:
        """(Re)shape every inter-node link; callable while a job runs (e.g. between benchmark runs)."""
        global _NETEM_WARNED
        if self.netem is None and (rate_mbit is not None or delay_ms):
            self.netem = _has_netem(self.node_ns(0), IFNAME)
            if delay_ms and not self.netem and not _NETEM_WARNED:
                log.warning("this kernel has no sch_netem: the %g ms delay is not emulated, bandwidth only", delay_ms)
                _NETEM_WARNED = True
        self.rate_mbit, self.delay_ms = rate_mbit, delay_ms
        for i in range(self.nodes):
            for ns, dev, delay in ((self.node_ns(i), IFNAME, delay_ms), (self.switch_ns, f"p{i}", 0.0)):
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)  # none yet: fine
                if rate_mbit is not None:
                    _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:",
                          *self._qdisc_args(rate_mbit, delay)])

    def link_bytes(self) -> dict[str, int]:
        """Bytes sent so far through each node's uplink and downlink qdisc (``tc -s qdisc``): the wire bytes that
        crossed the inter-node network, headers included. {"n0_up": .., "n0_down": .., ...}."""
        out = {}
        for i in range(self.nodes):
            for key, ns, dev in ((f"n{i}_up", self.node_ns(i), IFNAME), (f"n{i}_down", self.switch_ns, f"p{i}")):
                text = _run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", dev]).stdout
                m = re.search(r"Sent (\d+) bytes", text)  # the root qdisc: the first one listed
                out[key] = int(m.group(1)) if m else 0
        return out

    def close(self) -> None:
        """Kill what runs inside, delete every namespace this cluster created. Idempotent; signals are held off."""
        if not self.created and not self.procs:
            return
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        try:
            for p in self.procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            deadline = time.time() + 5
            for p in self.procs:
                try:
                    p.wait(timeout=max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.wait()
            _kill_namespace_processes(self.created)
            for ns in reversed(self.created):
                _run(["ip", "netns", "del", ns], check=False)
            left = [ns for ns in list_namespaces() if ns in self.created]
            if left:
                log.error("could not delete namespaces %s; run python -m tools.emulate --cleanup", left)
            self.created = []
            self.procs = []
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    # -- running commands --------------------------------------------------------------------------------------
    def node_env(self, i: int, master_port: int) -> dict[str, str]:
        """What a process on node i needs: its node name (zerotrain's layout), the interface the collective
        libraries bind, and the rendezvous (MASTER_ADDR on node 0)."""
        return {
            "ZEROTRAIN_NODE_NAME": f"node{i}",
            "GLOO_SOCKET_IFNAME": IFNAME,
            "NCCL_SOCKET_IFNAME": IFNAME,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(master_port),
            "ZT_EMULATED_NODE_RANK": str(i),
            "ZT_EMULATED_NNODES": str(self.nodes),
        }

    def popen(self, i: int, argv: Sequence[str], env: Optional[Mapping[str, str]] = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside node i's namespace (its own process group, so it is killed as a whole)."""
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(["ip", "netns", "exec", self.node_ns(i), *argv], env=full_env,
                                start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc


def torchrun_argv(python: str, cluster: EmulatedCluster, node: int, nproc_per_node: int, master_port: int,
                  script_and_args: Sequence[str]) -> list[str]:
    """``python -m zerotrain.launch.torchrun`` (torchrun, exiting with the failed rank's code and message instead of
    1 and a ChildFailedError traceback) for node ``node`` of the cluster (static rendezvous on node 0)."""
    return [python, "-m", "zerotrain.launch.torchrun", f"--nnodes={cluster.nodes}", f"--node_rank={node}",
            f"--nproc_per_node={nproc_per_node}", f"--master_addr={cluster.master_addr}",
            f"--master_port={master_port}", *script_and_args]


class SignalExit(BaseException):
    """Raised in the main thread on SIGTERM/SIGHUP so ``finally`` blocks (the cluster's cleanup) run."""

    def __init__(self, signum: int):
        super().__init__(f"received signal {signal.Signals(signum).name}")
        self.signum = signum


def install_signal_handlers() -> dict:
    """SIGTERM/SIGHUP -> :class:`SignalExit`; SIGINT keeps raising KeyboardInterrupt. Returns the old handlers."""

    def handler(signum, _frame):
        raise SignalExit(signum)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        old[sig] = signal.signal(sig, handler)
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    return old
