"""Worker: hpZ through DeepSpeed's real ZeRO-3 engine under the emulated asynchronous accelerator, ONE launch.

Run under torchrun (4 ranks = 2 emulated nodes x 2, hpZ size 2, gloo). The emulator
(zerotrain.hpz.async_emulator) is installed before the process group, so DeepSpeed
takes its GPU stream code paths and hpZ shard copies are really deferred. Each run:
same seed and data, gradient accumulation 2, an evaluation pass half-way, STEPS
optimizer steps; it records every rank's losses, DeepSpeed's step counts, the hpZ
counters and the emulator's report (races, stream operations).

Runs (``kind:dtype:arm[:variant]``):
* arms ``plain`` (ZeRO-3 without hpZ, the reference), ``legacy``, ``stock``, ``sync``,
  ``ordered`` (zerotrain.hpz modes) and ``deepspeed`` (DeepSpeed 0.19.8's own shard
  builder and all-gather, unpatched) for Llama and Falcon in fp32 and bf16;
* negative controls on ``ordered`` -- the copy event recorded before the copy, on the
  wrong stream, and the wait for the last-released shard skipped;
* the leaf-module fast path (``stage3_module_granularity_threshold > 0``, MLPs as
  leaves): sync, ordered, and ordered with its copy-source protection removed (plain
  ZeRO-3 computes the same losses with and without the fast path);
* the option matrix (``matrix:...`` specs, worker_matrix.py): each option in plain
  ZeRO-3, ``stock`` and ``ordered``.

Usage: worker_emulator.py OUT.json [SPEC ...]   (no SPEC: every run above)
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
import warnings

from zerotrain.hpz import async_emulator as emu

ACCELERATOR = emu.install()  # first: DeepSpeed creates its streams from the accelerator it finds

import _common as C  # noqa: E402
import _emulator_controls as controls  # noqa: E402
import worker_matrix  # noqa: E402
import torch  # noqa: E402

C.init_dist()
import deepspeed  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import Init  # noqa: E402
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator  # noqa: E402

from zerotrain import hpz  # noqa: E402
from zerotrain.hpz import ordering  # noqa: E402

# The fp32/bf16 runs' optimizer steps: 4 in the suite, as the option rows (worker_matrix.STEPS), whose stock runs
# show the race reaching training in every row: it starts in step 2's backward (the first shards built in fresh
# memory), the evaluation pass before step 3. The documented table's run (HPZ_MATRIX_FULL=1, docs/hpz.md) trains 6.
STEPS = 6 if os.environ.get("HPZ_MATRIX_FULL") == "1" else 4
ARMS = ("plain", "legacy", "stock", "sync", "ordered", "deepspeed")
MODELS = tuple((k, d) for k in ("llama", "falcon") for d in ("fp32", "bf16"))
LEAF_ARMS = ("sync", "ordered", "ordered_unprotected")  # reference: llama:fp32:plain (same losses)
GATHER = "_PartitionedParameterCoordinator__all_gather_params_"


def all_specs() -> list:
    specs = [f"{k}:{d}:{arm}" for k, d in MODELS for arm in ARMS]
    specs += [f"llama:fp32:ordered:{control}" for control in controls.CONTROLS]
    specs += [f"llama:fp32:{arm}:leaf" for arm in LEAF_ARMS]
    return specs + worker_matrix.specs()


# ------------------------------------------------------------------ arms that are not an hpz mode
@contextlib.contextmanager
def deepspeed_builder_and_reader():
    """DeepSpeed's own Init._partition_param_sec and all-gather; zerotrain's group fixes stay (several engines)."""
    originals = {(owner, name): original for owner, name, original in hpz.patched_attributes()}
    swapped = [(Init, "_partition_param_sec"), (PartitionedParameterCoordinator, GATHER)]
    ours = {key: getattr(*key) for key in swapped}
    for owner, name in swapped:
        setattr(owner, name, originals[(owner, name)])
    try:
        yield
    finally:
        for (owner, name), fn in ours.items():
            setattr(owner, name, fn)


@contextlib.contextmanager
def patched(module, name, replacement):
    original = getattr(module, name)
    setattr(module, name, replacement(original))
    try:
        yield
    finally:
        setattr(module, name, original)


def arm_context(arm: str, variant: str | None):
    if arm == "deepspeed":
        return deepspeed_builder_and_reader()
    if variant in controls.CONTROLS:
        return patched(ordering, controls.target(variant), lambda original: controls.wrap(variant, original))
    if arm == "ordered_unprotected":
        return patched(ordering, "_protect_copy_source", lambda original: lambda param, stream: None)
    return contextlib.nullcontext()


# ------------------------------------------------------------------ one run
def build_engine(kind: str, dtype: str, arm: str, leaf: bool):
    bf16 = dtype == "bf16"
    extra = {"stage3_module_granularity_threshold": 1} if leaf else {}  # > 0: DeepSpeed's leaf fast path
    cfg = C.ds_config(hpz=1 if arm == "plain" else 2, bf16=bf16, **extra)
    model = C.build_zero3_model(kind, cfg, seed=0, dtype=torch.bfloat16 if bf16 else torch.float32)
    if kind == "falcon":  # a frozen parameter: its shard is never invalidated by DeepSpeed
        model.transformer.h[0].mlp.dense_h_to_4h.weight.requires_grad_(False)
    if leaf:
        from deepspeed.utils import set_z3_leaf_modules
        from transformers.models.llama.modeling_llama import LlamaMLP
        set_z3_leaf_modules(model, [LlamaMLP])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    return engine


def run(spec: str) -> dict:
    kind, dtype, arm, *rest = spec.split(":")
    variant = rest[0] if rest else None
    leaf = variant == "leaf"
    mode = {"plain": "ordered", "deepspeed": "ordered", "ordered_unprotected": "ordered"}.get(arm, arm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the loud racy-mode warning
        hpz.install(mode=mode)
    t0 = time.time()
    with arm_context(arm, variant):
        engine = build_engine(kind, dtype, arm, leaf)
        coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
        allgather = getattr(coordinator, hpz.ALLGATHER_STREAM_ATTR)
        emu.reset()
        hpz.reset_counters()
        losses = C.train(engine, STEPS, gas=2, eval_at=STEPS // 2)
        report, sample = emu.report(), [str(r) for r in emu.races()[:3]]
        ACCELERATOR.synchronize()  # drain what is still queued, so that the next run starts clean
    return {
        "losses": C.all_gather_obj(losses),
        "global_steps": engine.global_steps,
        "skipped_steps": C.all_gather_obj(engine.skipped_steps),
        "counters": C.all_gather_obj(hpz.counters()),
        "emulator": C.all_gather_obj(report),
        "race_sample": sample,
        "streams": {"allgather": getattr(allgather, "name", None),
                    "reduce": getattr(engine.optimizer.reduce_and_partition_stream, "name", None),
                    "default": ACCELERATOR.default_stream().name},
        "seconds": round(time.time() - t0, 2),
    }


def main(out_path: str, specs: list) -> None:
    results: dict = {"runs": {}, "steps": STEPS}
    t_all = time.time()
    for spec in specs:
        C.freeze_survivors()  # the engine build's gc.collect() then walks this run's objects only
        try:
            results["runs"][spec] = worker_matrix.run(spec, ACCELERATOR) if spec.startswith("matrix:") else run(spec)
        except Exception:  # noqa: BLE001 -- recorded, and the test that reads this run fails with it
            results["runs"][spec] = {"error": traceback.format_exc()[-3000:]}
        torch.distributed.barrier()
        C.write_json(out_path, results)
        if C.rank() == 0:
            r = results["runs"][spec]
            print(f"{spec}: {r.get('seconds')} s races/rank {[e['races'] for e in r.get('emulator', [])]}",
                  flush=True)
    results["seconds"] = round(time.time() - t_all, 1)
    results["complete"] = True
    C.write_json(out_path, results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or all_specs())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (~20 s of gloo/DeepSpeed atexit work); results are on disk
