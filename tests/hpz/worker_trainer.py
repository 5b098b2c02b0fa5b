"""Worker: a Hugging Face Trainer fine-tunes the tiny Llama with ZeRO-3 + hpZ 2, zerotrain.hpz installed.

This is the "other script" use of the module: no zerotrain trainer, only
``hpz.install()`` before the model and the Trainer are created. Run under
torchrun (4 ranks, CPU accelerator). Usage: worker_trainer.py OUT.json
"""

from __future__ import annotations

import json
import math
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from zerotrain import hpz

MAX_STEPS = 4


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, 256, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


ds_config = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {
        "stage": 3,
        "zero_hpz_partition_size": 2,
        "stage3_prefetch_bucket_size": 0,  # tiny model: make hpZ shards actually get read
        "stage3_max_reuse_distance": 0,
        "stage3_param_persistence_threshold": 0,
    },
    "bf16": {"enabled": False},
    "steps_per_print": 10**9,
}


def main(out_path: str) -> dict:
    hpz.install(mode="ordered")  # before TrainingArguments (which sets up zero.Init) and the model
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hpz_trainer_"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=MAX_STEPS,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        deepspeed=ds_config,
        ddp_backend="gloo",  # CPU: without it every rank believes it is alone
        dataloader_num_workers=0,
        seed=0,
    )
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM._from_config(config)  # built under zero.Init by the HF DeepSpeed integration
    hpz.reset_counters()
    trainer = Trainer(model=model, args=args, train_dataset=TokenData())
    trainer.train()

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result = {
        "world_size": torch.distributed.get_world_size(),
        "active_mode": hpz.active_mode(),
        "counters": hpz.counters(),
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
        "global_step": trainer.state.global_step,
        "hpz_group_size": sorted({p.ds_secondary_tensor_group_size for p in trainer.model_wrapped.module.parameters()}),
    }
    if out_path and torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1])
