"""Multi-node launch support: SLURM -> torch.distributed environment, rendezvous checks, node layout, preemption.

Startup order in ``train.py`` (each step before the next):

0. ``install_early_handlers()``                   train.py's first lines: record USR1/TERM during the imports
1. ``preemption = PreemptionHandler()``            takes over what was recorded, so an early USR1 cannot kill
2. ``apply_slurm_env()``                           RANK/WORLD_SIZE/MASTER_ADDR... from SLURM (no-op under torchrun)
3. set ``cluster.env`` (NCCL_*) in os.environ      before any process group exists
4. ``check_rendezvous()``                          bounded (``cluster.init_timeout_s``), explicit failure, no hang
5. create the process group (``deepspeed.init_distributed``), within the same bound
6. ``layout = resolve_layout(cfg.zero.get("zero_hpz_partition_size", 1))``  before the DeepSpeed config is built
7. after ``deepspeed.initialize``: ``verify_deepspeed_hpz_groups(layout)`` (DeepSpeed's real groups are intra-node)
8. training loop: ``if preemption.should_stop(): save; sys.exit(REQUEUE_EXIT_CODE)`` at each step boundary

On failure, :mod:`zerotrain.launch.failures` prints a user error once and records every rank's code for
``python -m zerotrain.launch.torchrun``, which exits with the code of the rank that failed first.
"""

from zerotrain.launch.layout import (
    LayoutError,
    NodeLayout,
    gather_layout,
    hpz_groups,
    layout_from_node_names,
    resolve_hpz_partition_size,
    resolve_layout,
    resolve_zero_config,
    verify_deepspeed_hpz_groups,
)
from zerotrain.launch.preemption import REQUEUE_EXIT_CODE, PreemptionHandler, install_early_handlers
from zerotrain.launch.rendezvous import RendezvousError, check_rendezvous
from zerotrain.launch.slurm import LaunchInfo, SlurmEnvError, apply_slurm_env, master_port, parse_tasks_per_node
from zerotrain.launch.world import World, launched_world

__all__ = [
    "REQUEUE_EXIT_CODE",
    "LaunchInfo",
    "LayoutError",
    "NodeLayout",
    "PreemptionHandler",
    "RendezvousError",
    "SlurmEnvError",
    "World",
    "apply_slurm_env",
    "check_rendezvous",
    "gather_layout",
    "hpz_groups",
    "install_early_handlers",
    "launched_world",
    "layout_from_node_names",
    "master_port",
    "parse_tasks_per_node",
    "resolve_hpz_partition_size",
    "resolve_layout",
    "resolve_zero_config",
    "verify_deepspeed_hpz_groups",
]
