"""The shape of the job this process belongs to (nodes x processes per node), read from the launcher's environment
before any process group exists: torchrun's ``WORLD_SIZE``/``LOCAL_WORLD_SIZE``, else an srun step's task counts,
else a single process."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from zerotrain.launch.slurm import in_slurm_step, parse_tasks_per_node


@dataclass(frozen=True)
class World:
    nodes: int
    gpus_per_node: int
    source: str
    """Where the shape came from, for the printout."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def launched_world(environ: Mapping[str, str] = os.environ) -> World:
    """The job this process belongs to, read before the process group exists: torchrun's WORLD_SIZE and
    LOCAL_WORLD_SIZE, else an srun step's task counts, else a single process."""
    if environ.get("WORLD_SIZE"):
        world = int(environ["WORLD_SIZE"])
        per_node = int(environ.get("LOCAL_WORLD_SIZE") or world)
        return World(max(world // per_node, 1), per_node, "WORLD_SIZE / LOCAL_WORLD_SIZE")
    if in_slurm_step(environ) and environ.get("SLURM_NTASKS"):
        world = int(environ["SLURM_NTASKS"])
        spec = (environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_NTASKS_PER_NODE")
                or environ.get("SLURM_TASKS_PER_NODE") or str(world))
        per_node = max(parse_tasks_per_node(spec))
        return World(max(world // per_node, 1), per_node, "SLURM_NTASKS / tasks per node")
    return World(1, 1, "a single process")
