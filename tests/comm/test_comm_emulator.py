"""The cluster emulator end to end: 2 namespaces, shaped links, gloo across them, cleanup (also on SIGINT/SIGTERM).

Needs root, ``ip``/``tc`` and network namespaces; skipped with the reason otherwise (the refusal itself is tested
without them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools import emulate
from tools.emulate import EmulatedCluster, EmulatorError, check_host
from tools.launcher import CPU_ENV, REPO, run

HERE = Path(__file__).resolve().parent


def _emulator_unavailable() -> str | None:
    try:
        check_host()
    except EmulatorError as e:
        return str(e)
    probe = f"zt-probe{os.getpid() % 10000}"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode:
        return f"cannot create network namespaces here: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


UNAVAILABLE = _emulator_unavailable()
needs_emulator = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"emulator unavailable: {UNAVAILABLE}")


def _zt_namespaces() -> set[str]:
    return {ns for ns in emulate.list_namespaces() if ns.startswith(emulate.PREFIX)}


def _host_zt_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if " zt" in line]


def _wait_files(d: Path, pattern: str, n: int, procs: list, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while len(list(d.glob(pattern))) < n:
        failed = [p.returncode for p in procs if p.poll() not in (None, 0)]
        if failed or time.time() > deadline:
            outs = "\n".join(p.stdout.read().decode(errors="replace")[-3000:] for p in procs if p.poll() is not None)
            raise AssertionError(f"waiting for {pattern} x{n}: exit codes {failed}, timeout={time.time() > deadline}"
                                 f"\n{outs}")
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------------------------
# Refusals (no root needed)
# ----------------------------------------------------------------------------------------------------------------


def test_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(EmulatorError, match="needs root"):
        check_host()


def test_refuses_without_ip_or_tc(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
    with pytest.raises(EmulatorError, match="needs tc"):
        check_host()


def test_script_refuses_without_root_clearly():
    """The CLI as a non-root user: exit 2 and a message, nothing created (runs setpriv when we are root)."""
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: cannot drop privileges for this check")
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    else:
        prefix = []
    before = _zt_namespaces() if os.geteuid() == 0 else set()
    proc = subprocess.run([*prefix, sys.executable, "-m", "tools.emulate", "--nodes", "2", "--", "true"],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs root" in proc.stderr
    if os.geteuid() == 0:
        assert _zt_namespaces() == before


def test_rate_parsing():
    assert emulate.parse_rate("100mbit") == 100.0
    assert emulate.parse_rate("1gbit") == 1000.0
    assert emulate.parse_rate("500kbit") == 0.5
    assert emulate.parse_rate("unshaped") is None
    assert emulate.parse_delay("1ms") == 1.0 and emulate.parse_delay("250us") == 0.25
    with pytest.raises(ValueError):
        emulate.parse_rate("fast")


# ----------------------------------------------------------------------------------------------------------------
# End to end
# ----------------------------------------------------------------------------------------------------------------


@needs_emulator
def test_gloo_across_emulated_nodes_crosses_shaped_link_only_between_nodes(tmp_path):
    """4 gloo ranks as 2 nodes x 2: world all-reduces go through the shaped uplinks (tc byte counters), all-reduces
    inside a node do not; the layout sees 2 nodes; everything is gone afterwards."""
    before = _zt_namespaces()
    procs = []
    with EmulatedCluster(nodes=2, rate_mbit=400) as cluster:
        created = set(cluster.namespaces)
        assert created <= _zt_namespaces()
        for node in range(2):
            for local in range(2):
                env = {**CPU_ENV, **cluster.node_env(node, 29500), "RANK": str(node * 2 + local),
                       "WORLD_SIZE": "4", "LOCAL_RANK": str(local)}
                procs.append(cluster.popen(node, [sys.executable, str(HERE / "worker_emulated_allreduce.py"),
                                                  str(tmp_path)], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT))
        counters = {}
        for phase in ("world", "local"):
            _wait_files(tmp_path, f"phase-{phase}-[0-9]", 4, procs)
            start = cluster.link_bytes()
            (tmp_path / f"go-{phase}").write_text("go")
            _wait_files(tmp_path, f"phase-{phase}-done-*", 4, procs)
            end = cluster.link_bytes()
            counters[phase] = {k: end[k] - start[k] for k in end}
        for p in procs:
            assert p.wait(timeout=60) == 0, p.stdout.read().decode(errors="replace")[-3000:]
        qdisc = subprocess.run(["tc", "-n", cluster.node_ns(0), "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
    print(f"\nshaped-link bytes per phase: {counters}\nnode0 eth0: {qdisc.strip()}")
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(4)]
    for r in results:
        assert r["node_names"] == ["node0", "node0", "node1", "node1"]
        assert r["world"]["ok"] and r["local"]["ok"]
    assert ("tbf" in qdisc or "netem" in qdisc) and "rate 400Mbit" in qdisc
    # 4 world all-reduces of 4 MB between two nodes: whatever the algorithm, each node must send at least the data
    # the other node lacks, N per all-reduce (reduce-scatter N/2 + all-gather N/2 across the cut).
    payload = 4 * 4 * (1 << 20)
    for node in ("n0", "n1"):
        assert counters["world"][f"{node}_up"] >= payload, counters
        assert counters["world"][f"{node}_down"] >= payload, counters
        # Intra-node all-reduces stay on the namespace's loopback: only barriers' bytes (gloo, ~100 B) cross.
        assert counters["local"][f"{node}_up"] < 64 * 1024, counters
    assert not created & _zt_namespaces()
    assert not _host_zt_links()


@needs_emulator
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_interrupt_cleans_up(tmp_path, sig, code):
    """The CLI interrupted while its nodes run: the processes inside are killed and every namespace is deleted."""
    before = _zt_namespaces()
    marker = f"zt-test-sleep-{os.getpid()}-{int(sig)}"
    proc = subprocess.Popen([sys.executable, "-m", "tools.emulate", "--nodes", "2",
                             "--rate", "100mbit", "--", "sh", "-c", f"echo {marker}; exec sleep 300"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.time() + 60
    new: set[str] = set()
    while time.time() < deadline:
        new = _zt_namespaces() - before
        nodes = [ns for ns in new if not ns.endswith("-sw")]
        if len(new) == 3 and len(nodes) == 2 and all(emulate.netns.namespace_pids(ns) for ns in nodes):
            break
        assert proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.1)
    else:
        proc.kill()
        raise AssertionError(f"the emulator did not start its nodes: {new}")
    pids = [pid for ns in new for pid in emulate.netns.namespace_pids(ns)]
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    text = out.decode(errors="replace")
    assert proc.returncode == code, text
    assert _zt_namespaces() == before, text
    assert not _host_zt_links()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), pid


@needs_emulator
def test_a_node_layout_refusal_exits_2_with_one_message_as_under_slurm(tmp_path, shakespeare):
    """hpZ 4 on 2 nodes x 2 (its groups would cross nodes): every rank refuses after the rendezvous. The emulator runs
    zerotrain.launch.torchrun on each node, so it exits 2 with the message once, not torchrun's 1 and a
    ChildFailedError report per node. The control: the same emulator running plain torchrun (what --nproc-per-node
    used to launch) on a config error loses the code."""
    args = ["recipe=tiny_llama", "zero.zero_hpz_partition_size=4", "wandb.enabled=false",
            f"data.train.0.path={shakespeare}", f"run.output_dir={tmp_path}"]
    proc = run([sys.executable, "-m", "tools.emulate", "--nodes", "2", "--nproc-per-node", "2", "train.py", *args],
               check=False, timeout=900)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-4000:]
    assert text.count("zero.zero_hpz_partition_size=4 makes hpZ groups cross node boundaries") == 1, text[-4000:]
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-4000:]

    plain = run([sys.executable, "-m", "tools.emulate", "--nodes", "2", "--", sys.executable, "-m",
                 "torch.distributed.run", "--nnodes={nnodes}", "--node_rank={node_rank}", "--nproc_per_node=2",
                 "--master_addr={master_addr}", "--master_port={master_port}", "train.py", "recipe=tiny_llama",
                 "optim.lr=-1"], check=False, timeout=600)
    assert plain.returncode == 1 and "ChildFailedError" in plain.stdout + plain.stderr
