"""The option matrix's runs (issue 17): each DeepSpeed/zerotrain option with hpZ under the emulator.

Run inside worker_emulator.py's launch (4 ranks = 2 emulated nodes x 2, hpZ 2, gloo, the emulated asynchronous
accelerator), sharing its process start and DeepSpeed's first engine build. A spec is ``matrix:OPTION:KIND:ARM``:

* ARM ``plain`` is ZeRO-3 without hpZ *with the same option* (the reference), ``stock`` DeepSpeed's racy ordering,
  ``ordered`` ours; ``sync`` (the host waits after each copy) is the reference where plain ZeRO-3 cannot take the
  option (``grad_reduce_hierarchical`` needs an hpZ group);
* OPTION is one row of :data:`OPTIONS`; each run trains STEPS optimizer steps of the option's micro-batches with an
  evaluation pass half-way (the validation path: ``eval()`` + ``no_grad``), same seed and data in every arm.

What a row's run records is worker_emulator.py's record (losses of every rank, skipped steps, hpZ counters, the
emulator's report) plus the option's own evidence (``evidence``), e.g. that clipping really clipped.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path

import _common as C
import deepspeed
import torch

from zerotrain import hpz, models
from zerotrain.hpz import async_emulator as emu

STEPS = 4
KINDS = ("llama", "falcon")
ARMS = ("plain", "stock", "ordered")
# option -> what it changes (read by the table script through the JSON: keep the sentences short).
OPTIONS = {
    "offload_optimizer": "zero.offload_optimizer.device=cpu (optimizer states and step on the host)",
    "fp16_dynamic": "fp16 with dynamic loss scaling (DeepSpeed's fp16 block, loss_scale 0)",
    "allgather_sequential": "zero.stage3_allgather_sequential=true (DeepSpeed's _all_gather_sequential)",
    "activation_checkpointing": "activation checkpointing (non-reentrant; the recompute re-gathers in backward)",
    "frozen_embeddings": "frozen parameters: the input embeddings requires_grad=False",
    "clip_grad_accum": "gradient accumulation 3 with gradient_clipping 0.05 (every step clipped)",
    "pretrained_load": "weights loaded after the partitioning (from_pretrained under zero.Init)",
    "resume": "resume: save_checkpoint after 2 steps, a fresh engine load_checkpoint, 2 more steps",
    "mmlu_hook": "validation and the MMLU hook (zerotrain.evaluation.evaluate between steps)",
    "grad_reduce_hierarchical": "hpz.grad_reduce=hierarchical",
    "layer_fetch": "train.param_fetch=layer (a decoder layer per coalesced all-gather; other rows: per module)",
}
# The rows that record how many hpZ shards an all-gather read: layer fetch, and a per-module row as its control.
FETCH_EVIDENCE = ("layer_fetch", "offload_optimizer")
# Refused rows (zerotrain.hpz.options): name -> (zero_optimization extras, top-level extras); benchmarks/hpz_matrix.py
# writes each refusal's message into the table (refusals()), tests/hpz/test_hpz_options.py checks them.
REFUSED = {
    "offload_param": ({"offload_param": {"device": "cpu"}}, {}),
    "super_offload": ({"offload_optimizer": {"device": "cpu", "super_offload": True}}, {}),
    "zenflow": ({"zenflow": {"topk_ratio": 0.1}}, {}),
    "mics": ({"mics_shard_size": 2}, {}),
    "deepcompile": ({}, {"compile": {"deepcompile": True}}),
    "autoep": ({}, {"expert_parallel": {"enabled": True}}),
    "quantized_nontrainable": ({"zero_quantized_nontrainable_weights": True}, {}),
    "qwz_cpu": ({"zero_quantized_weights": True}, {}),
    "qgz_cpu": ({"zero_quantized_gradients": True}, {}),
}
REFERENCE_ARM = {"grad_reduce_hierarchical": "sync"}  # plain ZeRO-3 refuses it (no hpZ group)
TMP = Path(os.environ.get("HPZ_TMP", "/tmp")) / "hpz_matrix"


def specs(full: bool | None = None) -> list:
    """Every run; by default Falcon's ``stock`` arms are left out (the suite's time budget: Llama's show every
    option's race, Falcon's fp32/bf16 runs its own). ``HPZ_MATRIX_FULL=1`` (or ``full``): those too."""
    full = os.environ.get("HPZ_MATRIX_FULL") == "1" if full is None else full
    out = []
    for option in OPTIONS:
        for kind in KINDS:
            arms = (REFERENCE_ARM.get(option, "plain"), "stock", "ordered")
            out += [f"matrix:{option}:{kind}:{arm}" for arm in arms if full or arm != "stock" or kind == "llama"]
    return out


def _fp16_capable(accelerator):
    """DeepSpeed's CPU accelerator says fp16 is unsupported unless oneDNN has fp16 kernels; torch's CPU kernels
    compute fp16 anyway (slowly), which is all these tiny runs need."""
    original = type(accelerator).is_fp16_supported

    @contextlib.contextmanager
    def ctx():
        type(accelerator).is_fp16_supported = lambda self: True
        try:
            yield
        finally:
            type(accelerator).is_fp16_supported = original

    return ctx()


def _config(option: str, arm: str) -> dict:
    hpz_size = 1 if arm == "plain" else 2
    zero_extra: dict = {}
    if option == "offload_optimizer":
        zero_extra["offload_optimizer"] = {"device": "cpu"}
    if option == "allgather_sequential":
        zero_extra["stage3_allgather_sequential"] = True
    cfg = C.ds_config(hpz=hpz_size, gas=3 if option == "clip_grad_accum" else 2, **zero_extra)
    if option == "offload_optimizer":
        cfg["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW on the host states: no CPUAdam JIT build
    if option == "fp16_dynamic":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 2,
                       "hysteresis": 1, "min_loss_scale": 1}
    if option == "clip_grad_accum":
        cfg["gradient_clipping"] = 0.05
    return cfg


def _embedding(model, kind):
    return model.model.embed_tokens if kind == "llama" else model.transformer.word_embeddings


def _build(option: str, kind: str, arm: str, seed: int = 0):
    cfg = _config(option, arm)
    dtype = torch.float16 if option == "fp16_dynamic" else torch.float32
    if option == "pretrained_load":
        from transformers.integrations import HfDeepSpeedConfig
        path = TMP / f"pretrained_{kind}"
        if C.rank() == 0 and not (path / "config.json").is_file():
            C.build_plain_model(kind, seed=5).save_pretrained(path)
        torch.distributed.barrier()
        keep = HfDeepSpeedConfig(cfg)
        model = C.model_class(kind).from_pretrained(path)
        del keep
    else:
        model = C.build_zero3_model(kind, cfg, seed=seed, dtype=dtype)
    if kind == "falcon":  # as in worker_emulator.py: a frozen parameter, whose shard DeepSpeed never invalidates
        model.transformer.h[0].mlp.dense_h_to_4h.weight.requires_grad_(False)
    if option == "frozen_embeddings":
        _embedding(model, kind).weight.requires_grad_(False)
    if option == "activation_checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if option == "layer_fetch":  # what the trainer does by default, before the engine registers its hooks
        models.set_fetch_unit(model, models.ParamFetch.layer)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    return engine, cfg


def _matches_file(engine, kind) -> bool:
    """Before training: the gathered embedding is the saved model's (the load really replaced the init)."""
    from safetensors.torch import load_file
    saved = load_file(str(TMP / f"pretrained_{kind}" / "model.safetensors"))
    weight = _embedding(engine.module, kind).weight
    name = next(n for n, p in engine.module.named_parameters() if p is weight)
    with deepspeed.zero.GatheredParameters([weight]):
        return torch.equal(weight.data, saved[name])


def _mmlu(engine) -> dict:
    """zerotrain's MMLU evaluation (what the trainer's hook runs) on a few questions, char-level tokenizer."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evaluation"))
    import mmlu_testlib

    from zerotrain.evaluation import evaluate, load_mmlu
    tokenizer = mmlu_testlib.train_tokenizer(char_level=True)
    assert len(tokenizer) <= 256, len(tokenizer)  # fits the tiny models' vocabulary
    data = load_mmlu(mmlu_testlib.MMLU_JSONL, subjects=["sociology"], shots=0, limit_per_subject=2)
    result = evaluate(engine.module, tokenizer, data, batch_size=2, max_length=512, device=torch.device("cpu"))
    return {"loglikelihoods": [q["loglikelihoods"] for q in result.to_dict()["questions"]]}


def _train(option: str, kind: str, arm: str) -> tuple:
    gas = 3 if option == "clip_grad_accum" else 2
    engine, cfg = _build(option, kind, arm)
    evidence: dict = {}
    if option == "pretrained_load":
        evidence["loaded_weights_match_file"] = _matches_file(engine, kind)
    emu.reset()
    hpz.reset_counters()
    if option == "resume":
        first = C.train(engine, STEPS // 2, gas=gas, eval_at=1)
        ckpt = TMP / f"resume_{kind}_{arm}"
        engine.save_checkpoint(str(ckpt), tag="t")
        del engine
        engine, _ = _build(option, kind, arm, seed=99)  # other weights: the load must replace them
        engine.load_checkpoint(str(ckpt), tag="t")
        second = C.train(engine, STEPS // 2, gas=gas, eval_at=1, seed=4321)
        losses = {"train": first["train"] + second["train"], "eval": first["eval"] + second["eval"]}
        evidence["global_steps_after_load"] = engine.global_steps
    elif option == "mmlu_hook":
        first = C.train(engine, STEPS // 2, gas=gas, eval_at=1)
        evidence["mmlu"] = _mmlu(engine)
        second = C.train(engine, STEPS // 2, gas=gas, seed=4321)
        losses = {"train": first["train"] + second["train"], "eval": first["eval"]}
    else:
        losses = C.train(engine, STEPS, gas=gas, eval_at=STEPS // 2)
    if option == "clip_grad_accum":
        evidence["grad_norm"] = float(engine.get_global_grad_norm())
        evidence["clip"] = cfg["gradient_clipping"]
    if option == "fp16_dynamic":
        evidence["loss_scale"] = float(engine.optimizer.loss_scale)
    if option == "offload_optimizer":
        evidence["offload_optimizer"] = bool(engine.optimizer.offload_optimizer)
    if option == "frozen_embeddings":
        evidence["frozen_has_secondary_shard"] = _embedding(engine.module, kind).weight.ds_secondary_tensor \
            is not None
    if option == "grad_reduce_hierarchical":
        evidence["hierarchical_grad_reduces"] = hpz.counters().get("hierarchical_grad_reduces", 0)
    if option in FETCH_EVIDENCE:
        counts = hpz.counters()
        evidence["shards_per_gather"] = counts.get("shards_read", 0) / max(1, counts.get("secondary_gathers", 0))
    return engine, losses, evidence


def run(spec: str, accelerator) -> dict:
    _, option, kind, arm = spec.split(":")
    mode = "ordered" if arm == "plain" else arm
    TMP.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the loud racy-mode warning
        hpz.install(mode=mode, grad_reduce="hierarchical" if option == "grad_reduce_hierarchical" else "flat")
    t0 = time.time()
    ctx = _fp16_capable(accelerator) if option == "fp16_dynamic" else contextlib.nullcontext()
    try:
        with ctx:
            engine, losses, evidence = _train(option, kind, arm)
            report = emu.report()
            accelerator.synchronize()  # drain what is still queued, so that the next run starts clean
    finally:
        hpz.install(mode="ordered")  # grad_reduce back to flat for the next run
    return {
        "option": option, "kind": kind, "arm": arm, "what": OPTIONS[option],
        "reference": REFERENCE_ARM.get(option, "plain"),
        "losses": C.all_gather_obj(losses),
        "skipped_steps": C.all_gather_obj(engine.skipped_steps),
        "counters": C.all_gather_obj(hpz.counters()),
        "emulator": C.all_gather_obj(report),
        "evidence": C.all_gather_obj(evidence),
        "seconds": round(time.time() - t0, 2),
    }


def refusals() -> dict:
    """Each refused row's message, from the check the trainer runs (hpZ 2 on this CPU accelerator)."""
    from zerotrain.hpz import options
    out = {}
    for name, (zero_extra, top) in REFUSED.items():
        cfg = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2, **zero_extra}, **top}
        try:
            options.check(cfg, "cpu")
            out[name] = {"refused": False}
        except options.HpzOptionError as e:
            out[name] = {"refused": True, "keys": [k for k, _ in options.refusals(cfg, "cpu")], "message": str(e),
                         "exit_code": e.exit_code}
    return out
