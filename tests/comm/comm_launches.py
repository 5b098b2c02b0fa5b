"""The two 2-node x 2-rank launches of ``worker_grad_reduce.py`` that tests/comm/test_grad_reduce.py and
tests/comm/test_comm_bytes.py both read (conftest.py's session fixture ``comm_launches``).

Each launch costs ~20 s before its first step on 2 cores (4 processes importing torch, transformers and DeepSpeed),
more than the 3-step trainings of the byte accounting: those (:data:`COMM_VARIANTS`, worker_comm.run_variants) run
first in the first launch, in fresh processes as in a launch of their own.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tools.launcher import launch_nodes

HERE = Path(__file__).resolve().parent

# test_comm_bytes.py's job: the real trainer on the tiny Llama reshaped so that some parameters are not multiples
# of the world size (DeepSpeed pads them): hidden 66 (norms: 66 = 4*16 + 2), 3 heads of 22, 1 K/V head, MLP 171
# (66*171 = 11286 = 4*2821 + 2); ZeRO-3, hpZ, hpZ with hierarchical gradients, COMM_STEPS steps each.
COMM_STEPS = 3
COMM_SHAPE = {"vocab": 2048, "hidden": 66, "layers": 2, "heads": 3, "kv_heads": 1, "intermediate": 171}
COMM_OVERRIDES = ["model.hidden_size=66", "model.num_heads=3", "model.num_kv_heads=1", "model.intermediate_size=171"]
HIER = "zero3_hpz_cpu+hpz.grad_reduce=hierarchical"  # the third variant: hpZ with hierarchical gradients
COMM_VARIANTS = f"zero3_cpu,zero3_hpz_cpu,{HIER}"


def comm_arguments(shakespeare: Path, out_dir: Path) -> list[str]:
    return [COMM_VARIANTS, "recipe=tiny_llama", f"run.output_dir={out_dir}", "run.name=comm",
            f"data.train.0.path={shakespeare}", f"train.steps={COMM_STEPS}", "train.log_interval=1",
            "train.eval_interval=0", "wandb.enabled=false", "checkpoint.save_final=false", "checkpoint.resume=false",
            *COMM_OVERRIDES]


def launch(shakespeare: Path, work: Path) -> dict:
    """Both launches' stages merged (``comm`` + ``main``, then ``resume``), with each launch's wall time."""
    runs = work / "runs"
    merged: dict = {"walls": {}, "seconds": {}}
    for phase, extra in (("main", comm_arguments(shakespeare, work / "comm_runs")), ("resume", [])):
        out = work / f"{phase}.json"
        t0 = time.time()
        nodes = launch_nodes(2, 2, HERE / "worker_grad_reduce.py", str(out), phase, str(shakespeare), str(runs),
                             *extra, timeout=1200, check=False)
        wall = time.time() - t0
        rcs = [n.returncode for n in nodes]
        text = "\n".join(f"--- node{i} ---\n{n.stdout}{n.stderr}" for i, n in enumerate(nodes))
        assert not any(rcs) and out.is_file(), f"{phase} launch: exit codes {rcs}\n{text[-6000:]}"
        result = json.loads(out.read_text())
        merged["seconds"].update(result.pop("seconds"))
        merged.update(result)
        merged["walls"][phase] = round(wall, 1)
    print(f"\nhierarchical gradient launches (the first one also runs the byte accounting's {COMM_VARIANTS}, "
          f"{COMM_STEPS} steps each): {merged['walls']} s wall; stages {merged['seconds']} s")
    return merged
