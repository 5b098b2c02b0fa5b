"""Checkpoints: save, verify, resume (on the same or another number of ranks), export. What the trainer and the
tools use is imported here; each module owns one part of the format:

=====================================  ==============================================================================
:mod:`zerotrain.checkpoint.layout`     the directory layout: names, paths, ``latest``, :func:`resolve_tag_dir`
:mod:`zerotrain.checkpoint.config`     the ``checkpoint`` section of the run config
:mod:`zerotrain.checkpoint.sharded`    one world's checkpoint: atomic, checksummed save; metadata and file checks
:mod:`zerotrain.checkpoint.universal`  another world's resume: the global-batch check, the conversion to DeepSpeed's
                                       universal format, the repairs to DeepSpeed's load of it
:mod:`zerotrain.checkpoint.resume`     :func:`plan_resume` before the engine is built, :func:`execute_resume` after
:mod:`zerotrain.checkpoint.export`     a checkpoint as a Hugging Face directory
=====================================  ==============================================================================

Command lines: ``python -m zerotrain.export`` and ``python -m zerotrain.checkpoint_convert``.
"""

from zerotrain.checkpoint.config import CheckpointConfig, LowSpacePolicy
from zerotrain.checkpoint.layout import (
    LATEST,
    OURS,
    UNIVERSAL,
    latest_tag,
    resolve_tag_dir,
    tag_for,
    universal_dir,
)
from zerotrain.checkpoint.sharded import TrainState, read_meta, save
from zerotrain.checkpoint.universal import (
    GlobalBatch,
    check_global_batch,
    convert,
    prepare_resume,
    saved_global_batch,
)
from zerotrain.checkpoint.resume import ResumePlan, execute_resume, plan_resume
from zerotrain.checkpoint.export import export_checkpoint
from zerotrain.errors import CheckpointError

__all__ = [
    "LATEST",
    "OURS",
    "UNIVERSAL",
    "CheckpointConfig",
    "CheckpointError",
    "GlobalBatch",
    "LowSpacePolicy",
    "ResumePlan",
    "TrainState",
    "check_global_batch",
    "convert",
    "export_checkpoint",
    "latest_tag",
    "plan_resume",
    "prepare_resume",
    "read_meta",
    "resolve_tag_dir",
    "execute_resume",
    "save",
    "saved_global_batch",
    "tag_for",
    "universal_dir",
]
