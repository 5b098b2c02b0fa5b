"""Train a Llama-2 or Falcon model with DeepSpeed ZeRO-3 / ZeRO++ from a recipe.

    python train.py recipe=tiny_llama                                  # one process
    python -m zerotrain.launch.torchrun --standalone --nproc_per_node 4 train.py recipe=tiny_llama train.steps=50
    sbatch -N 2 --gpus-per-node 8 --ntasks-per-node 8 slurm/train.sbatch paper_llama2_7b optim.lr=1e-5

Arguments are ``key=value``: ``recipe=<name>`` picks recipes/<name>.yaml, ``<group>=<name>`` swaps a fragment
from configs/<group>/ (model, data, zero, optim, schedule, cluster), and dotted keys override single values.

    python train.py recipe=paper_llama2_70b --plan                     # memory per GPU; starts nothing
    python train.py --plan --all                                       # every recipe's plan, as a markdown table

Before any process group exists, train.py checks that GPUs it was given are really used (no silent CPU fallback),
the inputs, and the memory plan (train.memory_check: refuse | warn
| off against cluster.device_memory_gib, and per node against cluster.host_memory_gib or the node's own memory).
"""

# First, before any import that takes time (seconds to minutes on a cluster's shared file system): SLURM's time-limit
# warning (SIGUSR1) or a SIGTERM arriving during start-up would otherwise kill the task (SIGUSR1's default action).
# These handlers only record the signal; the trainer takes the record over and stops at its first step boundary.
from zerotrain.launch.preemption import install_early_handlers  # isort: skip

if __name__ == "__main__":  # not when a tool imports check_inputs
    install_early_handlers()

import os  # noqa: E402 - after the signal handlers, on purpose
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from zerotrain.config import RECIPES_DIR, available  # noqa: E402
from zerotrain.errors import ConfigError, ZerotrainError  # noqa: E402
from zerotrain.launch.failures import report  # noqa: E402
from zerotrain.launch.preemption import ignore_stop_signals  # noqa: E402


def check_inputs(cfg) -> None:
    """Files the run needs, checked before any process is started or any directory written."""
    for path in [source.path for source in cfg.data.train] + ([cfg.data.valid] if cfg.data.valid else []):
        path = Path(path)
        if not (path / "manifest.json").is_file():
            raise ConfigError(
                f"data directory {path} does not exist or was not prepared (no manifest.json). Prepare it with "
                f"data/prepare.py (see data/README.md), or point data.train at a prepared directory"
            )
    pretrained = cfg.model.pretrained_path
    if pretrained:
        from zerotrain import hub

        local = hub.resolve(pretrained)  # a Hub id: its snapshot in the Hub cache, downloaded unless offline
        if not (local / "config.json").is_file():
            raise ConfigError(f"model.pretrained_path={pretrained}: not a Hugging Face checkpoint directory "
                              f"(no config.json). Give a local checkpoint directory or a Hub id org/name[@revision] "
                              f"(fetched with python -m zerotrain.fetch org/name)")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__ + "\nRecipes: " + ", ".join(available(RECIPES_DIR)))
        return 0 if argv else 2
    flags = {a for a in argv if a.startswith("--")}
    if flags - {"--plan", "--all"} or ("--all" in flags and "--plan" not in flags):
        print(f"error: unknown flag(s) {' '.join(sorted(flags))}: train.py takes key=value arguments, --plan and "
              f"--plan --all", file=sys.stderr)
        return 2
    argv = [a for a in argv if not a.startswith("--")]
    from zerotrain import memory_plan
    from zerotrain.launch import accelerator_check
    from zerotrain.run_config import parse_args  # the components' sections: imports torch, transformers, DeepSpeed

    try:
        if "--all" in flags:  # every shipped recipe as composed, on its planned world: docs/paper.md's table
            plans = [memory_plan.plan(parse_args([f"recipe={name}"])) for name in available(RECIPES_DIR)]
            print(memory_plan.markdown_table(plans))
            return 0
        cfg = parse_args(argv)  # every key, type and range is checked here, before any process group exists
        if "--plan" in flags:
            print(memory_plan.describe(memory_plan.plan(cfg)))
            return 0
        accelerator_check.check(cfg.cluster)  # GPUs allocated but DeepSpeed on the CPU: stop, saying what was found
        from zerotrain.run_dir import preflight

        finished = preflight(cfg)  # reads only: a relaunch that cannot work, or has nothing to do, writes nothing
        if finished:  # (even if its data set has moved since)
            if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
                print(finished)
            return 0
        memory_plan.check_at_start(cfg)  # the launched world against the device: refuses before any set-up
        check_inputs(cfg)
        from zerotrain import distributed
        from zerotrain.trainer import Trainer

        code = Trainer(cfg).fit()
        # Every rank leaves together, after rank 0 has closed W&B: srun --kill-on-bad-exit stops the other tasks as
        # soon as one exits non-zero (75 after a preemption checkpoint), and --wait=<s> once one exits at all.
        distributed.barrier()
        return code
    except ZerotrainError as e:  # each error type carries its exit code (zerotrain/errors.py)
        report(e)  # printed once (rank 0) under torchrun; every rank's code and message reach the launcher
        return e.exit_code
    except RuntimeError as e:  # a backend's timeout, raised from deep inside a collective: say which key bounds it
        from zerotrain.distributed import collective_timeout

        timeout = collective_timeout(e)
        if timeout is None:
            raise
        report(timeout)
        return timeout.exit_code
    finally:
        ignore_stop_signals()  # the outcome is decided: a SIGTERM while Python tears down must not turn it into 143


if __name__ == "__main__":
    from zerotrain.launch.teardown import exit_with

    exit_with(lambda: main(sys.argv[1:]))  # no C++ teardown after the outcome: it can abort (launch/teardown.py)
