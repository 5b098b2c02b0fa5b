"""Llama-2 and Falcon through Hugging Face `transformers`: config mapping, ZeRO-3 construction, parameter counts.

The model code is Hugging Face's; this module only decides *which* model and *how it is built*. Under ZeRO-3 the
model must never materialise whole on one rank, so it is built inside ``deepspeed.zero.Init``: while an
``HfDeepSpeedConfig`` object is alive, ``transformers`` enters ``zero.Init`` itself in ``_from_config`` /
``from_pretrained`` *and* runs its own weight initialisation on the gathered parameters. A bare ``zero.Init``
around ``LlamaForCausalLM(cfg)`` would skip that initialisation silently (weights would stay at torch's defaults),
which is why nothing here constructs the model class directly.

The ``model`` section of the run config (:class:`ModelConfig`) is declared here, with the checks transformers itself
runs on a shape (:func:`validate_model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from transformers import (FalconConfig, FalconForCausalLM, LlamaConfig, LlamaForCausalLM, PretrainedConfig,
                          PreTrainedModel)

from zerotrain import hub
from zerotrain.attention import AttnImplementation, check_available, expand_multi_query_kv
from zerotrain.errors import ConfigError
from zerotrain.fields import bounded


class ModelFamily(StrEnum):
    llama = "llama"  # Llama-2 (LlamaForCausalLM)
    falcon = "falcon"  # Falcon (FalconForCausalLM)


class ParamFetch(StrEnum):
    """How ZeRO-3 gathers the parameters (``train.param_fetch``; see :func:`set_fetch_unit`)."""

    layer = "layer"  # a decoder layer's parameters in one coalesced all-gather, hooks on the layer only
    module = "module"  # DeepSpeed's default: every submodule (each Linear, each norm) gathered on its own


class RopeType(StrEnum):
    llama3 = "llama3"  # Llama-3.1/3.2's frequency-dependent stretch of the rotary frequencies


@dataclass
class RopeScaling:
    """``model.rope_scaling``: the RoPE scaling of Llama-3.1/3.2 (``rope_scaling`` in their config.json)."""

    rope_type: RopeType = RopeType.llama3
    """llama3 (the only scaling the shipped shapes use)."""
    factor: float = bounded(8.0, ge=1)
    """How much the long wavelengths are stretched (3.1: 8, 3.2: 32)."""
    low_freq_factor: float = bounded(1.0, gt=0)
    """Wavelengths longer than original_max_position_embeddings / low_freq_factor are fully scaled."""
    high_freq_factor: float = bounded(4.0, gt=0)
    """Wavelengths shorter than original_max_position_embeddings / high_freq_factor are not scaled."""
    original_max_position_embeddings: int = bounded(8192, ge=1)
    """The context length the model was first trained at (Llama-3: 8192)."""


@dataclass
class ModelConfig:
    """The ``model`` section: which architecture and shape (``configs/model/*.yaml``), or a checkpoint to start from."""

    family: ModelFamily = ModelFamily.llama
    """The architecture: llama | falcon."""
    pretrained_path: str | None = None
    """A Hugging Face checkpoint to fine-tune from: a local directory or a Hub id org/name[@revision] (resolved in the
    Hub cache, see zerotrain/hub.py); None trains the shape below from scratch."""
    hidden_size: int = bounded(4096, ge=1)
    """Width of the residual stream; a multiple of num_heads."""
    num_layers: int = bounded(32, ge=1)
    """Decoder blocks."""
    num_heads: int = bounded(32, ge=1)
    """Attention (query) heads."""
    num_kv_heads: int | None = bounded(None, ge=1)
    """Key/value heads, dividing num_heads (grouped-query attention); None: multi-head attention (= num_heads)."""
    intermediate_size: int | None = bounded(None, ge=1)
    """Width of the MLP; None: the family's default (Llama: SwiGLU's 8/3 * hidden rounded to 256; Falcon:
    4 * hidden)."""
    vocab_size: int = bounded(32000, ge=1)
    """Rows of the embedding; at least the tokenizer's vocabulary (checked when the data is opened)."""
    max_seq_len: int = bounded(4096, ge=1)
    """Longest sequence the position embedding (RoPE) is set up for; train.seq_len may not exceed it."""
    norm_eps: float = bounded(1e-5, gt=0)
    """Epsilon of the RMSNorm (Llama) / LayerNorm (Falcon)."""
    rope_theta: float = bounded(10000.0, gt=0)
    """Base of the rotary position embedding's frequencies."""
    rope_scaling: RopeScaling | None = None
    """Llama only: Llama-3.1/3.2's RoPE scaling (see RopeScaling); None: plain RoPE (Llama-2)."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output projection."""
    initializer_range: float = bounded(0.02, ge=0, le=1)
    """Standard deviation of Hugging Face's weight initialisation (transformers accepts [0, 1])."""
    parallel_attn: bool = True
    """Falcon only: attention and MLP side by side in each block (see transformers' FalconConfig)."""
    new_decoder_architecture: bool = False
    """Falcon only: 40B/180B's block layout with grouped key/value heads."""
    bias: bool = False
    """Falcon only: biases in the linear layers."""
    published_params: float | None = bounded(None, gt=0)
    """Published parameter count of this shape, checked by the tests; None for shapes of our own."""
    attn_implementation: AttnImplementation = AttnImplementation.sdpa
    """sdpa | eager | flash_attention_2 (needs the flash-attn package), handed to transformers; see
    zerotrain/attention.py (Falcon-7B's multi-query K/V are expanded so sdpa can use a fused kernel)."""


def validate_model(model: ModelConfig) -> None:
    """Build the Hugging Face config of the shape: transformers' own checks (ranges, head counts) run here."""
    if model.hidden_size % model.num_heads:
        raise ConfigError(
            f"model.hidden_size={model.hidden_size} is not divisible by model.num_heads={model.num_heads}"
        )
    if model.num_kv_heads and model.num_heads % model.num_kv_heads:
        raise ConfigError(f"model.num_heads={model.num_heads} is not divisible by "
                          f"model.num_kv_heads={model.num_kv_heads} (grouped-query attention)")
    scaling = model.rope_scaling
    if scaling is not None and model.family != ModelFamily.llama:
        raise ConfigError(f"model.rope_scaling is for family llama only (model.family={model.family}); "
                          "set model.rope_scaling=null")
    if scaling is not None and scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ConfigError(f"model.rope_scaling.high_freq_factor={scaling.high_freq_factor} must exceed "
                          f"model.rope_scaling.low_freq_factor={scaling.low_freq_factor} (Llama-3: 4 and 1)")
    check_available(model.attn_implementation)
    try:
        hf_config(model)
    except Exception as e:  # noqa: BLE001 -- transformers raises its own validation error types
        detail = " ".join(str(e).split())
        raise ConfigError(f"invalid model section for {model.family}: {detail}") from None


MODEL_CLASSES: dict[ModelFamily, type[PreTrainedModel]] = {
    ModelFamily.llama: LlamaForCausalLM, ModelFamily.falcon: FalconForCausalLM}


def hf_config(model: ModelConfig) -> PretrainedConfig:
    """Our model section -> the Hugging Face config of the same shape."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling is not None:
        sc = model.rope_scaling
        rope = {"rope_type": str(sc.rope_type), "rope_theta": model.rope_theta, "factor": sc.factor,
                "low_freq_factor": sc.low_freq_factor, "high_freq_factor": sc.high_freq_factor,
                "original_max_position_embeddings": sc.original_max_position_embeddings}
    if model.family == ModelFamily.llama:
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


def build_model(model: ModelConfig, precision: str, activation_checkpointing: bool = False) -> torch.nn.Module:
    """Build (from scratch) or load (fine-tuning) the model; under ZeRO-3 when an HfDeepSpeedConfig is alive.

    The caller keeps ``transformers.integrations.HfDeepSpeedConfig(ds_config)`` referenced for the duration: that is
    how ``transformers`` knows to partition parameters at construction time.

    ``activation_checkpointing``: keep only each decoder layer's input for backward and recompute the layer there
    (transformers' non-reentrant ``torch.utils.checkpoint`` around each layer's ``forward``). Under ZeRO-3 the
    recompute gathers the layer's parameters again (DeepSpeed tracks it), from the hpZ node-local shards when hpZ is
    on, so it adds no inter-node traffic; evaluation under ``no_grad`` is unaffected. DeepSpeed's own
    ``deepspeed.checkpointing`` is not used: it is Megatron-bound (reentrant, tensor-parallel partitioning) and its
    non-reentrant variant fails under ZeRO-3.
    """
    cls = MODEL_CLASSES[model.family]  # imported at module load, i.e. before zero.Init patches nn.Module
    kwargs: dict[str, Any] = {"dtype": torch_dtype(precision), "attn_implementation": str(model.attn_implementation)}
    if model.pretrained_path:
        # No KV cache in training: with one, transformers would also stop reading packed documents off position_ids.
        module = cls.from_pretrained(hub.resolve(model.pretrained_path), use_cache=False, **kwargs)
    else:
        module = cls._from_config(hf_config(model), **kwargs)
    if model.attn_implementation == AttnImplementation.sdpa:
        expand_multi_query_kv(module)
    if activation_checkpointing:
        module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return module


def fetch_layer_classes(module: torch.nn.Module) -> list[type[torch.nn.Module]]:
    """The decoder-layer classes of a built model: those its ``_no_split_modules`` names (transformers' own list of
    the blocks that must stay whole, the unit FSDP wraps), found among its submodules."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    classes = {type(m) for m in module.modules() if type(m).__name__ in names}
    if not classes:
        raise ConfigError(f"train.param_fetch=layer: {type(module).__name__} names no decoder-layer class "
                          f"(_no_split_modules={sorted(names)}); use train.param_fetch=module")
    return sorted(classes, key=lambda c: c.__name__)


def set_fetch_unit(module: torch.nn.Module, fetch: ParamFetch) -> list[str]:
    """Make each decoder layer ZeRO-3's unit of fetching (``layer``), before ``deepspeed.initialize``: DeepSpeed's
    ``set_z3_leaf_modules`` stops its hooks at the layer, so entering a layer gathers all of its parameters in one
    coalesced all-gather (from the hpZ secondary shards in backward) and leaving it releases them, instead of one
    all-gather and four hooks per ``Linear`` and norm. The arithmetic is the same (losses equal to ``module`` up
    to the summation order of the gradient buckets); the gathered working set becomes one whole layer (the memory
    plan counts it). Returns the leaf class names (none under ``module``, DeepSpeed's default)."""
    if fetch == ParamFetch.module:
        return []
    from deepspeed.utils import set_z3_leaf_modules

    classes = fetch_layer_classes(module)
    set_z3_leaf_modules(module, classes)
    return [c.__name__ for c in classes]


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
