"""Train through the real Trainer and send this process a signal right after one step, as ``scancel`` (SIGTERM) or
SLURM's time-limit warning (SIGUSR1, forwarded by slurm/train.sbatch) would.

Usage: python tests/workers/signal_at_step.py <SIGNAME> <step> key=value ...
"""

import os
import signal
import sys

from zerotrain.run_config import parse_args
from zerotrain.trainer import StepCallback, Trainer


class SignalAt(StepCallback):
    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum

    def on_step_end(self, trainer, step, result):
        if step == self.step:
            os.kill(os.getpid(), self.signum)


def main() -> int:
    name, step, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    return Trainer(parse_args(argv), callbacks=[SignalAt(step, signal.Signals[name])]).fit()


if __name__ == "__main__":
    from zerotrain.launch.teardown import exit_with

    exit_with(main)  # as train.py
