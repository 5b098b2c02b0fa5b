"""Emulate a cluster of N nodes on one Linux host (network namespaces, a bridge, ``tc``-shaped links).

Try hpZ's point — the backward all-gather stays inside a node — without a cluster: ranks of one emulated node
talk over loopback at memory speed, ranks of different nodes over a link as slow as you like. See
:mod:`tools.emulate.netns` for the topology, :mod:`tools.emulate.__main__` for the command
(``sudo .venv/bin/python -m tools.emulate --nodes 2 --nproc-per-node 2 --rate 100mbit train.py recipe=tiny_llama``)
and ``docs/emulated_cluster.md`` for usage.
"""

from tools.emulate.netns import (  # noqa: F401
    IFNAME,
    PREFIX,
    SUBNET,
    EmulatedCluster,
    EmulatorError,
    SignalExit,
    check_host,
    cleanup_stale,
    install_signal_handlers,
    list_namespaces,
    parse_delay,
    parse_rate,
    torchrun_argv,
)
