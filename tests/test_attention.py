"""model.attn_implementation, and the Falcon-7B multi-query fix that lets PyTorch's fused SDPA kernel run.

On the CPU, PyTorch has two SDPA backends, the math kernel and a fused flash kernel. Restricting SDPA to the fused
one (``sdpa_kernel([SDPBackend.FLASH_ATTENTION])``) is how the kernel choice becomes observable: a kernel that
refuses its inputs raises instead of silently falling back to the math kernel. (CUDA's mem-efficient and cuDNN
kernels, which Falcon's always-materialised mask selects on a GPU, can only be checked there.)
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.utils import is_flash_attn_2_available

from zerotrain import models
from zerotrain.errors import ConfigError
from zerotrain.run_config import compose

FALCON_7B_LIKE = dict(family="falcon", num_kv_heads=1)  # multi-query: one key/value head for every query head
LLAMA_GQA = dict(family="llama", num_kv_heads=2)


def model_config(attn: str = "sdpa", **shape) -> models.ModelConfig:
    return models.ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, vocab_size=256,
                              max_seq_len=64, attn_implementation=attn, **shape)


def build(cfg: models.ModelConfig, patched: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    if patched:
        return models.build_model(cfg, "fp32")
    # The stock transformers model, exactly as build_model makes it but without the K/V expansion.
    return models.MODEL_CLASSES[cfg.family]._from_config(models.hf_config(cfg), dtype=torch.float32,
                                                         attn_implementation=str(cfg.attn_implementation))


def forward_backward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach()


IDS = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))


def test_attn_implementation_reaches_transformers():
    for attn in ("sdpa", "eager"):
        assert build(model_config(attn, **LLAMA_GQA)).config._attn_implementation == attn


def test_falcon_multi_query_runs_on_the_fused_kernel_only_with_the_fix():
    fixed = build(model_config(**FALCON_7B_LIKE))
    assert all(m.num_kv_heads == m.num_heads for m in fixed.modules() if hasattr(m, "_split_heads"))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        forward_backward(fixed, IDS)  # raises "No available kernel" if the fused kernel refuses
        # Negative control: transformers' stock multi-query Falcon hands SDPA 4 query heads and 1 K/V head.
        with pytest.raises(RuntimeError, match="No available kernel"):
            forward_backward(build(model_config(**FALCON_7B_LIKE), patched=False), IDS)


def test_llama_grouped_query_attention_runs_on_the_fused_kernel():
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # transformers passes enable_gqa=True when there is no mask
        forward_backward(build(model_config(**LLAMA_GQA)), IDS)


def test_the_fix_changes_the_kernel_not_the_numbers():
    fixed, stock = build(model_config(**FALCON_7B_LIKE)), build(model_config(**FALCON_7B_LIKE), patched=False)
    eager = build(model_config("eager", **FALCON_7B_LIKE))
    with torch.no_grad():
        with sdpa_kernel([SDPBackend.MATH]):  # the same kernel: bitwise the same result, expanded K/V or not
            assert torch.equal(fixed(input_ids=IDS).logits, stock(input_ids=IDS).logits)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            torch.testing.assert_close(fixed(input_ids=IDS).logits, eager(input_ids=IDS).logits, rtol=0, atol=1e-5)


def test_falcon_40b_layout_and_eager_are_left_alone():
    from zerotrain.attention import expand_multi_query_kv

    assert expand_multi_query_kv(build(model_config(family="falcon", num_kv_heads=2,
                                                    new_decoder_architecture=True))) == 0
    eager = build(model_config("eager", **FALCON_7B_LIKE))
    assert all(m.num_kv_heads == 1 for m in eager.modules() if hasattr(m, "_split_heads"))


@pytest.mark.skipif(is_flash_attn_2_available(), reason="flash-attn is installed here")
def test_flash_attention_2_without_the_package_is_refused_before_launch():
    with pytest.raises(ConfigError, match=r"model.attn_implementation=flash_attention_2 needs the 'flash-attn'"):
        compose("tiny_llama", ["model.attn_implementation=flash_attention_2", "data.train.0.path=unused"])


def test_unknown_attn_implementation_names_the_choices():
    with pytest.raises(ConfigError, match="Valid: sdpa, eager, flash_attention_2"):
        compose("tiny_llama", ["model.attn_implementation=flash"])


def test_flash_attention_2_with_packing_needs_micro_batch_1(monkeypatch):
    monkeypatch.setattr(models, "check_available", lambda impl: None)  # as if flash-attn were installed
    with pytest.raises(ConfigError, match=r"data.packing=true needs train.micro_batch_size=1 \(got 4\)"):
        compose("tiny_llama", ["model.attn_implementation=flash_attention_2", "data.train.0.path=unused"])
    compose("tiny_llama", ["model.attn_implementation=flash_attention_2", "data.train.0.path=unused",
                           "train.micro_batch_size=1"])
