"""SLURM job-step variables -> the torch.distributed environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

``slurm/train.sbatch`` starts one task per device with ``srun``; there is no torchrun in between, so each task
translates what slurmstepd gave it into the variables ``torch.distributed`` (and DeepSpeed) read:

    RANK              = SLURM_PROCID
    WORLD_SIZE        = SLURM_NTASKS
    LOCAL_RANK        = SLURM_LOCALID
    LOCAL_WORLD_SIZE  = tasks on this node (SLURM_STEP_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE)
    NODE_RANK         = SLURM_NODEID
    MASTER_ADDR       = first host of `scontrol show hostnames <step node list>` (where task 0 runs)
    MASTER_PORT       = a port derived from SLURM_JOB_ID, in a fixed range

:func:`apply_slurm_env` does nothing outside SLURM, and nothing when a launcher (torchrun) already set RANK, so
the same ``train.py`` works under ``torchrun`` on a workstation and under ``srun`` on a cluster. It never invents
a rendezvous address: a node list that cannot be expanded is an error, never ``localhost``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

from zerotrain.errors import SlurmEnvError

# Ports below 20000 collide with well-known daemons (slurmd 6818, ...); 32768+ is Linux's ephemeral range, which
# the kernel hands out to outgoing connections and so could already be taken on the master node.
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000
# Escape hatch when the derived port is taken on the master node (rare): export ZEROTRAIN_MASTER_PORT=<port>.
MASTER_PORT_OVERRIDE = "ZEROTRAIN_MASTER_PORT"

HostnameExpander = Callable[[str], list[str]]


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as SLURM describes it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: str
    node_name: str

    def torch_env(self) -> dict[str, str]:
        """The variables torch.distributed's env:// rendezvous (and DeepSpeed) read."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "NODE_RANK": str(self.node_rank),
            "GROUP_RANK": str(self.node_rank),  # torchrun's name for the node rank
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def in_slurm_step(environ: Mapping[str, str]) -> bool:
    """True inside an ``srun`` task. The batch shell also has SLURM_PROCID=0 and the job's SLURM_NTASKS, but no
    SLURM_STEP_ID: a ``python train.py`` run there directly (no srun) is one process, not rank 0 of N."""
    return all(name in environ for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID"))


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's compressed per-node task counts: ``'4(x2),3'`` -> ``[4, 4, 3]``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise SlurmEnvError(f"cannot parse tasks-per-node '{spec}': expected a form like '8', '4(x2)' or '4(x2),3'")
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        counts.extend([count] * repeat)
    return counts


def master_port(job_id: str | int) -> int:
    """A port every task of the job derives alike, distinct for jobs sharing a master node (job ids differ)."""
    return MASTER_PORT_BASE + int(job_id) % MASTER_PORT_SPAN


def scontrol_hostnames(nodelist: str) -> list[str]:
    """Expand a SLURM node list (``gpu[01-04]``) with ``scontrol show hostnames``, the only exact expander."""
    if shutil.which("scontrol") is None:
        raise SlurmEnvError(
            f"cannot expand the node list '{nodelist}': 'scontrol' is not on PATH in this task. "
            "Load the SLURM module in the job (or put SLURM's bin directory on PATH)."
        )
    result = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=False
    )
    hosts = result.stdout.split()
    if result.returncode != 0 or not hosts:
        raise SlurmEnvError(
            f"'scontrol show hostnames {nodelist}' failed (exit {result.returncode}): {result.stderr.strip()}"
        )
    return hosts


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name)
    if value is None:
        raise SlurmEnvError(f"{name} is not set: this process was not started by srun (use slurm/train.sbatch)")
    try:
        return int(value)
    except ValueError:
        raise SlurmEnvError(f"{name}={value!r} is not an integer") from None


def _local_world_size(environ: Mapping[str, str], node_rank: int) -> int:
    """Tasks on this node. The step's own count wins: a step may use fewer tasks than the allocation."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        spec = environ.get(name)
        if not spec:
            continue
        counts = parse_tasks_per_node(spec)
        if len(counts) == 1:  # SLURM_NTASKS_PER_NODE is a single number for every node
            return counts[0]
        if node_rank >= len(counts):
            raise SlurmEnvError(f"{name}={spec} lists {len(counts)} nodes but SLURM_NODEID={node_rank}")
        return counts[node_rank]
    raise SlurmEnvError("none of SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE is set")


def _port(environ: Mapping[str, str], job_id: str) -> int:
    override = environ.get(MASTER_PORT_OVERRIDE)
    if override:
        if not override.isdigit() or not 0 < int(override) < 65536:
            raise SlurmEnvError(f"{MASTER_PORT_OVERRIDE}={override!r} is not a TCP port")
        return int(override)
    return master_port(job_id)


def launch_info(environ: Mapping[str, str], hostnames: HostnameExpander = scontrol_hostnames) -> LaunchInfo:
    """Read this task's place in the job from SLURM's variables (pure apart from expanding the node list)."""
    job_id = environ.get("SLURM_JOB_ID", "")
    if not job_id.isdigit():
        raise SlurmEnvError(f"SLURM_JOB_ID={job_id!r} is not a job id")
    rank = _int(environ, "SLURM_PROCID")
    world_size = _int(environ, "SLURM_NTASKS")
    node_rank = _int(environ, "SLURM_NODEID")
    if not 0 <= rank < world_size:
        raise SlurmEnvError(f"SLURM_PROCID={rank} is outside [0, SLURM_NTASKS={world_size})")
    # Task 0 of the step runs on the step's first node; the step may not span the whole allocation.
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmEnvError("SLURM_STEP_NODELIST / SLURM_JOB_NODELIST are not set: cannot find the master node")
    hosts = hostnames(nodelist)
    num_nodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_JOB_NUM_NODES") or len(hosts))
    return LaunchInfo(
        rank=rank,
        world_size=world_size,
        local_rank=_int(environ, "SLURM_LOCALID"),
        local_world_size=_local_world_size(environ, node_rank),
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=hosts[0],
        master_port=_port(environ, job_id),
        job_id=job_id,
        node_name=environ.get("SLURMD_NODENAME") or (hosts[node_rank] if node_rank < len(hosts) else ""),
    )


def apply_slurm_env(
    environ: MutableMapping[str, str] = os.environ, hostnames: HostnameExpander = scontrol_hostnames
) -> LaunchInfo | None:
    """Export the torch.distributed variables for this srun task; call it first thing in ``train.py``.

    Returns None (and changes nothing) outside a SLURM step or when a launcher already set RANK (torchrun inside
    an allocation: torchrun's own values are the truth). MASTER_ADDR/MASTER_PORT inherited from the submitting
    shell are overwritten: a stale ``MASTER_ADDR=localhost`` there would make every node train alone.
    """
    if not in_slurm_step(environ) or "RANK" in environ:
        return None
    info = launch_info(environ, hostnames)
    environ.update(info.torch_env())
    return info

