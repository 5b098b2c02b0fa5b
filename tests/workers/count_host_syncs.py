"""Train through the real Trainer while counting host syncs, each attributed to the code that asked for it.

Patched: ``Tensor.item/.cpu/.tolist/.numpy`` and ``bool/float/int(tensor)``, ``torch.cuda.synchronize``, the
accelerator's ``synchronize``, and ``torch.distributed.all_reduce`` (a collective, listed apart). Each call is
charged to the innermost frame inside ``zerotrain/`` or ``deepspeed/`` (else "other") and to the step it ran in
(from one step's ``on_step_begin`` to the next). Several runs share one launch (the start-up, not the 10 tiny
steps, is what costs on 2 cores): each ``+run`` group of key=value overrides is added to the common ones and
trained in turn, its counts apart (calls outside a step, the next Trainer's build included, are not charged).
Usage: torchrun ... count_host_syncs.py <out.json> key=value ... +run key=value ... [+run key=value ...]
Rank 0 writes ``{"runs": [{"steps": N, "rows": [...]}, ...]}``, one entry per ``+run``, in order.
"""

import collections
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from zerotrain.run_config import parse_args
from zerotrain.trainer import StepCallback, Trainer

OWNERS = ("zerotrain", "deepspeed")
HERE = Path(__file__).resolve()
current_step = 0
counts: dict = collections.defaultdict(int)  # (step, owner, kind, "file:line") -> calls


def _charge(kind: str) -> None:
    if current_step == 0:
        return
    where, owner = "?", "other"
    for frame in reversed(traceback.extract_stack()[:-2]):
        parts = Path(frame.filename).parts
        if Path(frame.filename).resolve() == HERE:
            continue
        hit = next((o for o in OWNERS if o in parts), None)
        if hit is not None:
            owner, index = hit, len(parts) - 1 - parts[::-1].index(hit)
            where = f"{'/'.join(parts[index:])}:{frame.lineno}"
            break
    counts[(current_step, owner, kind, where)] += 1


def _wrap(owner, name: str, kind: str) -> None:
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        _charge(kind)
        return original(*args, **kwargs)

    setattr(owner, name, counted)


class TrackStep(StepCallback):
    def on_step_begin(self, trainer, step):
        global current_step
        current_step = step


def _install_counters() -> None:
    for name in ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__"):
        _wrap(torch.Tensor, name, f"Tensor.{name}")
    _wrap(torch.cuda, "synchronize", "cuda.synchronize")
    _wrap(type(get_accelerator()), "synchronize", "accelerator.synchronize")
    _wrap(dist, "all_reduce", "all_reduce")


def main() -> int:
    global current_step
    out, groups = sys.argv[1], [[]]
    for arg in sys.argv[2:]:
        if arg == "+run":
            groups.append([])
        else:
            groups[-1].append(arg)
    common, *runs = groups
    if not runs:
        raise SystemExit("count_host_syncs.py: no +run group (usage in the module docstring)")
    results, code, is_main = [], 0, False
    for i, overrides in enumerate(runs):
        trainer = Trainer(parse_args([*common, *overrides]), callbacks=[TrackStep()])
        if i == 0:  # once: the counters are charged by step, and no step runs while a Trainer is built
            _install_counters()
        code, is_main = trainer.fit(), trainer.dist.is_main
        current_step = 0
        results.append({"steps": trainer.cfg.train.steps,
                        "rows": [{"step": s, "owner": o, "kind": k, "where": w, "calls": n}
                                 for (s, o, k, w), n in counts.items()]})
        counts.clear()
        if code:
            break
    if is_main:
        Path(out).write_text(json.dumps({"runs": results}))
    return code


if __name__ == "__main__":
    from zerotrain.launch.teardown import exit_with

    exit_with(main)  # as train.py
