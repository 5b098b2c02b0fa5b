"""The ``checkpoint`` section of the run config: when to save, how many to keep, how to resume, whether to export."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from zerotrain.fields import bounded


class LowSpacePolicy(StrEnum):
    warn = "warn"
    skip = "skip"


@dataclass
class CheckpointConfig:
    """The ``checkpoint`` section: when to save, how many to keep, whether to resume and to export."""

    interval: int = bounded(0, ge=0)
    """Steps between checkpoints; 0: only at the end (save_final)."""
    keep_last: int = bounded(3, ge=1)
    """Complete checkpoints kept; older ones are deleted after a newer one is complete, or before a save when the
    free space is less than the last checkpoint's size (down to keep_last - 1 of them; never the one latest names)."""
    resume: bool = True
    """Resume automatically from <run dir>/checkpoints/latest; false refuses to start over existing checkpoints."""
    on_interrupt: bool = False
    """Ctrl-C (SIGINT) during training: save a checkpoint at the step boundary first, then exit 130 (a second
    Ctrl-C stops at once); false: stop at once (exit 130), losing the steps since the last checkpoint, as a user
    who presses Ctrl-C expects of a save that may take minutes."""
    save_final: bool = True
    """Save a checkpoint after the last step."""
    export_hf: bool = False
    """Also write a Hugging Face directory (<run dir>/hf) after the last step (needs save_final)."""
    low_space: LowSpacePolicy = LowSpacePolicy.warn
    """Before each save, free space is compared with the last checkpoint's size: warn (and try; a save that runs out
    of space removes itself and latest stays put) | skip (skip this save, with a message)."""
    verify: bool = True
    """On resume, check the CRC32 recorded for each file as it was written (each rank reads back the files it
    loads: about 2 GB/s); false skips the check."""
    convert_on_resize: bool = True
    """On resume with a different number of ranks, convert the latest checkpoint once to DeepSpeed's universal
    format (rank 0, before the model is built) and resume from that; false refuses, naming the command that converts
    it beforehand (python -m zerotrain.checkpoint_convert <run dir>). The global batch must stay the same."""

    def save_due(self, step: int, last_step: int) -> bool:
        """Whether step ``step`` ends with a periodic checkpoint (the last step's is save_final's)."""
        return bool(self.interval) and step % self.interval == 0 and step != last_step
