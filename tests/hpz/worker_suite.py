"""Worker: every multi-process hpZ check in ONE torchrun launch.

A launch costs ~40 s on the 2-core test machine (4 processes importing torch,
transformers and DeepSpeed, then DeepSpeed's first engine build importing
torch inductor), so the parity matrix, the defect cases and the Hugging Face
Trainer run share one. Each stage records its own result or error; the
pytest tests in this folder read their section of OUT.json.

Usage: worker_suite.py OUT.json   (env HPZ_QUICK=1: a reduced parity matrix instead of all 16 configurations)
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import _common as C
import torch
import worker_defects  # initialises the process group
import worker_parity
import worker_trainer

# Parity's optimizer steps (test_hpz_parity.STEPS). On the CPU accelerator a wrong shard changes the loss of the
# first micro-batch that reads it, bitwise; every step repeats one cycle (shards dropped by the step, rebuilt by the
# next forward, read again in backward), so 6 hold each case: step 1 on zero.Init's shards, steps 2-3 on rebuilt
# ones, the evaluation pass, steps 4-6 after it.
STEPS = 6


def parity_specs() -> list:
    full = os.environ.get("HPZ_QUICK") != "1"  # the full matrix adds ~2 minutes on 2 cores
    specs = [f"llama:fp32:{m}" for m in ("plain", "stock", "sync", "ordered")]
    specs.append("llama:fp32:ordered:prefetch")  # shards also read by real prefetches
    if full:
        specs += [f"{k}:{d}:{m}" for k in ("llama", "falcon") for d in ("fp32", "bf16")
                  for m in ("plain", "stock", "sync", "ordered") if (k, d) != ("llama", "fp32")]
    else:  # reduced: Falcon (with a frozen parameter) in bf16, plain vs ours
        specs += ["falcon:bf16:plain", "falcon:bf16:ordered"]
    return specs


def main(out_path: str) -> None:
    results: dict = {"parity": {}, "defects": {}, "trainer": None, "seconds": {}}

    def stage(name, fn):
        C.freeze_survivors()  # each engine build's gc.collect() then walks this stage's objects only
        t0 = time.time()
        try:
            value = fn()
        except Exception:
            value = {"ok": False, "error": traceback.format_exc()[-3000:]}
        results["seconds"][name] = round(time.time() - t0, 2)
        torch.distributed.barrier()
        return value

    # The evaluation-engine defect only shows while no hpZ group of its size exists: run it first.
    for name in ("eval_engine_unfixed", "eval_engine_fixed"):
        results["defects"][name] = stage(name, worker_defects.CASES[name])
    for spec in parity_specs():
        kind, dtype, mode, *flags = spec.split(":")
        results["parity"][spec] = stage(
            spec, lambda: worker_parity.run(kind, dtype, mode, STEPS, prefetch="prefetch" in flags))
        C.write_json(out_path, results)
    for name, case in worker_defects.CASES.items():
        if name == "verify" or name in results["defects"]:
            continue
        results["defects"][name] = stage(name, case)
        C.write_json(out_path, results)
    results["trainer"] = stage("trainer", lambda: worker_trainer.main(""))
    C.write_json(out_path, results)
    # Last: deliberately corrupts a shard and leaves that engine mid-backward.
    results["defects"]["verify"] = stage("verify", worker_defects.CASES["verify"])
    results["complete"] = True
    C.write_json(out_path, results)


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (~20 s here: gloo, DeepSpeed and HF atexit work in 4
    # processes on 2 cores); results are already on disk.
    os._exit(0)
