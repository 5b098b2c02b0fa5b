"""Our side of benchmarks/train_throughput.py: ``train.py``'s Trainer, timed from one step's end to the next by the
clock that times the Hugging Face Trainer in hf_trainer_baseline.py (step_clock.py). Launched under torchrun; rank 0
writes JSON.

    torchrun --nproc_per_node 4 benchmarks/zerotrain_timed.py <out.json> key=value ...   # train.py's arguments

The logged ``step_time_s`` counts each step's own work (batch, forward, backward, optimizer) and leaves out what the
loop does between steps (logging, its reduction of the losses); this clock counts everything, as on the HF side.
"""

import json
import sys
from pathlib import Path

import torch
from step_clock import StepClock

from zerotrain.run_config import parse_args
from zerotrain.trainer import StepCallback, Trainer


class StepEnds(StepCallback):
    def __init__(self) -> None:
        self.clock = StepClock()

    def on_step_end(self, trainer, step, result) -> None:
        self.clock.tick()


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    timer = StepEnds()
    trainer = Trainer(parse_args(argv), callbacks=[timer])
    code = trainer.fit()
    result = timer.clock.summary()
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps({**result, "tokens_per_s": trainer.tokens_per_step / result["step_time_s"]}))
    return code


if __name__ == "__main__":
    sys.exit(main())
