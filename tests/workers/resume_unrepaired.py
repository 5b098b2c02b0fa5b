"""The trainer with the repair of DeepSpeed's universal-checkpoint load switched off (the negative control of
tests/test_resume_resize.py: without it the resumed curve must drift).

Usage: torchrun ... tests/workers/resume_unrepaired.py key=value ...
"""

import sys

from zerotrain.checkpoint import universal
from zerotrain.run_config import parse_args
from zerotrain.trainer import Trainer


def main() -> int:
    universal.repair = lambda engine, copy: None
    return Trainer(parse_args(sys.argv[1:])).fit()


if __name__ == "__main__":
    from zerotrain.launch.teardown import exit_with

    exit_with(main)  # as train.py
