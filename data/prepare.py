"""Prepare a data set for train.py: tokenise text into packed, memory-mapped shards with a manifest.

Usage (key=value arguments, the same grammar as train.py; see data/README.md and zerotrain/data/prepare.py):

    python data/prepare.py input=data/corpus/shakespeare_milton.txt output=data/prepared/tiny \
        tokenizer.train_vocab_size=2048
    python data/prepare.py input='raw/*.jsonl' tokenizer.path=llama2/tokenizer.model output=data/prepared/web
    python data/prepare.py kind=sft input=chats.jsonl tokenizer.path=data/prepared/web output=data/prepared/chat
"""

from __future__ import annotations

import sys

from zerotrain.config import ConfigError, parse_dataclass_args
from zerotrain.data.prepare import Interrupted, PrepareConfig, prepare
from zerotrain.errors import DataError

PROG = "data/prepare.py"


def expand_shorthands(argv: list[str]) -> list[str]:
    """``tokenizer=<path>`` is short for ``tokenizer.path=<path>`` (the tokenizer group also has train_* keys)."""
    return [f"tokenizer.path={arg[len('tokenizer='):]}" if arg.startswith("tokenizer=") else arg for arg in argv]


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help", "help") for arg in argv):
        print(__doc__)
        return 0
    try:
        cfg = parse_dataclass_args(PrepareConfig, expand_shorthands(argv), PROG)
        result = prepare(cfg)
    except (ConfigError, DataError) as e:
        message = str(e) if str(e).startswith(PROG) else f"{PROG}: {e}"
        print(f"error: {message}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"{PROG}: {e}; the partial output was removed", file=sys.stderr)
        return 128 + e.signum  # what the shell reports for a process the signal killed
    splits = result.manifest["splits"]
    summary = ", ".join(f"{name}: {s['num_documents']:,} documents, {s['num_tokens']:,} tokens"
                        for name, s in splits.items())
    print(f"wrote {result.path} ({summary}; {result.tokens_per_second:,.0f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
