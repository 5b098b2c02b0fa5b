"""Which attention kernel the model runs, and the one fix that lets Falcon-7B's multi-query attention use a fused one.

``model.attn_implementation`` is handed to transformers as its ``attn_implementation`` (:class:`AttnImplementation`).
Two facts of transformers 5.24 + PyTorch 2.13 shape what happens here:

* ``flash_attention_2`` needs the ``flash-attn`` package; without it transformers raises while *building* the
  model, i.e. after the process group exists. :func:`check_available` says so before anything starts.
* Falcon-7B (``multi_query``: 71 query heads, one key/value head) calls ``F.scaled_dot_product_attention`` with Q of
  71 heads and K/V of one, without ``enable_gqa``. Every fused SDPA kernel refuses unequal head counts, so PyTorch
  falls back to the math kernel, which keeps fp32 [b, heads, s, s] probabilities per layer (~46 GB at the paper's
  batch). :func:`expand_multi_query_kv` makes ``_split_heads`` return K/V already expanded to every query head, so
  the fused kernels accept them. The numbers are unchanged (the math kernel gives bitwise the same result either
  way); only the kernel choice and its memory change. It is an attribute patch on the built instances, in the spirit
  of :mod:`zerotrain.hpz`, not a copy of transformers' forward.

Falcon-40B/180B (``new_decoder_architecture``) already broadcast K/V to every head, and Llama's SDPA path uses
``enable_gqa``; neither needs a patch.
"""

from __future__ import annotations

import types
from enum import StrEnum

import torch

from zerotrain.errors import ConfigError


class AttnImplementation(StrEnum):
    sdpa = "sdpa"  # torch.nn.functional.scaled_dot_product_attention: PyTorch picks flash / mem-efficient / math
    eager = "eager"  # transformers' explicit softmax(QK^T)V: materialises the [b, heads, s, s] scores
    flash_attention_2 = "flash_attention_2"  # the flash-attn package (CUDA only); varlen for packed sequences


def check_available(impl: AttnImplementation) -> None:
    """Refuse, before launch, an implementation whose package is not installed."""
    if impl == AttnImplementation.flash_attention_2:
        from transformers.utils import is_flash_attn_2_available

        if not is_flash_attn_2_available():
            raise ConfigError(
                "model.attn_implementation=flash_attention_2 needs the 'flash-attn' package (and a CUDA GPU), which "
                "is not installed here: pip install flash-attn --no-build-isolation, or use "
                "model.attn_implementation=sdpa (the default) or eager")


def _split_heads_expanded(self, fused_qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Falcon's multi-query layout: num_heads query heads, then one key head and one value head.
    batch, seq_len, _ = fused_qkv.shape
    fused_qkv = fused_qkv.view(batch, seq_len, self.num_heads + 2, self.head_dim)
    shape = (batch, seq_len, self.num_heads, self.head_dim)
    query = fused_qkv[..., :-2, :]
    key = fused_qkv[..., [-2], :].expand(shape).contiguous()
    value = fused_qkv[..., [-1], :].expand(shape).contiguous()
    return query, key, value


def expand_multi_query_kv(model: torch.nn.Module) -> int:
    """Patch every multi-query ``FalconAttention`` of ``model`` so K/V reach SDPA with ``num_heads`` heads.

    Returns how many modules were patched (0 for Llama and for Falcon-40B/180B). ``forward`` reshapes K/V to
    ``self.num_kv_heads`` heads, so that attribute is raised to ``num_heads`` on the patched instances too.
    """
    from transformers.models.falcon.modeling_falcon import FalconAttention

    patched = 0
    for module in model.modules():
        if isinstance(module, FalconAttention) and module.multi_query and not module.new_decoder_architecture:
            setattr(module, "_split_heads", types.MethodType(_split_heads_expanded, module))  # noqa: B010 -- a method
            module.num_kv_heads = module.num_heads
            patched += 1
    return patched
