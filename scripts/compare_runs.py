#!/usr/bin/env python
"""Compare training runs: loss vs step and vs training time, tokens/s and MFU in one PNG, a Markdown summary table,
and ``--assert-equal`` loss parity. The same command as ``python -m zerotrain.compare``; see zerotrain/compare.py and
docs/paper.md.

    scripts/compare_runs.py runs/paper-x-zero3 runs/paper-x-hpz-stock --baseline zero3 -o compare.png
    scripts/compare_runs.py --group paper-x --project zerotrain-paper --baseline hpz-stock   # W&B online
    scripts/compare_runs.py --group paper-x --runs-root runs                                 # local run directories
    scripts/compare_runs.py --assert-equal runs/a runs/b [--atol 1e-6] [--common-steps-only]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from zerotrain.compare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="scripts/compare_runs.py"))
