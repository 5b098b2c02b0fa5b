"""Write MMLU-style fine-tuning records (prompt/response JSONL) from a local copy of MMLU's auxiliary_train split.

Usage (key=value arguments; see zerotrain/data/mmlu_sft.py and data/README.md):

    python data/mmlu_sft.py input=/data/mmlu/auxiliary_train output=data/raw/mmlu_aux_train.jsonl
    python data/prepare.py kind=sft chat_template=completion input=data/raw/mmlu_aux_train.jsonl \
        tokenizer=meta-llama/Llama-2-7b-hf output=data/prepared/mmlu_aux_train_llama2

input: cais/mmlu auxiliary_train rows (.jsonl/.parquet) or the original auxiliary_train/*.csv (file or directory;
comma-separated for several). Questions also in the MMLU test set (test=, default data/mmlu/test.jsonl) are dropped.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from zerotrain.config import ConfigError, parse_dataclass_args
from zerotrain.errors import DataError

PROG = "data/mmlu_sft.py"


@dataclass
class MmluSftArgs:
    input: str = "???"  # auxiliary_train file(s) or directory, comma-separated
    output: str = "???"  # the prompt/response JSONL to write
    test: str = "data/mmlu/test.jsonl"  # the MMLU test set kept out of the output


def main(argv: list[str]) -> int:
    if not argv or any(arg in ("-h", "--help", "help") for arg in argv):
        print(__doc__)
        return 0 if argv else 2
    from zerotrain.data.mmlu_sft import convert

    try:
        args = parse_dataclass_args(MmluSftArgs, argv, PROG)
        result = convert([Path(p) for p in args.input.split(",")], Path(args.output), Path(args.test))
    except (ConfigError, DataError) as e:
        print(f"error: {PROG}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {result.written:,} questions ({result.dropped_test_overlap:,} dropped: also in "
          f"the MMLU test set {args.test})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
