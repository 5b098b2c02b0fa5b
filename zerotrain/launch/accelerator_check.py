"""No silent CPU fallback: a job that was given GPUs but would run on the CPU stops at start-up, saying why.

DeepSpeed picks its accelerator once (``deepspeed/accelerator/real_accelerator.py``): ``DS_ACCELERATOR`` if set,
else CUDA when ``torch.cuda`` sees a device, else the CPU -- with only a log line. On a GPU node with a CPU-only
torch wheel, or a driver too old for torch's CUDA, a training job then runs on the CPU over gloo, a thousand times
slower, until someone looks. :func:`check` runs in ``train.py`` before any process group and raises
:class:`~zerotrain.errors.ConfigError` (exit code 2) when GPUs are expected and DeepSpeed's accelerator is the CPU.

GPUs are expected when the job's environment says so (SLURM's ``SLURM_GPUS_ON_NODE``, ``SLURM_GPUS_PER_NODE``,
``SLURM_GPUS``, ``SLURM_JOB_GPUS``, ``SLURM_STEP_GPUS``; ``CUDA_VISIBLE_DEVICES`` non-empty and not ``-1``), or the
cluster profile does (``cluster.accelerator: cuda``). One exception: ``DS_ACCELERATOR=cpu`` together with
``cluster.accelerator: cpu`` is a CPU run asked for twice (the CPU test cluster inside a GPU allocation); it only
warns.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zerotrain.errors import ConfigError

log = logging.getLogger("zerotrain")

GPU_VARIABLES = ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_GPUS", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS",
                 "CUDA_VISIBLE_DEVICES")


def _allocates_gpus(name: str, value: str) -> bool:
    value = value.strip()
    if name == "CUDA_VISIBLE_DEVICES":
        return value not in ("", "-1")
    if name in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):  # GPU ids, e.g. "0,1,2,3"
        return value != ""
    # A count, possibly typed per node ("a100:8", "gpu:a100:8") or a list of them ("8,8").
    counts = [part.rsplit(":", 1)[-1] for part in value.split(",")]
    return any(c.isdigit() and int(c) > 0 for c in counts)


def expected_gpus(environ: Mapping[str, str], cluster_accelerator: str) -> list[str]:
    """Why GPUs are expected: ``NAME=value`` of each variable that allocates some, and the profile's say."""
    reasons = [f"{name}={environ[name]}" for name in GPU_VARIABLES
               if name in environ and _allocates_gpus(name, environ[name])]
    if cluster_accelerator == "cuda":
        reasons.append("cluster.accelerator=cuda")
    return reasons


def driver_version() -> str:
    """The NVIDIA driver, from torch (CUDA builds only), the kernel module, or nvidia-smi; 'not found' otherwise."""
    import torch

    getter = getattr(torch._C, "_cuda_getDriverVersion", None)  # absent from CPU-only builds
    if getter is not None:
        try:
            version = getter()  # e.g. 12080 for CUDA 12.8's driver API; 0 when no driver is loaded
            if version:
                return f"{version // 1000}.{version % 1000 // 10} (driver API, from torch)"
        except RuntimeError:
            pass
    proc = Path("/proc/driver/nvidia/version")
    if proc.is_file():
        return " ".join(proc.read_text().split()[:8])
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=15)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0] + " (nvidia-smi)"
        except (OSError, subprocess.TimeoutExpired):
            pass
    return "not found (no /proc/driver/nvidia/version, no nvidia-smi)"


def torch_report() -> str:
    """torch's build, what it sees of CUDA (with the warning an old driver makes it emit) and the driver."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
    said = "; ".join(" ".join(str(w.message).split()) for w in caught)
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    return (f"torch {torch.__version__} ({build}), torch.cuda.is_available()={available}, device_count={count}"
            + (f", torch warned: {said}" if said else "") + f"; NVIDIA driver: {driver_version()}")


def check(cluster: Any, environ: Mapping[str, str] = os.environ) -> None:
    """Raise :class:`ConfigError` when GPUs are expected (see the module docstring) but DeepSpeed's accelerator is
    the CPU. ``cluster``: the run's ``cluster`` section."""
    from deepspeed.accelerator import get_accelerator

    reasons = expected_gpus(environ, str(cluster.accelerator))
    if not reasons or get_accelerator().device_name() != "cpu":
        return
    forced = environ.get("DS_ACCELERATOR")
    if forced == "cpu" and str(cluster.accelerator) == "cpu":
        log.warning("GPUs allocated (%s) but DS_ACCELERATOR=cpu and cluster.accelerator=cpu: running on the CPU, "
                    "as asked", ", ".join(reasons))
        return
    cause = (f"DS_ACCELERATOR={forced} is set: unset it to let DeepSpeed use the GPUs" if forced else
             "DeepSpeed found no usable CUDA device")
    raise ConfigError(
        f"GPUs were allocated ({', '.join(reasons)}) but DeepSpeed's accelerator is the CPU: {cause}. Found: "
        f"{torch_report()}. Install a CUDA build of torch matching the node's driver (README, 'On GPU nodes'); "
        f"for a deliberate CPU run use a CPU cluster profile (cluster=local_cpu) with DS_ACCELERATOR=cpu")
