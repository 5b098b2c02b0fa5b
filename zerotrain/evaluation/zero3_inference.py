"""A Hugging Face export partitioned over the ranks with DeepSpeed ZeRO-3, for evaluating models no device holds.

A 70B model in bf16 is 140 GB: no 80 GB GPU holds it, so ``evaluation/mmlu.py --zero3`` loads it the way training
holds it. Under a ``HfDeepSpeedConfig`` of stage 3, ``from_pretrained`` builds the model inside ``deepspeed.zero.Init``
(each rank allocates only its 1/N of every parameter) and rank 0 alone reads the weight files, scattering them into
the partitions (transformers' ``_load_state_dict_into_zero3_model``): host memory stays at one copy per node.
``deepspeed.initialize`` with no optimizer then gives the inference-only ZeRO-3 engine (``DeepSpeedZeRoOffload``),
whose hooks gather each layer's parameters for its forward and release them after. (``deepspeed.init_inference`` is
tensor parallelism, not ZeRO.)

Every rank must then run the same number of forward passes (each one is a collective): the evaluator's
data-parallel scoring pads the shorter shares with dummy batches for exactly this (:mod:`~zerotrain.evaluation.
loglikelihood`). hpZ is left off: without a backward there is nothing for a secondary copy to save.

Per GPU for Llama-2-70B on 8 GPUs: 17.2 GB of bf16 partitions, plus at most one gathered layer (1.7 GB) bounded by
``stage3_max_live_parameters``, plus one batch's activations and logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# One gathered decoder layer of a 70B model is 0.86 B parameters: keep at most about that many alive.
MAX_LIVE_PARAMETERS = 1_000_000_000


def inference_config(dtype: torch.dtype) -> dict[str, Any]:
    """The DeepSpeed config of an optimizer-less ZeRO-3 engine holding weights of ``dtype``."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10**9,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": MAX_LIVE_PARAMETERS,
                              "stage3_param_persistence_threshold": 0},
    }


def export_dtype(export: Path) -> torch.dtype:
    """The dtype an export's config.json declares (``--dtype auto``), fp32 when it declares none."""
    from transformers import AutoConfig

    declared = getattr(AutoConfig.from_pretrained(export), "dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) else torch.float32


class Zero3Model:
    """The partitioned model of one export, on every rank (collective); ``model`` is what ``evaluate`` takes.

    Keep this object alive while the model is used: transformers reads the ZeRO-3 config from the
    ``HfDeepSpeedConfig`` held here."""

    def __init__(self, export: Path, dtype: torch.dtype):
        import deepspeed
        from transformers import AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        from zerotrain import ds_patches

        ds_patches.defer_import_time_compile()

        self.config = inference_config(dtype)
        self._hf_ds_config = HfDeepSpeedConfig(self.config)  # read by from_pretrained: build under zero.Init
        model = AutoModelForCausalLM.from_pretrained(export, dtype=dtype)
        if not hasattr(next(model.parameters()), "ds_id"):
            raise RuntimeError("from_pretrained did not partition the model (is the HfDeepSpeedConfig alive?)")
        self.engine, *_ = deepspeed.initialize(model=model, config=self.config)
        self.model = self.engine.module.eval()

    @property
    def local_fraction(self) -> float:
        """The share of the parameters' elements this rank holds (1/ranks, up to padding)."""
        params = list(self.model.parameters())
        return sum(p.ds_tensor.numel() for p in params) / sum(p.ds_numel for p in params)
