"""Train through the real Trainer (as train.py does), then record the engine's logits on a fixed batch; then, in the
same launch, any further runs (as tests/workers/train_variants.py: a launch costs tens of seconds before its first
step on the 2-core test machine).

The logits let a test compare the DeepSpeed ZeRO-3 model with its Hugging Face export, token for token. A step
callback records what it was shown around every step of the probed run, for the test of the trainer's per-step hook.
Each run's overrides are one argument, space-separated; the first is the probed run.
Usage: torchrun ... tests/workers/train_and_probe.py <probe.pt> "key=value ..." ["key=value ..." ...]
"""

import sys

import torch
from train_variants import fit_each

from zerotrain.run_config import parse_args
from zerotrain.trainer import StepCallback, Trainer


class RecordSteps(StepCallback):
    def __init__(self):
        self.events: list[tuple] = []

    def on_step_begin(self, trainer, step):
        self.events.append(("begin", step, trainer.state.step))

    def on_step_end(self, trainer, step, result):
        self.events.append(("end", step, trainer.state.step, result.loss, result.lr, result.seconds > 0))


def main() -> int:
    probe_path, probed, further = sys.argv[1], sys.argv[2].split(), sys.argv[3:]
    steps = RecordSteps()
    trainer = Trainer(parse_args(probed), callbacks=[steps])
    code = trainer.fit()
    vocab = trainer.cfg.model.vocab_size
    input_ids = (torch.arange(2 * 24).reshape(2, 24) * 37 + 5) % vocab
    trainer.engine.eval()
    with torch.no_grad():  # a ZeRO-3 forward is collective: every rank runs it
        logits = trainer.engine(input_ids=input_ids.to(trainer.device)).logits.float().cpu()
    if trainer.dist.is_main:
        torch.save({"input_ids": input_ids, "logits": logits, "step_events": steps.events}, probe_path)
    del trainer  # its engine's memory, before the next run builds one
    return code or fit_each(further)


if __name__ == "__main__":
    from zerotrain.launch.teardown import exit_with

    exit_with(main)  # as train.py
