"""Run train.py's ``main`` once per case, one after another in ONE process: the imports (tens of seconds on the
2-core test machine) are paid once for launches that each stop early on a failed check.

Each case is ``{"name", "cwd", "argv"}``; it runs in its ``cwd`` with file descriptors 1 and 2 sent to
``<out dir>/<name>.log`` (everything the launch prints, Python's and DeepSpeed's), and ``<out dir>/results.json``
gets ``{name: exit code}``. Between cases the environment is restored; the process group of the first case that
made one stays (the trainer reuses it, as in tests/workers/train_variants.py). An exception that escapes ``main``
(which train.py would show as a traceback) is printed to that log with its traceback and counted as exit 1, as
Python would exit.
Usage: python tests/workers/train_py_cases.py <cases.json> <out dir>
"""

import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_train_py():
    spec = importlib.util.spec_from_file_location("train", REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_case(train, case: dict, log: Path) -> int:
    saved = os.dup(1), os.dup(2)
    here = os.getcwd()
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            os.chdir(case["cwd"])
            return train.main(case["argv"])
        except BaseException:  # noqa: BLE001 - what a user would see as a traceback
            traceback.print_exc()
            return 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.chdir(here)
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)


def main() -> int:
    cases, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    train = load_train_py()
    environ, results = dict(os.environ), {}
    for case in cases:
        results[case["name"]] = run_case(train, case, out / f"{case['name']}.log")
        os.environ.clear()  # what the launch set (a world of one's variables, cluster.env) goes with it
        os.environ.update(environ)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    from zerotrain.launch.teardown import exit_with

    exit_with(main)  # as train.py
