"""Throughput arithmetic: FLOPs per token, TFLOP/s per device, MFU, memory.

FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B). A matrix multiply of a token's activation (1 x m) by a
weight (m x n) costs 2mn FLOPs, so the forward pass through all weight matrices costs 2N per token, N being the
parameters that take part in matrix multiplies: every parameter except the input embedding (a table lookup; with
tied embeddings the shared matrix still counts once, as the output projection). The backward pass costs twice the
forward (gradients w.r.t. activations and w.r.t. weights), hence 6N. Attention adds, per layer and token, the scores
q.k over T positions and the weighted sum over T values: 2 * 2 * T * d_attn forward (d_attn = heads * head_dim), or
12 * T * d_attn forward+backward. Total::

    flops_per_token = 6 * N + 12 * n_layers * d_attn * T

Like PaLM, this counts the full T x T score matrix (no discount for the causal mask) and ignores norms, softmax and
activations. Activation recomputation is not counted (MFU counts model FLOPs, not hardware FLOPs).

MFU = achieved model FLOP/s per device / the device's peak dense FLOP/s for the training dtype.
"""

from __future__ import annotations

from typing import Any, Optional

import psutil
import torch

# Peak dense (non-sparse) TFLOP/s per device from the vendors' data sheets, by dtype of the matrix multiplies.
# fp32 training on Ampere and newer runs its matmuls in TF32 on tensor cores when allowed; we quote plain FP32.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp32": 67.0},
    "H100 SXM": {"bf16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "A10G": {"bf16": 125.0, "fp32": 31.2},
    "L40S": {"bf16": 362.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp32": 30.3},
    "V100": {"bf16": 125.0, "fp32": 15.7},  # V100 has no bf16: this is its fp16 tensor-core peak
}


def matmul_params(model: torch.nn.Module) -> int:
    """N above: parameters in matrix multiplies (all but the input embedding, counted once when tied)."""
    hf: Any = model  # a transformers model: nn.Module declares no get_*_embeddings
    embedding = hf.get_input_embeddings().weight
    output = hf.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p is embedding and not tied:
            continue
        total += getattr(p, "ds_numel", p.numel())  # ZeRO-3 partitions parameters; ds_numel is the full size
    return total


def flops_per_token(n_matmul_params: int, n_layers: int, d_attn: int, seq_len: int) -> float:
    return 6.0 * n_matmul_params + 12.0 * n_layers * d_attn * seq_len


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def peak_tflops(precision: str, override: float = 0.0) -> Optional[float]:
    """Peak for MFU: the cluster profile's value if set, else the table, else None (no MFU reported)."""
    if override > 0:
        return override
    name = device_name()
    for key, peaks in PEAK_TFLOPS.items():  # more specific names first in the table
        if key in name:
            return peaks[precision]
    return None


def memory_gib() -> dict[str, float]:
    """Accelerator peak allocation (reset by the caller each interval) and host resident memory."""
    out = {"mem/host_rss_gib": psutil.Process().memory_info().rss / 2**30}
    if torch.cuda.is_available():
        out["mem/device_max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["mem/device_reserved_gib"] = torch.cuda.memory_reserved() / 2**30
        torch.cuda.reset_peak_memory_stats()
    return out
