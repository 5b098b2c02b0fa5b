"""No silent CPU fallback (zerotrain/launch/accelerator_check.py): GPUs allocated in the environment, or a GPU
cluster profile, while DeepSpeed's accelerator is the CPU, stop train.py at start-up. The accelerator is the real
one of this CPU machine; only the environment variables are faked."""

from __future__ import annotations

import pytest
import torch

from tools.launcher import PYTHON, run
from zerotrain.distributed import Accelerator, ClusterConfig
from zerotrain.errors import ConfigError
from zerotrain.launch import accelerator_check

CPU, CUDA = ClusterConfig(accelerator=Accelerator.cpu), ClusterConfig(accelerator=Accelerator.cuda)


@pytest.mark.parametrize("environ", [
    {"SLURM_GPUS_ON_NODE": "8"}, {"SLURM_GPUS_PER_NODE": "a100:8"}, {"SLURM_GPUS": "16"},
    {"SLURM_JOB_GPUS": "0,1,2,3"}, {"SLURM_STEP_GPUS": "0"}, {"CUDA_VISIBLE_DEVICES": "0,1"},
])
def test_allocated_gpus_on_a_cpu_accelerator_stop_with_what_was_found(environ):
    with pytest.raises(ConfigError) as e:
        accelerator_check.check(CPU, environ)  # DS_ACCELERATOR not in the faked environment
    message = str(e.value)
    name, value = next(iter(environ.items()))
    assert f"{name}={value}" in message and "DeepSpeed's accelerator is the CPU" in message
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    assert f"torch {torch.__version__} ({build})" in message  # 2.13.0+cpu here: torch.version.cuda is None
    assert "torch.cuda.is_available()=False" in message and "NVIDIA driver: " in message


def test_a_gpu_cluster_profile_stops_too_and_names_ds_accelerator():
    with pytest.raises(ConfigError, match="cluster.accelerator=cuda.*DS_ACCELERATOR=cpu is set: unset it"):
        accelerator_check.check(CUDA, {"DS_ACCELERATOR": "cpu"})


@pytest.mark.parametrize("environ", [
    {}, {"CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": "-1"}, {"SLURM_GPUS_ON_NODE": "0"},
    {"SLURM_JOB_ID": "12", "SLURM_NTASKS": "4"},  # a CPU-only SLURM job
    {"CUDA_VISIBLE_DEVICES": "0,1", "DS_ACCELERATOR": "cpu"},  # a CPU run asked for twice (with cluster cpu)
])
def test_no_gpus_expected_or_a_deliberate_cpu_run_passes(environ):
    accelerator_check.check(CPU, environ)  # negative control of the tests above: same accelerator, no error


def test_train_py_exits_2_before_any_process_group():
    out = run([PYTHON, "train.py", "recipe=tiny_llama", "train.steps=1"],
              env={"SLURM_GPUS_ON_NODE": "8", "DS_ACCELERATOR": "cpu"}, timeout=300, check=False)
    # local_cpu with DS_ACCELERATOR=cpu is deliberate; a GPU profile is not:
    refused = run([PYTHON, "train.py", "recipe=tiny_llama", "cluster=ethernet", "train.steps=1"],
                  env={"SLURM_GPUS_ON_NODE": "8"}, timeout=300, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "error: GPUs were allocated (SLURM_GPUS_ON_NODE=8, cluster.accelerator=cuda)" in refused.stderr
    assert "torch.cuda.is_available()=False" in refused.stderr
    assert "memory plan" not in refused.stderr  # it stopped first, before the memory check and any set-up
    assert "GPUs were allocated" not in out.stderr
