"""A checkpoint as a Hugging Face directory (safetensors + config + tokenizer), written from its files alone.

Works offline, on one process: DeepSpeed's ``zero_to_fp32`` merges every rank's fp32 ZeRO partitions into one state
dict on the CPU (no process group, no GPU), which is loaded into the model built from the run's saved config and
written with ``save_pretrained``, next to the tokenizer the run was trained with (its copy in ``<run dir>/tokenizer``,
see :mod:`zerotrain.run_tokenizer`), so it works from any directory and after the data set has moved; a copy whose
sha256 is not the one the checkpoint recorded is refused. Files get the mode the umask gives, as the run's other
files do. The result
loads with ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` (a fast tokenizer giving
the training ids). It is written to ``.<out>.partial`` and renamed to ``<out>`` when complete: an interrupted export
leaves no half-written ``<out>``, and an older export there is replaced only by a complete one. The command line
(``python -m zerotrain.export``), the in-training export (``checkpoint.export_hf``) and evaluation/mmlu.py's export of
a run directory are all :func:`export_checkpoint`.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
import yaml
from omegaconf import OmegaConf

from zerotrain import run_tokenizer
from zerotrain.checkpoint import sharded
from zerotrain.durable import default_modes, staged_directory
from zerotrain.errors import CheckpointError
from zerotrain.models import MODEL_CLASSES, ModelConfig, hf_config, torch_dtype


def export_checkpoint(tag_dir: Path, out_dir: Path) -> Path:
    """Write the Hugging Face export of checkpoint ``tag_dir`` (``<run dir>/checkpoints/step_*``) to ``out_dir``."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag_dir = Path(tag_dir)
    meta = sharded.read_meta(tag_dir)
    # What the export needs of the run's saved config: the model section, the precision and the tokenizer.
    saved = yaml.safe_load(meta["config"])
    # Before the slow merge of the shards: a tokenizer that cannot be found fails at once, with nothing written.
    tokenizer = run_tokenizer.load(tag_dir.resolve().parent.parent, saved)  # <run dir>/checkpoints/<tag>
    run_tokenizer.check_export(tokenizer, tag_dir, meta)  # the tokenizer the checkpoint was trained with, or none
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), saved["model"])
    model_cfg = cast(ModelConfig, OmegaConf.to_object(merged))
    precision = saved["train"]["precision"]
    state = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    # The class itself, not _from_config: inside a training process an HfDeepSpeedConfig is alive and _from_config
    # would enter zero.Init (collective) on this one rank. On the meta device no memory is touched until the load.
    with torch.device("meta"):
        model = MODEL_CLASSES[model_cfg.family](hf_config(model_cfg))
    dtype = torch_dtype(precision)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    model.tie_weights()
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"checkpoint {tag_dir} has no weights for: {', '.join(missing[:5])}")
    model.config.dtype = dtype
    out_dir = Path(out_dir)
    with staged_directory(out_dir) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        default_modes(staging)  # readable by whoever may read the run's other files (the umask decides)
    return out_dir
