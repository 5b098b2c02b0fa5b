"""Process-group start-up: who am I (rank, node), which backend, and seeding.

Works the same under ``torchrun``, under ``srun`` (the SLURM variables are translated by ``zerotrain.launch``) and as
a plain single process. The cluster profile's environment (NCCL/gloo settings) is applied *before* the process group
exists, because the collective libraries read it only once, at initialisation. The ``cluster`` section of the run
config (:class:`ClusterConfig`) is declared here.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum

import numpy as np
import torch
import torch.distributed as dist

from zerotrain.fields import bounded


class Accelerator(StrEnum):
    cpu = "cpu"  # gloo over CPUs (tests, the emulated cluster)
    cuda = "cuda"  # NVIDIA GPUs, NCCL: train.py refuses to start when DeepSpeed would fall back to the CPU


@dataclass
class ClusterConfig:
    """The ``cluster`` section (``configs/cluster/*.yaml``): the machines' profile."""

    name: str = "local"
    """The profile's name (for the record)."""
    peak_tflops: float = bounded(0.0, ge=0)
    """Accelerator peak dense TFLOP/s used for MFU; 0 looks the device up in zerotrain.metrics.PEAK_TFLOPS."""
    accelerator: Accelerator = Accelerator.cpu
    """cpu | cuda: what the nodes compute on. cuda makes a CPU fallback at start-up an error (zerotrain.launch
    .accelerator_check), as do GPUs the job was given (SLURM_GPUS*, CUDA_VISIBLE_DEVICES)."""
    device_memory_gib: float = bounded(0.0, ge=0, le=4096)
    """Memory of one device in GiB, for the memory plan (train.py --plan) and its start-up check; 0: a visible
    CUDA device's own total, or unchecked on the CPU."""
    nodes: int = bounded(1, ge=1, le=65536)
    """Nodes the recipe is meant for: the shape ``--plan`` plans for. The start-up check uses the launched job's."""
    gpus_per_node: int = bounded(1, ge=1, le=1024)
    """Devices (ranks) per node the recipe is meant for, with ``nodes``."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment for the collective library (NCCL_SOCKET_IFNAME, ...), set before the process group is created;
    a variable already in the job's environment wins."""


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process_env() -> None:
    """A plain ``python train.py`` is a world of one: give torch.distributed the variables a launcher would."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def apply_environment(env: Mapping[str, str]) -> None:
    """Cluster-profile variables; an explicit variable in the job's environment wins over the profile."""
    for key, value in env.items():
        os.environ.setdefault(str(key), str(value))


def init(timeout_minutes: float = 30.0) -> DistInfo:
    """Create the world process group through DeepSpeed (gloo on the CPU, NCCL on GPUs)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from zerotrain.launch.rendezvous import check_rendezvous
    from zerotrain.launch.slurm import apply_slurm_env

    apply_slurm_env()
    if "RANK" not in os.environ:
        _single_process_env()
    check_rendezvous()  # an unreachable rendezvous fails here, in bounded time, naming the node
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)
    if not dist.is_initialized():
        deepspeed.init_distributed(
            dist_backend=accelerator.communication_backend_name(),
            auto_mpi_discovery=False,
            timeout=timedelta(minutes=timeout_minutes),
        )
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
    )


def seed_everything(seed: int) -> None:
    """The same seed on every rank: model initialisation must agree; data sharding is explicit, not random."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    from deepspeed.accelerator import get_accelerator

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if get_accelerator().device_name() != "cpu":
        state["accelerator"] = get_accelerator().get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from deepspeed.accelerator import get_accelerator

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "accelerator" in state and get_accelerator().device_name() != "cpu":
        get_accelerator().set_rng_state(state["accelerator"])


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_agree(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on every rank (one tiny all-reduce); the flag itself alone."""
    if not dist.is_initialized():
        return flag
    from deepspeed.accelerator import get_accelerator

    value = torch.tensor([1 if flag else 0], dtype=torch.int64, device=get_accelerator().current_device_name())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def min_over_ranks(value: int) -> int:
    if not dist.is_initialized():
        return value
    from deepspeed.accelerator import get_accelerator

    tensor = torch.tensor([value], dtype=torch.int64, device=get_accelerator().current_device_name())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def gather_objects(obj):
    """Every rank's ``obj``, in rank order, on every rank (small, picklable objects only)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
