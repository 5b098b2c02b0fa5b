"""Two resumes in ONE torchrun launch (a launch costs tens of seconds before its first step on the 2-core test
machine), both through train.py's ``main``: the first as train.py runs it, the second with the repair of DeepSpeed's
universal-checkpoint load switched off (the negative control of tests/test_resume_resize.py: without the repair the
resumed curve must drift). Each argument is one run's overrides, space-separated.

Usage: torchrun ... tests/workers/resume_with_and_without_repair.py "key=value ..." "key=value ..."
"""

import sys

from train_py_cases import load_train_py

from zerotrain.checkpoint import universal


def main() -> int:
    repaired, unrepaired = sys.argv[1].split(), sys.argv[2].split()
    train = load_train_py()
    code = train.main(repaired)
    if code:
        return code
    universal.repair = lambda engine, copy: None
    return train.main(unrepaired)


if __name__ == "__main__":
    from zerotrain.launch.teardown import exit_with

    exit_with(main)  # as train.py
