"""Worker: each hpZ defect, reproduced with its fix disabled and passing with it enabled.

Run under torchrun (4 ranks, CPU accelerator, gloo). Usage:
    worker_defects.py OUT.json [case ...]
Cases run in the order given, in one process (engine builds are cheap; the launch is not).
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import _common as C
import torch

C.init_dist()
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402

from zerotrain import hpz  # noqa: E402

results = {}


def opt_for(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def hpz_sizes(engine):
    sizes = {p.ds_secondary_tensor_group_size for p in engine.module.parameters()}
    groups = {p.ds_zero_param_process_group is not None for p in engine.module.parameters()}
    return {"group_size": sorted(sizes), "has_hpz_group": sorted(groups)}


def guarded(fn):
    try:
        return {"ok": True, **fn()}
    except Exception as ex:  # recorded and compared by the test
        return {"ok": False, "error": f"{type(ex).__name__}: {ex}"[:600],
                "where": traceback.format_exc()[-1500:]}


# ------------------------------------------------------------------ eval-only engine
def eval_engine_case(fixed: bool):
    """Evaluation-only engine (no optimizer) with hpZ. DeepSpeed calls the missing method only when no
    hpZ group of the configured size exists yet, so this uses size 4, which no earlier stage creates
    (the parity stages use 2); the unfixed run must come first in the process."""
    hpz.install(disable_fixes=() if fixed else ("eval_engine", ))

    def run():
        model = C.build_plain_model("llama")  # not under zero.Init: the engine must make the hpZ group
        engine, *_ = deepspeed.initialize(model=model, config=C.ds_config(hpz=4, gas=1))
        engine.eval()
        hpz.reset_counters()
        losses = []
        with torch.no_grad():
            for x in C.batches(3, seed=5):
                losses.append(engine(input_ids=x, labels=x).loss.item())
        return {"losses": losses, "counters": hpz.counters(), **hpz_sizes(engine)}

    return guarded(run)


# ------------------------------------------------------------------ per-engine groups
def groups_case(fixed: bool):
    hpz.install(disable_fixes=() if fixed else ("groups", ))
    out = {}

    def engine_with(hpz_size, zero_init):
        cfg = C.ds_config(hpz=hpz_size, gas=1)
        model = C.build_zero3_model("llama", cfg) if zero_init else C.build_plain_model("llama")
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt_for(model), config=cfg)
        if fixed:  # and it trains with the group it got
            C.train(engine, 1, gas=1)
        return hpz_sizes(engine)

    out["first_hpz2_zero_init"] = guarded(lambda: engine_with(2, True))
    out["second_hpz1_plain"] = guarded(lambda: engine_with(1, False))
    out["third_hpz4_plain"] = guarded(lambda: engine_with(4, False))
    out["fourth_hpz4_zero_init"] = guarded(lambda: engine_with(4, True))
    return out


# ------------------------------------------------------------------ stale shards
def stale_case(fixed: bool):
    """Resume with frozen parameters: load_checkpoint restores the frozen primaries in place
    (DeepSpeed copies the saved fragments into ds_tensor) but only drops the shards of
    trainable parameters, so the frozen shards built from the new engine's init survive."""
    hpz.install(disable_fixes=() if fixed else ("stale", ))
    # One directory shared by all ranks (same machine): the launcher's, or one per launch.
    base = os.environ.get("HPZ_TMP") or os.path.join("/tmp", f"hpz_worker_{os.environ.get('MASTER_PORT', '0')}")
    ckpt = os.path.join(base, f"ckpt_{int(fixed)}")

    def engine_with(seed):
        cfg = C.ds_config()
        model = C.build_zero3_model("llama", cfg, seed=seed)
        model.model.embed_tokens.weight.requires_grad_(False)  # frozen
        model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt_for(model), config=cfg)
        return engine

    def run():
        a = engine_with(seed=0)
        C.train(a, 1, seed=11)
        a.save_checkpoint(ckpt, tag="t")
        reference = C.train(a, 2, seed=12)["train"]
        b = engine_with(seed=1)  # a fresh process would start from a different init
        C.train(b, 1, seed=13)  # shards of b's frozen weights now exist
        b.load_checkpoint(ckpt, tag="t")
        stale_after_load = C.stale_shards(b.module)
        resumed = C.train(b, 2, seed=12)["train"]
        return {"stale_after_load": stale_after_load, "reference": reference, "resumed": resumed}

    return guarded(run)


def resize_case(fixed: bool):
    """resize_token_embeddings before and after deepspeed.initialize; then train."""
    hpz.install(disable_fixes=() if fixed else ("stale", ))
    hpz.reset_counters()

    def run():
        from transformers.integrations import HfDeepSpeedConfig
        cfg = C.ds_config()
        model = C.build_zero3_model("llama", cfg)
        # Resizing goes through transformers' ZeRO-3 path only while a HfDeepSpeedConfig is alive.
        keep = HfDeepSpeedConfig(cfg)  # noqa: F841
        model.resize_token_embeddings(288)
        before_init = C.stale_shards(model)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt_for(model), config=cfg)
        C.train(engine, 1)
        engine.eval()
        with torch.no_grad():
            x = C.batches(1, seed=3)[0]
            engine(input_ids=x, labels=x)
        engine.train()
        engine.module.resize_token_embeddings(320)
        after_init = C.stale_shards(engine.module)
        return {"stale_before_init": before_init, "stale_after_init": after_init,
                "invalidated": hpz.counters()["shards_invalidated"]}

    return guarded(run)


# ------------------------------------------------------------------ verify
_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter", "reduce_scatter_tensor",
                "broadcast", "all_gather_object", "barrier", "_all_gather_base", "_reduce_scatter_base",
                "all_to_all_single", "reduce", "gather", "scatter")


class CollectiveCounter:
    """Counts collective calls at DeepSpeed's comm backend (``deepspeed.comm.comm.cdb``).

    Everything DeepSpeed (and zerotrain.hpz.verify) communicates goes through
    that object; torch.distributed's module functions are bound into it at
    start-up, so counting there would miss DeepSpeed's own all-gathers.
    """

    def __enter__(self):
        import deepspeed.comm.comm as ds_comm
        self.count, self._cdb, self._names = 0, ds_comm.cdb, []
        for name in _COLLECTIVES + ("all_gather_coalesced", "all_reduce_coalesced", "inference_all_reduce",
                                    "all_to_all", "reduce_scatter_fn", "allgather_fn"):
            fn = getattr(self._cdb, name, None)
            if not callable(fn):
                continue
            self._names.append(name)

            def wrapped(*a, __fn=fn, **k):
                self.count += 1
                return __fn(*a, **k)

            setattr(self._cdb, name, wrapped)  # instance attribute shadows the method
        return self

    def __exit__(self, *exc):
        for name in self._names:
            delattr(self._cdb, name)


def verify_case():
    out = {}
    hpz.install()
    engines = []
    for _ in range(3):
        cfg = C.ds_config()
        model = C.build_zero3_model("llama", cfg)
        engines.append(deepspeed.initialize(model=model, optimizer=opt_for(model), config=cfg)[0])
    for label, engine, setup in (("uninstalled", engines[0], lambda: hpz.uninstall()),
                                 ("verify_off", engines[1], lambda: hpz.install(verify=False)),
                                 ("verify_on", engines[2], lambda: hpz.install(verify=True))):
        setup()
        hpz.reset_counters()
        with CollectiveCounter() as cc:
            losses = C.train(engine, 2)["train"]
        out[label] = {"collectives": cc.count, "losses": losses, "counters": hpz.counters()}

    # Deliberate corruption of one shard on rank 1, between forward (which built it) and backward.
    hpz.install(verify=True)
    cfg = C.ds_config()
    model = C.build_zero3_model("llama", cfg)
    engine = deepspeed.initialize(model=model, optimizer=opt_for(model), config=cfg)[0]
    target = "model.layers.1.mlp.up_proj.weight"
    param = dict(engine.module.named_parameters())[target]

    def corrupt(step, micro):
        if step == 1 and micro == 0:
            assert param.ds_secondary_tensor is not None, "shard should exist after forward"
            if dist.get_rank() == 1:
                param.ds_secondary_tensor.add_(1.0)

    try:
        C.train(engine, 2, before_backward=corrupt)
        out["corrupted"] = {"raised": False}
    except Exception as ex:
        out["corrupted"] = {"raised": True, "type": type(ex).__name__, "message": str(ex),
                            "ds_id": param.ds_id, "name": target}
    return out


CASES = {
    "eval_engine_unfixed": lambda: eval_engine_case(False),
    "eval_engine_fixed": lambda: eval_engine_case(True),
    "groups_unfixed": lambda: groups_case(False),
    "groups_fixed": lambda: groups_case(True),
    "stale_unfixed": lambda: stale_case(False),
    "stale_fixed": lambda: stale_case(True),
    "resize_unfixed": lambda: resize_case(False),
    "resize_fixed": lambda: resize_case(True),
    "verify": verify_case,  # last: leaves an engine broken on purpose
}

if __name__ == "__main__":
    out_path, names = sys.argv[1], sys.argv[2:] or list(CASES)
    for name in names:
        t0 = time.time()
        try:
            results[name] = CASES[name]()
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()[-2000:]}
        results[name + "_seconds"] = round(time.time() - t0, 2)
        dist.barrier()
        C.write_json(out_path, {"results": results, "all_ranks_done": False})
    C.write_json(out_path, {"results": results, "all_ranks_done": True})
