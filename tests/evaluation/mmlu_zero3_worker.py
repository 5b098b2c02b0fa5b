"""torchrun worker: MMLU evaluation of the tiny Llama under DeepSpeed ZeRO-3 + hpZ.

    torchrun --standalone --nproc_per_node 4 mmlu_zero3_worker.py EXPORT_DIR OUT_DIR

Builds the model the way the trainer does (HfDeepSpeedConfig kept alive,
``LlamaForCausalLM._from_config``, which applies ``deepspeed.zero.Init``), loads
the export's weights into the partitioned parameters, wraps it in a DeepSpeed
engine and evaluates with ``engine.module`` in train mode. Each rank writes
``rank<r>.json`` with the full result and the mode/RNG checks; the test compares
them with a single-process run of the plain model.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from mmlu_testlib import MAX_POSITIONS, MMLU_JSONL, ZERO3_CASES
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
from transformers.integrations import HfDeepSpeedConfig

from zerotrain import ds_patches
from zerotrain.evaluation import evaluate, load_mmlu

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {
        "stage": 3,
        "zero_hpz_partition_size": 2,
        "stage3_prefetch_bucket_size": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_param_persistence_threshold": 0,
    },
}


def build_engine(export: Path):
    hf_ds_config = HfDeepSpeedConfig(DS_CONFIG)  # must stay alive while the model is built
    model = LlamaForCausalLM._from_config(AutoConfig.from_pretrained(export))
    assert hasattr(next(model.parameters()), "ds_id"), "model was not built under zero.Init"
    state = load_file(str(export / "model.safetensors"))
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if dist.get_rank() == 0:
            model.load_state_dict(state, strict=True)
    # An optimizer as in training. It also sidesteps a known DeepSpeed bug (an engine
    # without optimizer + hpZ can crash in _set_zero_group_parallelism, being fixed
    # elsewhere); lr=0 and no step() leave the weights untouched anyway.
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # a ZeRO-tested optimizer
    ds_patches.defer_import_time_compile()  # as the trainer's engine build does (2 CPU s a process)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=DS_CONFIG)
    return engine, hf_ds_config


def main() -> None:
    export, out = Path(sys.argv[1]), Path(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    engine, _keep_alive = build_engine(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    engine.train()

    report = {"rank": dist.get_rank(), "world": dist.get_world_size(), "cases": {}}
    for name, case in ZERO3_CASES.items():
        data = load_mmlu(MMLU_JSONL, subjects=case["subjects"], shots=case["shots"],
                         limit_per_subject=case["limit"])
        random.seed(7), torch.manual_seed(7)
        expected_draws = (random.random(), torch.rand(3).tolist())
        random.seed(7), torch.manual_seed(7)
        result = evaluate(engine.module, tokenizer, data, batch_size=case["batch_size"],
                          max_length=MAX_POSITIONS, device=torch.device("cpu"))
        report["cases"][name] = {
            "result": result.to_dict(),
            "rng_restored": (random.random(), torch.rand(3).tolist()) == expected_draws,
            "train_mode_restored": engine.training and engine.module.training
            and all(m.training for m in engine.module.modules()),
        }
    # hpZ keeps a secondary partition of every parameter, filled by the forward passes.
    params = list(engine.module.parameters())
    report["hpz_secondary_partitions"] = sum(p.ds_secondary_tensor is not None for p in params)
    report["parameters"] = len(params)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()


if __name__ == "__main__":
    main()
