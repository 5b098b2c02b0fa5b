"""The shipped cluster fragments compose into valid run configs and carry the settings they promise."""

import pytest

from zerotrain.config import FRAGMENTS_DIR, available
from zerotrain.run_config import compose


@pytest.mark.parametrize("name", available(FRAGMENTS_DIR / "cluster"))
def test_every_cluster_fragment_composes(name):
    cfg = compose("tiny_llama", [f"cluster={name}"])
    assert cfg.cluster.name == name
    assert all(isinstance(v, str) for v in cfg.cluster.env.values())


def test_ethernet_disables_ib_and_interface_is_overridable():
    cfg = compose("tiny_llama", ["cluster=ethernet", "cluster.env.NCCL_SOCKET_IFNAME==ens1f0"])
    env = cfg.cluster.env
    assert env.NCCL_IB_DISABLE == "1" and env.NCCL_SOCKET_IFNAME == "=ens1f0"
    assert int(env.NCCL_SOCKET_NTHREADS) * int(env.NCCL_NSOCKS_PERTHREAD) <= 64  # NCCL's limit


def test_local_cpu_sets_nothing():
    assert dict(compose("tiny_llama", ["cluster=local_cpu"]).cluster.env) == {}
