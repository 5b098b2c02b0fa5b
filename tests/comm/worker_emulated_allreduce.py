"""Worker for the emulator test: one rank of a 2-node x 2-rank gloo job inside an emulated node's namespace.

Env: RANK, WORLD_SIZE, MASTER_ADDR/PORT, ZEROTRAIN_NODE_NAME, GLOO_SOCKET_IFNAME (set by the test through
EmulatedCluster.node_env). Phases, separated by files the test waits on (``<dir>/phase-<name>-<rank>``) so it can
read the tc counters between them:

1. ``layout``: gather every rank's node name (zerotrain.launch.layout) - proves the ranks see two nodes;
2. ``world``: 4 all-reduces of 1M float32 (4 MB) over the world - crosses the shaped links;
3. ``local``: 4 all-reduces of 4 MB inside each node's pair of ranks - must stay on the namespace's loopback.

Usage: worker_emulated_allreduce.py DIR
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from zerotrain.launch.layout import gather_layout

NUMEL = 1 << 20
REPEATS = 4


def wait_go(d: Path, name: str) -> None:
    deadline = time.time() + 120
    while not (d / f"go-{name}").exists():
        if time.time() > deadline:
            raise TimeoutError(f"no go-{name}")
        time.sleep(0.05)


def main(d: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = gather_layout()
    result = {"rank": rank, "node_names": list(layout.node_names), "ranks_per_node": layout.ranks_per_node}

    pairs = [dist.new_group(list(r)) for r in (layout.ranks_on_node(i) for i in range(layout.num_nodes))]
    mine = pairs[layout.node_index[rank]]
    for phase, group, size in (("world", None, world), ("local", mine, layout.ranks_per_node)):
        dist.barrier()
        (d / f"phase-{phase}-{rank}").write_text("ready")
        wait_go(d, phase)
        dist.barrier()
        ok = True
        t0 = time.perf_counter()
        for i in range(REPEATS):
            x = torch.full((NUMEL,), float(rank + i))
            dist.all_reduce(x, group=group)
            members = list(range(world)) if group is None else list(dist.get_process_group_ranks(group))
            ok &= bool(torch.all(x == sum(r + i for r in members)).item())
        dist.barrier()
        result[phase] = {"ok": ok, "seconds": time.perf_counter() - t0, "group_size": size}
        (d / f"phase-{phase}-done-{rank}").write_text("done")
    (d / f"result-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
