"""Run several trainings one after another in ONE torchrun launch (each through the real Trainer, as train.py).

A launch costs tens of seconds before the first step on the 2-core test machine; runs that only differ in a few
keys share one. Each argument is one run's overrides, space-separated; a run repeated with the same run.name
resumes from the checkpoint the previous one left (train.exit_interval). The first run that exits non-zero ends the
launch with its code. ``fit_each`` is the loop, for workers that do more around it (tests/workers/train_and_probe.py).
Usage: torchrun ... tests/workers/train_variants.py "key=value key=value" "key=value ..." ...
"""

import sys

from zerotrain.run_config import parse_args
from zerotrain.trainer import Trainer


def fit_each(runs: list[str]) -> int:
    """Fit each run (its overrides space-separated) in turn: 0, or the exit code of the first that failed. Every
    run's config is composed first, before any process group exists, as train.py composes its one (the check of
    the ``deepspeed`` section runs DeepSpeed's parser for a world of one, which a formed group of 2 fails)."""
    configs = [parse_args(overrides.split()) for overrides in runs]
    for cfg in configs:
        code = Trainer(cfg).fit()
        if code:
            return code
    return 0


def main() -> int:
    return fit_each(sys.argv[1:])


if __name__ == "__main__":
    from zerotrain.launch.teardown import exit_with

    exit_with(main)  # as train.py
