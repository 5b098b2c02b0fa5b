"""The baseline for benchmarks/train_throughput.py: a plain Hugging Face ``Trainer`` on the same model, data,
batch and DeepSpeed config as one of our runs. Launched under torchrun; writes steady-state tokens/s as JSON.

    torchrun --nproc_per_node 4 benchmarks/hf_trainer_baseline.py <our run dir> <steps> <out.json> [module|layer]

The last argument is ZeRO-3's fetch unit: ``module`` (default) is what the Trainer gets, DeepSpeed's per-submodule
gathering; ``layer`` makes each decoder layer the unit before the Trainer builds the engine, as a Trainer user can
with one call of ``deepspeed.utils.set_z3_leaf_modules`` (our ``train.param_fetch=layer`` makes the same call).
"""

import json
import sys
from pathlib import Path

import torch
from step_clock import StepClock
from transformers import Trainer, TrainerCallback, TrainingArguments

from zerotrain import run_config
from zerotrain.data.loader import build_loader
from zerotrain.models import MODEL_CLASSES, ParamFetch, hf_config, set_fetch_unit


class StepTimer(TrainerCallback):
    def __init__(self):
        self.clock = StepClock()

    def on_step_end(self, args, state, control, **kwargs):
        self.clock.tick()


def main() -> int:
    run_dir, steps, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    fetch = ParamFetch(sys.argv[4] if len(sys.argv) > 4 else "module")
    cfg = run_config.load(run_dir / "config.yaml")
    ds = json.loads((run_dir / "deepspeed_config.json").read_text())
    global_batch = ds["train_batch_size"]  # micro-batch x accumulation x ranks, as in our run
    world = global_batch // (ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"])
    if ds["zero_optimization"].get("zero_hpz_partition_size", 1) > 1:
        from zerotrain import hpz

        hpz.install(mode=cfg.hpz.mode)
    # Let the Trainer fill in the batch keys ("auto"): it derives them from its own arguments, set to the same values.
    ds.pop("seed", None)
    ds.pop("train_batch_size", None)
    ds["train_micro_batch_size_per_gpu"] = ds["gradient_accumulation_steps"] = "auto"
    args = TrainingArguments(
        output_dir=str(run_dir / "hf_trainer"), max_steps=steps, per_device_train_batch_size=cfg.train.micro_batch_size,
        gradient_accumulation_steps=cfg.train.grad_accum, learning_rate=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay,
        adam_beta1=cfg.optim.betas[0], adam_beta2=cfg.optim.betas[1], adam_epsilon=cfg.optim.eps,
        max_grad_norm=cfg.train.grad_clip, warmup_steps=cfg.schedule.warmup_steps, lr_scheduler_type="cosine",
        optim="adamw_torch", bf16=cfg.train.precision == "bf16", deepspeed=ds, ddp_backend="gloo", report_to=[],
        logging_steps=10**9, save_strategy="no", dataloader_num_workers=0, seed=cfg.run.seed, use_cpu=False,
        disable_tqdm=True,
    )
    # TrainingArguments(deepspeed=...) keeps an HfDeepSpeedConfig alive: the model is built under zero.Init.
    model = MODEL_CLASSES[cfg.model.family]._from_config(hf_config(cfg.model))
    set_fetch_unit(model, fetch)  # before the Trainer's deepspeed.initialize registers the hooks
    loader = build_loader([(s.path, s.weight) for s in cfg.data.train], "train", cfg.train.seq_len, 1,
                          seed=cfg.run.seed, vocab_size=cfg.model.vocab_size)
    samples = [{k: v[0] for k, v in next(loader).items()} for _ in range(steps * global_batch)]
    timer = StepTimer()
    Trainer(model=model, args=args, train_dataset=samples, callbacks=[timer]).train()
    result = timer.clock.summary()
    if torch.distributed.get_rank() == 0:
        tokens = global_batch * cfg.train.seq_len
        out.write_text(json.dumps({**result, "tokens_per_s": tokens / result["step_time_s"], "world": world}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
