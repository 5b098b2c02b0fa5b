"""Worker: the real trainer (``zerotrain.trainer.Trainer``) with communication accounting installed around it.

Usage (under torchrun, any layout): ``worker_comm.py OUT.json VARIANTS key=value ...`` (or :func:`run_variants`
inside another worker's launch: tests/comm/worker_grad_reduce.py's first launch runs it) where VARIANTS is a
comma-separated list of ``zero`` presets, each optionally followed by ``+key=value`` overrides
(``zero3_cpu,zero3_hpz_cpu,zero3_hpz_cpu+hpz.grad_reduce=hierarchical``), trained one after the other in the same
processes (one start-up for all: on 2 cores the start-up, not the steps, is what costs), and the rest is the
train.py grammar, a recipe included; ``run.name`` gets the preset appended. For each variant it installs
:mod:`zerotrain.comm_accounting` once the trainer is built (so ``zero.Init``'s initial broadcasts are not counted)
and takes a job-wide snapshot (summed over ranks) after every optimizer step. Rank 0
writes: the per-step snapshots, the layout, DeepSpeed's real hpZ group, and each parameter's numel as DeepSpeed
holds it (``ds_numel``) with its partition sizes, for the test to check its own derivation against.
"""

from __future__ import annotations

import json
import os
import sys

from zerotrain import comm_accounting
from zerotrain.launch.layout import deepspeed_hpz_group_ranks, layout_summary
from zerotrain.run_config import parse_args
from zerotrain.trainer import StepCallback, Trainer


class CountPerStep(StepCallback):
    """After every optimizer step, before anything else the loop does: its time and its job-wide byte counts."""

    def __init__(self):
        self.per_step: list[dict] = []
        self.step_times: list[float] = []

    def on_step_end(self, trainer, step, result):
        self.step_times.append(result.seconds)
        self.per_step.append(comm_accounting.snapshot_and_reset(all_ranks=True))


def run_variant(argv: list[str]) -> dict:
    counts = CountPerStep()
    trainer = Trainer(parse_args(argv), callbacks=[counts])
    comm_accounting.install(trainer.layout)
    try:
        rc = trainer.fit()
    finally:
        comm_accounting.uninstall()
    result = {
        "rc": rc,
        "layout": layout_summary(trainer.layout),
        "deepspeed_hpz_group": deepspeed_hpz_group_ranks(),
        "params": [
            {"name": n, "ds_numel": int(p.ds_numel), "partition": int(p.ds_tensor.ds_numel),
             "secondary": None if getattr(p, "ds_secondary_tensor", None) is None
             else int(p.ds_secondary_tensor.ds_numel), "element_size": p.ds_tensor.element_size()}
            for n, p in trainer.engine.module.named_parameters()
        ],
        "per_step": counts.per_step,
        "step_times": counts.step_times,
    }
    trainer.engine.destroy()
    return result


def run_variants(variants: str, argv: list[str]) -> dict:
    """Every variant of VARIANTS in turn (collective: every rank, the same arguments); its results by variant."""
    import torch.distributed as dist

    results = {}
    for variant in variants.split(","):  # a zero preset, optionally +key=value overrides: zero3_hpz_cpu+hpz.x=y
        zero, *extra = variant.split("+")
        name = next((a.split("=", 1)[1] for a in argv if a.startswith("run.name=")), "comm")
        tag = "-".join([zero, *(e.rpartition("=")[2] for e in extra)])
        args = [a for a in argv if not a.startswith("run.name=")] + [f"zero={zero}", *extra, f"run.name={name}-{tag}"]
        results[variant] = run_variant(args)
        dist.barrier()
    return results


def main(out_path: str, variants: str, argv: list[str]) -> int:
    import torch.distributed as dist

    results = run_variants(variants, argv)
    if dist.get_rank() == 0:
        with open(out_path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(out_path + ".tmp", out_path)
    return max(r["rc"] for r in results.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
