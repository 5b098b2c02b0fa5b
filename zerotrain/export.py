"""Export a training checkpoint to a Hugging Face directory (safetensors + config + tokenizer): the command line of
:func:`zerotrain.checkpoint.export_checkpoint`, which says what is written and how.

    python -m zerotrain.export runs/tiny-llama                 # latest checkpoint -> runs/tiny-llama/hf
    python -m zerotrain.export runs/tiny-llama/checkpoints/step_00000100 out/

Exit codes: 0 written, 2 a bad argument or a checkpoint that cannot be exported (the message says which file).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Optional

from zerotrain.checkpoint import export_checkpoint, resolve_tag_dir
from zerotrain.errors import ZerotrainError


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2) or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 2
    try:
        tag_dir = resolve_tag_dir(Path(argv[0]))
        out = Path(argv[1]) if len(argv) == 2 else tag_dir.parent.parent / "hf"
        print(f"exported {tag_dir} -> {export_checkpoint(tag_dir, out)}")
    except ZerotrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. an output directory that cannot be written
        print(f"error: {e} (no export was written)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # SIGTERM (scancel, kill) unwinds like Ctrl-C, so the partial export is removed on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
