"""Rendezvous checks fail fast and say what to check; they never fall back to localhost."""

import socket
import threading
import time

import pytest

from tools.launcher import free_port
from zerotrain.launch.rendezvous import RendezvousError, check_rendezvous


def env(**kw) -> dict[str, str]:
    return {"RANK": "1", "NODE_RANK": "0", "SLURMD_NODENAME": "node2", **{k: str(v) for k, v in kw.items()}}


def test_unresolvable_master_fails_at_once_naming_node_and_host():
    started = time.monotonic()
    with pytest.raises(RendezvousError) as e:
        check_rendezvous(env(MASTER_ADDR="no-such-node.invalid", MASTER_PORT=20001), timeout_s=30)
    assert time.monotonic() - started < 10
    assert "rank 1 on node node2" in str(e.value) and "cannot resolve" in str(e.value)
    assert "getent hosts no-such-node.invalid" in str(e.value)


def test_unreachable_master_fails_within_the_timeout_with_hints():
    started = time.monotonic()
    with pytest.raises(RendezvousError) as e:
        check_rendezvous(env(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port()), timeout_s=2)
    elapsed = time.monotonic() - started
    assert 1.0 < elapsed < 6
    message = str(e.value)
    assert "cannot reach the rendezvous 127.0.0.1:" in message and "firewall" in message and "rank 0's log" in message


def test_missing_address_is_an_error_not_localhost():
    with pytest.raises(RendezvousError, match="MASTER_ADDR/MASTER_PORT are not set"):
        check_rendezvous(env(MASTER_PORT=20001), timeout_s=1)


def test_waits_for_a_late_master():
    port = free_port()
    server = socket.socket()

    def listen_later():
        time.sleep(1.0)
        server.bind(("127.0.0.1", port))
        server.listen()

    threading.Thread(target=listen_later, daemon=True).start()
    try:
        check_rendezvous(env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port), timeout_s=10)
    finally:
        server.close()


def test_rank0_reports_a_taken_port():
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RendezvousError, match=f"port {port} is already in use.*ZEROTRAIN_MASTER_PORT"):
            check_rendezvous(env(RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port), timeout_s=1)


def test_under_torchrun_rank0_connects_to_the_agent_store_instead_of_binding():
    with socket.socket() as agent_store:  # torchrun's agent already listens on MASTER_PORT
        agent_store.bind(("127.0.0.1", 0))
        agent_store.listen()
        port = agent_store.getsockname()[1]
        check_rendezvous(
            env(RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True"), timeout_s=5
        )
