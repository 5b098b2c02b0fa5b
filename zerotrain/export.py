"""Export a training checkpoint to a Hugging Face directory (safetensors + config + tokenizer).

Works offline, on one process, from the checkpoint files alone: DeepSpeed's ``zero_to_fp32`` merges every rank's
fp32 ZeRO partitions into one state dict on the CPU (no process group, no GPU), which is loaded into the model
built from the run's saved config and written with ``save_pretrained``, next to the tokenizer the run was trained
with (its copy in ``<run dir>/tokenizer``, see :mod:`zerotrain.run_tokenizer`), so it works from any directory and
after the data set has moved; a copy whose sha256 is not the one the checkpoint recorded is refused. Files get the
mode the umask gives, as the run's other files do. The result loads with ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` (a fast tokenizer giving the training ids). It is written to ``.<out>.partial``
and renamed to ``<out>`` when complete: an interrupted export leaves no half-written ``<out>``, and an older export
there is replaced only by a complete one. The in-training export (``checkpoint.export_hf``) and evaluation/mmlu.py's
export of a run directory are this same function.

    python -m zerotrain.export runs/tiny-llama                 # latest checkpoint -> runs/tiny-llama/hf
    python -m zerotrain.export runs/tiny-llama/checkpoints/step_00000100 out/
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Optional

import torch
import yaml
from omegaconf import OmegaConf

from zerotrain import checkpoint, run_tokenizer
from zerotrain.durable import default_modes, staged_directory
from zerotrain.errors import ZerotrainError
from zerotrain.models import MODEL_CLASSES, ModelConfig, hf_config, torch_dtype


def resolve_tag_dir(path: Path) -> Path:
    """A run directory, a checkpoints directory or a tag directory -> the tag directory."""
    path = Path(path)
    for root in (path / "checkpoints", path):
        tag = checkpoint.latest_tag(root) if root.is_dir() else None
        if tag:
            return root / tag
    if (path / checkpoint.OURS / "meta.json").is_file():
        return path
    raise checkpoint.CheckpointError(
        f"{path} is not a run directory, a checkpoints directory or a checkpoint (no 'latest' pointer and no "
        f"{checkpoint.OURS}/meta.json)"
    )


def export_checkpoint(tag_dir: Path, out_dir: Path) -> Path:
    """Write the Hugging Face export of checkpoint ``tag_dir`` (``<run dir>/checkpoints/step_*``) to ``out_dir``."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag_dir = Path(tag_dir)
    meta = checkpoint.read_meta(tag_dir)
    # What the export needs of the run's saved config: the model section, the precision and the tokenizer.
    saved = yaml.safe_load(meta["config"])
    # Before the slow merge of the shards: a tokenizer that cannot be found fails at once, with nothing written.
    tokenizer = run_tokenizer.load(tag_dir.resolve().parent.parent, saved)  # <run dir>/checkpoints/<tag>
    run_tokenizer.check_export(tokenizer, tag_dir, meta)  # the tokenizer the checkpoint was trained with, or none
    model_cfg: ModelConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved["model"]))
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
        raise checkpoint.CheckpointError(f"checkpoint {tag_dir} has no weights for: {', '.join(missing[:5])}")
    model.config.dtype = dtype
    out_dir = Path(out_dir)
    with staged_directory(out_dir) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        default_modes(staging)  # readable by whoever may read the run's other files (the umask decides)
    return out_dir


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
