"""Process-group start-up: who am I (rank, node), which backend, and seeding.

Works the same under ``torchrun``, under ``srun`` (the SLURM variables are translated by ``zerotrain.launch``) and as
a plain single process. The cluster profile's environment (NCCL/gloo settings) is applied *before* the process group
exists, because the collective libraries read it only once, at initialisation. The ``cluster`` section of the run
config (:class:`ClusterConfig`) is declared here.
"""

from __future__ import annotations

import os
import random
import re
import socket
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from zerotrain.errors import CollectiveTimeout, RendezvousError
from zerotrain.fields import bounded


class Accelerator(StrEnum):
    cpu = "cpu"  # gloo over CPUs (tests, the emulated cluster)
    cuda = "cuda"  # NVIDIA GPUs, NCCL: train.py refuses to start when DeepSpeed would fall back to the CPU


class Collectives(StrEnum):
    """The members are :data:`zerotrain.ring_collectives.MODES` (a test keeps the two the same)."""

    auto = "auto"  # ring on the emulated cluster (tools.emulate), native elsewhere
    ring = "ring"  # gloo groups: ring reduce-scatter / all-gather over point-to-point (NCCL's bytes)
    native = "native"  # gloo's own collectives (its reduce-scatter is an all-reduce: ~2x the bytes)


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
    host_memory_gib: float = bounded(0.0, ge=0, le=65536)
    """Host memory of one node in GiB, for the memory plan's host row (a pretrained load, offloaded states) and its
    start-up check; 0: at start-up the node's own (MemTotal, or the job's cgroup limit when lower), in --plan
    unchecked."""
    nodes: int = bounded(1, ge=1, le=65536)
    """Nodes the recipe is meant for: the shape ``--plan`` plans for. The start-up check uses the launched job's."""
    gpus_per_node: int = bounded(1, ge=1, le=1024)
    """Devices (ranks) per node the recipe is meant for, with ``nodes``."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment for the collective library (NCCL_SOCKET_IFNAME, ...), set before the process group is created;
    a variable already in the job's environment wins."""
    init_timeout_s: float = bounded(300.0, ge=5, le=3600)
    """How long a rank waits for the others while the process group forms (reaching rank 0, then every rank
    joining) before it fails with a message instead of hanging: a rank that died during start-up. Rank 0's imports
    on a cold shared file system can take minutes, hence not less by default. Collectives after start-up are bounded
    by ``collective_timeout_s`` instead. $ZEROTRAIN_RENDEZVOUS_TIMEOUT, if set, wins."""
    collectives: Collectives = Collectives.auto
    """auto | ring | native: how DeepSpeed's reduce-scatter and all-gather run on gloo (the CPU). ring: ring
    algorithms over point-to-point, the bytes NCCL's rings move, so a CPU baseline is what a GPU user has; native:
    gloo's (reduce-scatter = all-reduce, ~2x the bytes); auto: ring on the emulated cluster (tools.emulate), native
    elsewhere. No effect on NCCL. See zerotrain/ring_collectives.py."""
    collective_timeout_s: float = bounded(1800.0, ge=10, le=86400)
    """How long any collective after start-up (every process group: the world, hpZ's, DeepSpeed's) may wait for a
    rank before the waiting ranks fail with a message naming this key (exit 5) instead of hanging: a rank that is
    stopped (SIGSTOP, a debugger), hangs in its own code or lost its node. Default torch's 30 minutes: a checkpoint
    save on a slow shared file system holds the other ranks in a barrier for many minutes without anything being
    wrong, so set it above the longest save. Under NCCL torch's watchdog enforces it (and aborts the process)."""
    nccl_flight_recorder: int = bounded(0, ge=0, le=1_000_000)
    """NCCL's flight recorder, for hangs: the last this many collectives of every process group kept per rank
    (TORCH_NCCL_TRACE_BUFFER_SIZE) and dumped when the watchdog times out a collective (TORCH_NCCL_DUMP_ON_TIMEOUT)
    to <run dir>/nccl_flight_recorder/rank_R; `python -m torch.distributed.flight_recorder.fr_trace <that dir>`
    says which collective which rank did not reach. 0: off. A few thousand is plenty; variables already set in the
    job's environment win."""


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


FLIGHT_RECORDER_DIR = "nccl_flight_recorder"


def flight_recorder_env(entries: int, run_dir: Path) -> dict[str, str]:
    """The environment that turns NCCL's flight recorder on (``cluster.nccl_flight_recorder`` entries; {} for 0):
    torch reads it when an NCCL process group is created, and appends the rank to the dump file's prefix."""
    if entries <= 0:
        return {}
    prefix = str(run_dir.resolve() / FLIGHT_RECORDER_DIR / "rank_")
    # torch 2.13 reads the TORCH_FR_* names first and the older TORCH_NCCL_* ones as their fallback: both are set.
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(entries), "TORCH_FR_BUFFER_SIZE": str(entries),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix, "TORCH_FR_DUMP_TEMP_FILE": prefix}


def enable_flight_recorder(entries: int, run_dir: Path) -> None:
    """Before the process group exists: the flight recorder's environment, and the directory its dumps go to."""
    env = flight_recorder_env(entries, run_dir)
    if env:
        (run_dir / FLIGHT_RECORDER_DIR).mkdir(parents=True, exist_ok=True)
        apply_environment(env)


def init(init_timeout_s: float = 300.0, collective_timeout_s: float = 1800.0) -> DistInfo:
    """Create the world process group through DeepSpeed (gloo on the CPU, NCCL on GPUs), failing within about
    ``init_timeout_s`` (``cluster.init_timeout_s``) with a :class:`RendezvousError` when the ranks do not all join;
    afterwards every collective, on this group and on every group created later, is bounded by
    ``collective_timeout_s`` (``cluster.collective_timeout_s``: :func:`set_collective_timeout`)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from zerotrain.launch.rendezvous import TIMEOUT_ENV, check_rendezvous, rank_and_node
    from zerotrain.launch.slurm import apply_slurm_env

    apply_slurm_env()
    if "RANK" not in os.environ:
        _single_process_env()
    timeout_s = float(os.environ.get(TIMEOUT_ENV) or init_timeout_s)
    if not dist.is_initialized():  # (a second Trainer in one process, as the tests run several, has its group)
        check_rendezvous(timeout_s=timeout_s)  # an unreachable rendezvous fails here, in bounded time, naming the node
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    accelerator = get_accelerator()
    quiet_deprecated_collectives()
    if int(os.environ["RANK"]) == 0:
        announce_comm_op_build()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)
    if not dist.is_initialized():
        try:
            deepspeed.init_distributed(
                dist_backend=accelerator.communication_backend_name(),
                auto_mpi_discovery=False,
                timeout=timedelta(seconds=timeout_s),
            )
        except dist.DistError as e:  # the store timed out waiting for a rank (or lost one) while the group formed
            raise RendezvousError(
                f"{rank_and_node(os.environ)}: the process group did not form within {timeout_s:g} s "
                f"(cluster.init_timeout_s): a rank died or hangs in its start-up; its log says which and why "
                f"(under srun: the 'task N' srun reports as exited). torch: {str(e).splitlines()[0]}"
            ) from None
    set_collective_timeout(collective_timeout_s)  # the start-up bound is not a collective bound
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
    )


def set_collective_timeout(seconds: float) -> None:
    """Bound every collective by ``seconds``: the world group now, and every group created later.

    torch gives a group created without an explicit timeout (hpZ's groups, DeepSpeed's, ours) the module-level
    defaults ``default_pg_timeout`` / ``default_pg_nccl_timeout`` of ``torch.distributed.distributed_c10d``, read when
    the group is created (``_get_default_timeout``); setting them is the one place that reaches groups DeepSpeed
    creates without a timeout argument. The world group already exists, so its timeout is set directly."""
    timeout = timedelta(seconds=seconds)
    c10d = dist.distributed_c10d
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout
    c10d._set_pg_timeout(timeout)


# Only the backends' own timeout messages (a bare "timed out" from a file lock or a hub download is not a collective):
# gloo: "Timed out waiting 10000ms for recv operation to complete"; NCCL's watchdog: "... ran for 600000 milliseconds
# before timing out"; torch's store/barrier: "Socket Timeout".
_TIMEOUT_MESSAGE = re.compile(r"Timed out waiting \d+ ?ms|milliseconds before timing out|Socket Timeout")


def collective_timeout(error: BaseException) -> Optional[CollectiveTimeout]:
    """The :class:`CollectiveTimeout` a timed-out collective's exception means, or None for any other exception.

    Called on an exception that reached train.py's top level after the process group formed; its message names the
    rank that waited, the key and what to look at, instead of a backend traceback on every rank."""
    if not isinstance(error, RuntimeError) or not _TIMEOUT_MESSAGE.search(str(error)):
        return None
    if not dist.is_initialized():
        return None
    seconds = dist.distributed_c10d._get_default_timeout(dist.get_backend()).total_seconds()
    first = str(error).strip().splitlines()[0][:300]
    return CollectiveTimeout(
        f"rank {dist.get_rank()}: a collective waited {seconds:g} s (cluster.collective_timeout_s) for a rank that "
        f"did not take part: that rank is stopped, hangs or lost its node (its log and `py-spy dump` on its pid say "
        f"where); raise cluster.collective_timeout_s if a step or a checkpoint save legitimately takes longer. "
        f"Backend: {first}"
    )


# DeepSpeed 0.19.8 calls collectives that torch 2.13 deprecates; each call site warns once per process (about 360
# FutureWarnings in a 4-rank demo) about code that is not ours. torch's c10d_logger wrapper is the frame the warning
# names, so the filter matches the message of exactly these functions there; every other warning still shows.
_DEPRECATED_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "_all_gather_base",
                           "_reduce_scatter_base", "all_gather_coalesced", "all_reduce_coalesced")
DEPRECATED_COLLECTIVE_WARNING = (r"`torch\.distributed\.(" + "|".join(_DEPRECATED_COLLECTIVES) + r")` "
                                 r"(is deprecated|is a private function|will be deprecated)")


def quiet_deprecated_collectives() -> None:
    warnings.filterwarnings("ignore", message=DEPRECATED_COLLECTIVE_WARNING, category=FutureWarning,
                            module=r"(torch\.distributed|deepspeed)\.")


def pending_comm_op_build() -> Optional[Path]:
    """Where DeepSpeed is about to JIT-compile its CPU shared-memory comm op (deepspeed_shm_comm, built when the
    process group is created on the CPU accelerator), or None when there is nothing to build (cached, or not the CPU
    accelerator)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory  # torch's own rule for where the build goes

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return None
    builder = accelerator.create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    directory = Path(_get_build_directory(builder.NAME, verbose=False))
    return None if (directory / f"{builder.NAME}.so").is_file() else directory


def announce_comm_op_build() -> None:
    """A first run is otherwise silent for about 90 s while the op compiles."""
    directory = pending_comm_op_build()
    if directory is not None:
        print(f"building DeepSpeed's CPU shared-memory comm op (deepspeed_shm_comm) in {directory}: about 90 s, "
              f"once per checkout (TORCH_EXTENSIONS_DIR); later runs load it from there", file=sys.stderr, flush=True)


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
