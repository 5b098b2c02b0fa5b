"""Convert a checkpoint to DeepSpeed's universal format, to resume on a different number of ranks: the command line
of :func:`zerotrain.checkpoint.universal.convert` (:mod:`zerotrain.checkpoint.universal` says what carries over).

    python -m zerotrain.checkpoint_convert runs/tiny-llama           # latest -> runs/tiny-llama/checkpoints/universal/
    python -m zerotrain.checkpoint_convert runs/big/checkpoints/step_00001000 --workers 16

Exit codes: 0 converted (or already current), 2 a bad argument or a checkpoint that cannot be converted.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Optional

from zerotrain.checkpoint import convert, resolve_tag_dir
from zerotrain.errors import ZerotrainError


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zerotrain.checkpoint_convert",
                                     description="Convert a checkpoint to DeepSpeed's universal format, to resume on "
                                                 "a different number of ranks (see the module docstring).")
    parser.add_argument("checkpoint", type=Path, help="a run directory, its checkpoints/ directory, or a step_* "
                                                      "checkpoint (default: the one latest names)")
    parser.add_argument("--workers", type=int, default=1, help="processes for DeepSpeed's extraction and merge")
    parser.add_argument("--no-verify", action="store_true", help="skip the CRC32 check of the source files")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        started = time.perf_counter()
        target = convert(resolve_tag_dir(args.checkpoint), workers=args.workers, verify=not args.no_verify)
        print(f"universal checkpoint: {target} ({time.perf_counter() - started:.1f} s)")
    except ZerotrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e} (no universal copy was written)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
