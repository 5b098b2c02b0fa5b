"""Llama-2 and Falcon through Hugging Face `transformers`: config mapping, ZeRO-3 construction, parameter counts.

The model code is Hugging Face's; this module only decides *which* model and *how it is built*. Under ZeRO-3 the
model must never materialise whole on one rank, so it is built inside ``deepspeed.zero.Init``: while an
``HfDeepSpeedConfig`` object is alive, ``transformers`` enters ``zero.Init`` itself in ``_from_config`` /
``from_pretrained`` *and* runs its own weight initialisation on the gathered parameters. A bare ``zero.Init``
around ``LlamaForCausalLM(cfg)`` would skip that initialisation silently (weights would stay at torch's defaults),
which is why nothing here constructs the model class directly.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import FalconConfig, FalconForCausalLM, LlamaConfig, LlamaForCausalLM, PretrainedConfig

from zerotrain.config import ModelConfig

MODEL_CLASSES = {"llama": LlamaForCausalLM, "falcon": FalconForCausalLM}


def hf_config(model: ModelConfig) -> PretrainedConfig:
    """Our model section -> the Hugging Face config of the same shape."""
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.family == "llama":
        return LlamaConfig(
            vocab_size=model.vocab_size,
            hidden_size=model.hidden_size,
            intermediate_size=model.intermediate_size or _llama_ffn(model.hidden_size),
            num_hidden_layers=model.num_layers,
            num_attention_heads=model.num_heads,
            num_key_value_heads=model.num_kv_heads or model.num_heads,
            max_position_embeddings=model.max_seq_len,
            rms_norm_eps=model.norm_eps,
            rope_parameters=rope,
            tie_word_embeddings=model.tie_word_embeddings,
            initializer_range=model.initializer_range,
            use_cache=False,
        )
    kv_heads = model.num_kv_heads or model.num_heads
    return FalconConfig(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden_size,
        num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads,
        # Falcon-7B is multi-query (one K/V head); 40B/180B use the "new decoder architecture" with K/V groups.
        num_kv_heads=kv_heads if model.new_decoder_architecture else None,
        multi_query=(not model.new_decoder_architecture) and kv_heads == 1,
        new_decoder_architecture=model.new_decoder_architecture,
        parallel_attn=model.parallel_attn,
        bias=model.bias,
        ffn_hidden_size=model.intermediate_size or 4 * model.hidden_size,
        max_position_embeddings=model.max_seq_len,
        layer_norm_epsilon=model.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=model.tie_word_embeddings,
        initializer_range=model.initializer_range,
        use_cache=False,
    )


def _llama_ffn(hidden: int) -> int:
    # Llama's SwiGLU width: 2/3 of 4*hidden, rounded up to a multiple of 256 (gives 11008 for hidden 4096).
    return 256 * ((int(2 * 4 * hidden / 3) + 255) // 256)


def torch_dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


def build_model(model: ModelConfig, precision: str) -> torch.nn.Module:
    """Build (from scratch) or load (fine-tuning) the model; under ZeRO-3 when an HfDeepSpeedConfig is alive.

    The caller keeps ``transformers.integrations.HfDeepSpeedConfig(ds_config)`` referenced for the duration: that is
    how ``transformers`` knows to partition parameters at construction time.
    """
    cls = MODEL_CLASSES[model.family]  # imported at module load, i.e. before zero.Init patches nn.Module
    dtype = torch_dtype(precision)
    if model.pretrained_path:
        return cls.from_pretrained(model.pretrained_path, dtype=dtype)
    return cls._from_config(hf_config(model), dtype=dtype)


def count_parameters(model: ModelConfig) -> int:
    """Exact parameter count of a shape, computed on the meta device (no memory, no weights)."""
    with torch.device("meta"):  # the class, not _from_config, which could enter zero.Init in a training process
        module = MODEL_CLASSES[model.family](hf_config(model))
    seen: set[int] = set()
    total = 0
    for p in module.parameters():  # tied weights appear once
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def describe(model: ModelConfig) -> dict[str, Any]:
    return {
        "family": model.family,
        "layers": model.num_layers,
        "hidden": model.hidden_size,
        "heads": model.num_heads,
        "kv_heads": model.num_kv_heads or model.num_heads,
        "vocab": model.vocab_size,
    }
