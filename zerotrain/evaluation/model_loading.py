"""Finding and loading the model a standalone evaluation scores.

Hugging Face export directories (config.json + weights + tokenizer files, as
written by ``save_pretrained``) load directly. A zerotrain run directory (or its
``checkpoints/`` directory, or one ``step_*`` checkpoint) is exported once with
``zerotrain.export`` into ``<checkpoint>/hf`` and loaded from there; other
DeepSpeed checkpoints are refused with guidance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

from zerotrain.evaluation.errors import NotAnHFExportError

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def _looks_like_deepspeed_run(path: Path) -> bool:
    return (
        (path / "latest").is_file()
        or any(path.glob("global_step*"))
        or any(path.glob("**/*_optim_states.pt"))
        or any(path.glob("**/mp_rank_*_model_states.pt"))
    )


def resolve_checkpoint(path: str | Path) -> Path:
    """The Hugging Face export directory to load for ``path``, or NotAnHFExportError."""
    path = Path(path)
    if not path.exists():
        raise NotAnHFExportError(f"checkpoint {str(path)!r} does not exist")
    if not path.is_dir():
        raise NotAnHFExportError(
            f"checkpoint {str(path)!r} is a file; pass the Hugging Face export directory "
            f"(config.json + *.safetensors + tokenizer files)"
        )
    has_config = (path / "config.json").is_file()
    has_weights = any(any(path.glob(p)) for p in WEIGHT_PATTERNS)
    has_tokenizer = any((path / f).is_file() for f in TOKENIZER_FILES)
    if has_config and has_weights and has_tokenizer:
        return path
    export = _export_training_checkpoint(path)
    if export is not None:
        return export
    if _looks_like_deepspeed_run(path):
        raise NotAnHFExportError(
            f"{path} is a DeepSpeed training checkpoint, not an HF export. Export it first "
            f"(save_pretrained of the gathered fp32/bf16 weights, e.g. via DeepSpeed's "
            f"zero_to_fp32.py, plus the tokenizer) and pass that directory."
        )
    missing = [
        name
        for name, ok in (
            ("config.json", has_config),
            ("weights (*.safetensors or pytorch_model*.bin)", has_weights),
            ("tokenizer files (tokenizer.json / tokenizer.model + tokenizer_config.json)", has_tokenizer),
        )
        if not ok
    ]
    raise NotAnHFExportError(f"{path} is not an HF export: missing {', '.join(missing)}")


def _export_training_checkpoint(path: Path) -> Path | None:
    """A zerotrain checkpoint -> its Hugging Face export (made once, by rank 0, with zerotrain.checkpoint's atomic
    export_checkpoint); None if not ours."""
    import torch.distributed as dist

    from zerotrain import checkpoint
    from zerotrain.errors import DataError

    try:
        tag_dir = checkpoint.resolve_tag_dir(path)
    except checkpoint.CheckpointError:
        return None
    if not (tag_dir / checkpoint.OURS / "meta.json").is_file():
        return None  # a DeepSpeed checkpoint, but not one of ours: no config to rebuild the model from
    export = tag_dir / "hf"
    if not (export / "config.json").is_file() and (not dist.is_initialized() or dist.get_rank() == 0):
        try:
            checkpoint.export_checkpoint(tag_dir, export)
        except (checkpoint.CheckpointError, DataError) as e:
            raise NotAnHFExportError(f"cannot export checkpoint {tag_dir} to evaluate it: {e}") from None
    if dist.is_initialized():
        dist.barrier()
    return export


def load_hf_export(
    path: str | Path, *, dtype: torch.dtype | str = "auto", device: torch.device | str = "cpu"
) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) from an HF export directory, model in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = resolve_checkpoint(path)
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=dtype)
    if model.config._attn_implementation == "sdpa":
        from zerotrain.attention import expand_multi_query_kv

        expand_multi_query_kv(model)  # Falcon-7B: a fused SDPA kernel instead of the fp32 math fallback
    return cast(torch.nn.Module, model).to(device).eval(), tokenizer  # transformers types .to() oddly


def model_max_length(model: torch.nn.Module, default: int = 2048) -> int:
    """The context length from the model config (as lm-evaluation-harness reads it)."""
    config = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return default
