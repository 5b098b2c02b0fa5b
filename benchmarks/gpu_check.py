"""The GPU check: hpZ's race, the cost of its fixes and a Llama-2-7B training step, on one NVIDIA GPU, in one table.

    bash benchmarks/gpu_check.sh --out runs/gpu_check              # ~5 minutes on one H200, each section <= 4
    bash benchmarks/gpu_check.sh --out runs/gpu_check --quick      # < 2 minutes
    bash benchmarks/gpu_check.sh --out runs/gpu_check --dry-run    # the CPU: every section's code, tiny shapes

(``gpu_check.sh``: the checkout on PYTHONPATH, and its .venv or an offline environment over the node's own torch
from the carried wheelhouse, docs/offline_install.md.) Needs one NVIDIA GPU with bf16 (compute capability >= 8.0:
A100, H100, H200), a CUDA build of torch >= 2.11 and a driver for it. Only device 0 is used. Each section writes
``OUT/<section>.json`` and ``.md`` as soon as it ends, then the summary ``OUT/gpu_check.json``/``.md``; the
sections' output goes to ``OUT/gpu_check.log``; prints one table; exits 1 if a check fails. Without a GPU it
prints the same table with every row "no GPU: skipped" and exits 0. ``--dry-run`` runs every section on the CPU
with tiny shapes, race, record_stream and stall on the emulated asynchronous accelerator
(``zerotrain.hpz.async_emulator``), so only CUDA kernels stay untried.

Sections (each a child process with its own hard time budget; a crash or timeout marks its rows ERROR):

``race`` -- stock hpZ reads uninitialised shards; ``sync``, ``ordered`` and DeepSpeed's own builder do not.
    One Llama-2-7B-shaped layer under DeepSpeed's real ZeRO-3 machinery (``DeepSpeedZeRoOffload``: ``zero.Init``'s
    parameters, the parameter coordinator and its all-gather stream), hpZ group = a real single-rank process group.
    Per repetition: the layer is released (``coordinator.release_sub_module`` -> ``Init._partition_param_sec``, as
    patched by ``hpz.install(mode)``, or DeepSpeed's own after ``hpz.uninstall()``) while every fresh shard is
    NaN-poisoned and the compute stream is kept busy (``torch.cuda._sleep``) before the shard copy; then fetched for
    backward (``coordinator.fetch_sub_module``), which reads the shards on the all-gather stream through DeepSpeed's
    own ``_all_gather_dtype``. A world of one never reads shards there (``all_gather_coalesced`` returns early), so
    each parameter's ``all_gather_coalesced`` is wrapped to skip only that early return. Counts NaNs gathered.
``record_stream`` -- a shard freed while its gather is still queued on the all-gather stream (a prefetch whose shard
    is dropped) and its memory handed out again: only an arm that ``record_stream``-s the shard keeps the block away.
``stall`` -- host stall in the release path and step time, ``sync`` vs ``ordered`` vs DeepSpeed's own builder, on
    8 Llama-2-7B-shaped layers (forward: fetch, matmuls, release = shard build; backward: fetch from shards, matmuls).
    Host time in the fetches is shown too: DeepSpeed's fetch throttle (at most 2 gather events in flight) can make
    the host wait there when nothing waits in the release.
``train`` -- a Llama-2-7B-shaped ``LlamaForCausalLM`` under ZeRO-3 on the one GPU, bf16, activation checkpointing,
    ``torch.optim.AdamW(fused=True)``, synthetic tokens, warm-up excluded: tokens/s, TFLOP/s, MFU against the
    device's dense bf16 peak (``zerotrain.metrics``), peak memory next to the memory plan's prediction. Full size
    (32 layers) where DeepSpeed's ZeRO-3 estimator plus activations fit the device (an H200: ~127 GiB of ~140),
    else the largest layer count that fits (80 GB A100/H100: 18), stated in the table.

Estimated time on one H200 (989 TFLOP/s dense bf16; ~600 TFLOP/s assumed achieved on these GEMMs, 4.8 TB/s HBM),
full mode / --quick, each plus ~10-15 s of process start (imports, CUDA and NCCL set-up); BUDGET_S holds the hard
budgets (each <= 4 minutes; probe + race + record_stream + stall 255 s, probe + train 270 s; quick 120 s in all):

* race: sleep-kernel calibration (1 s of GEMMs, 5 timed spins) + 4 arms x 5 reps (quick 2) x 9 shards x 10 ms of
  busy kernel = 1.8 s of GPU time.
* record_stream: calibration + 4 arms x 9 shards, one 50 ms delay each: < 1 s.
* stall: 6 T P_layer L = 6 x 4096 tokens x 202.4M x 8 layers = 39.8 TFLOP per step = ~66 ms; 3 arms x 12 steps
  and the GEMMs alone = 3 s (quick: 4 layers, 2048 tokens, 4 steps); building 8 layers ~10 s.
* train: 46.1 GFLOP/token (6N + 12 L d T, N = 6.61e9 matmul parameters, T = 4096) x 8192 tokens = 3.8e14 model FLOP
  per step, x4/3 with recomputation = 5.0e14 = ~1.0 s at 500 TFLOP/s, + ~0.15 s of fused AdamW over 6.74e9 fp32
  parameters (~190 GB of HBM traffic) -> ~1.2-1.6 s per step, 13 steps ~20 s, building and ``deepspeed.initialize``
  ~60 s (quick: 4 layers, 2048 tokens, 6 steps).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:  # not at run time: the sections import zerotrain (and so DeepSpeed) only once configured
    from zerotrain.hpz.zero_param import ZeroParam, ZeroShard

REPO = Path(__file__).resolve().parent.parent

SECTIONS = ("race", "record_stream", "stall", "train")
# Hard budgets in seconds (full, quick): the section's child process is killed when it runs past its budget.
# Each at most 4 minutes, so the whole check fits two 5-minute calls (probe + race + record_stream + stall, then probe
# + train), and --quick's add up to 2 minutes. A dry run (CPU, tiny shapes) gets DRY_BUDGET_S per section. Quick's
# as measured on an H200 (2026-12-04, node env): race 16 s, record_stream 15 s (no shorter than in full: its work
# is the same, mostly process start), stall 15 s, train 21 s; the first quick budgets (20/15/25/45) killed
# record_stream at 15 s.
BUDGET_S = {"probe": (30, 20), "race": (60, 25), "record_stream": (45, 25), "stall": (120, 20), "train": (240, 30)}
DRY_BUDGET_S = 240
DRY_PROBE_BUDGET_S = 1200  # it may JIT-build DeepSpeed's CPU comm op: minutes on a loaded machine
RACY_MODES = ("stock", "legacy")  # modes that do not order the shard copy before its read: expected to race
DEEPSPEED_ARM = "deepspeed"  # DeepSpeed 0.19.8's own builder and coordinator (zerotrain.hpz uninstalled)
GIB = 2**30
MIN_TORCH = (2, 11)  # the oldest torch GPU nodes carry; tools/torch_api_check.py checked our torch API against it
STARTED = time.monotonic()  # a section's budget counts from its process's start

# Llama-2-7B (Touvron et al. 2023); TINY only exercises the same code on the CPU (tests).
LLAMA2_7B = {"hidden": 4096, "ffn": 11008, "heads": 32, "layers": 32, "vocab": 32000, "seq": 4096}
TINY = {"hidden": 64, "ffn": 172, "heads": 4, "layers": 2, "vocab": 256, "seq": 32}

TRAIN_ARM = "llama2-7b"
TRAIN_MEASURES = ("tokens/s", "TFLOP/s per GPU", "MFU, one GPU", "peak memory, one GPU", "size-rule estimate",
                  "memory plan prediction")
MEASURE = {"race": "poisoned elements read", "record_stream": "shard block recycled while read",
           "stall": "release stall | step time"}
BAD_VERDICTS = ("FAIL", "ERROR", "INCONCLUSIVE")
EMULATED = ("race", "record_stream", "stall")  # sections a dry run puts on the emulated asynchronous accelerator

# --------------------------------------------------------------------------- pure logic (unit-tested on the CPU)


def arms(section: str, modes: Iterable[str]) -> list[str]:
    """The arms a section compares: zerotrain.hpz's modes (``hpz.MODES``) and DeepSpeed's own builder.

    ``stall`` times the correct arms only: a racy mode's timing is not a cost anybody would pay.
    """
    if section == "stall":
        return [m for m in modes if m not in RACY_MODES] + [DEEPSPEED_ARM]
    if section in ("race", "record_stream"):
        return list(modes) + [DEEPSPEED_ARM]
    return [TRAIN_ARM]


def row(section: str, arm: str, measure: str, result: str, expected: str, verdict: str,
        data: dict | None = None) -> dict:
    return {"section": section, "arm": arm, "measure": measure, "result": result, "expected": expected,
            "verdict": verdict, "data": data or {}}


def expectation(section: str, arm: str, measure: str = "", record_stream: bool | None = None) -> str:
    """What a GPU should show in a row (``record_stream``: the arm record_stream-s its shards; default: ordered)."""
    if section == "race":
        return "> 0 (racy)" if arm in RACY_MODES else "0"
    if section == "record_stream":
        protected = arm == "ordered" if record_stream is None else record_stream
        return "0 (record_stream)" if protected else "recycled (no record_stream)"
    if section == "stall":
        return "0 host syncs, stall < sync" if arm == "ordered" else "bytes ok"
    return "finite loss" if measure == "tokens/s" else ""


def planned_rows(section: str, modes: Iterable[str], verdict: str, result: str, reason: str) -> list[dict]:
    """The rows a section would print, all with the same verdict and result (skipped, timed out, crashed)."""
    if section == "train":
        return [row(section, TRAIN_ARM, m, result, expectation(section, TRAIN_ARM, m), verdict,
                    {"reason": reason}) for m in TRAIN_MEASURES]
    return [row(section, a, MEASURE[section], result, expectation(section, a), verdict, {"reason": reason})
            for a in arms(section, modes)]


@dataclass(frozen=True)
class TrainShape:
    layers: int
    micro_batch: int
    seq_len: int
    full: bool  # all 32 layers of Llama-2-7B
    estimate_bytes: int  # this rule's peak estimate, to compare with the measured peak

    def describe(self) -> str:
        size = "full" if self.full else f"reduced to {self.layers}/{LLAMA2_7B['layers']} layers"
        return f"{size}, activation ckpt, {self.micro_batch}x{self.seq_len} tokens/step"


def llama_params(layers: int, shape: dict = LLAMA2_7B) -> tuple[int, int]:
    """(total, largest single layer) parameter counts of a Llama-2-7B-shaped model with ``layers`` layers."""
    h, f, v = shape["hidden"], shape["ffn"], shape["vocab"]
    per_layer = 4 * h * h + 3 * h * f + 2 * h  # q k v o, gate up down, two RMSNorms
    total = 2 * v * h + h + layers * per_layer  # untied embedding and head, final norm
    return total, v * h  # the largest "layer" is the embedding table


def train_memory_estimate(layers: int, micro_batch: int, seq_len: int, shape: dict = LLAMA2_7B) -> int:
    """Peak device bytes of the training step, ZeRO-3 on one GPU, bf16, Adam, activation checkpointing.

    Model states: DeepSpeed's own estimator (``estimate_zero3_model_states_mem_needs``: 18 bytes per parameter
    plus 4 per parameter of the largest layer; DeepSpeed 0.19.8 really holds 16 -- bf16 weights and gradients, fp32
    master, Adam's two moments -- plus a transient fp32 gradient per sub-group, which the other 2 bytes cover).
    Activations (bf16, b x s tokens, hidden h): the checkpointed input of every layer (2 b s h each); one layer's
    recomputed activations and their gradients, ~2 x 34 b s h (Korthikanti et al. 2022, without the attention-score
    term that SDPA's fused kernels do not store); logits and loss, 16 bytes per token and vocabulary entry (bf16
    logits, fp32 copy, fp32 log-softmax, fp32 and bf16 gradients). Plus 5 GiB for the CUDA context, cuBLAS/NCCL
    workspaces and allocator fragmentation. A rule for choosing the layer count, not the memory plan.
    """
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    total, largest = llama_params(layers, shape)
    _, states, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=1, num_nodes=1,
                                                         cpu_offload=False, cpu_offload_params=False, zero_init=True)
    tokens, h = micro_batch * seq_len, shape["hidden"]
    activations = layers * 2 * tokens * h + 2 * 34 * tokens * h + 16 * tokens * shape["vocab"]
    return int(states + activations + 5 * GIB)


def choose_train_shape(device_bytes: int, quick: bool, layers: int | None = None) -> TrainShape | None:
    """Full Llama-2-7B where it fits the device, else the most layers that fit; None below 2 layers.

    ``layers`` (``--train-layers``) overrides the rule, e.g. if the full model runs out of memory after all.
    """
    micro_batch, seq_len = (1, 2048) if quick else (2, LLAMA2_7B["seq"])
    if layers is None:
        layers = LLAMA2_7B["layers"]
        while layers >= 2 and train_memory_estimate(layers, micro_batch, seq_len) > device_bytes:
            layers -= 1
        if layers < 2:
            return None
        if quick:
            layers = min(layers, 4)
    estimate = train_memory_estimate(layers, micro_batch, seq_len)
    return TrainShape(layers, micro_batch, seq_len, layers == LLAMA2_7B["layers"], estimate)


def throughput(tokens: int, seconds: float, flops_per_token: float, peak_tflops: float | None) -> dict:
    """tokens/s, model TFLOP/s per GPU (zerotrain.metrics' FLOPs per token) and MFU (None without a known peak)."""
    tokens_per_s = tokens / seconds
    tflops = tokens_per_s * flops_per_token / 1e12
    return {"tokens_per_s": tokens_per_s, "tflops": tflops, "mfu": tflops / peak_tflops if peak_tflops else None}


def memory_plan_prediction(shape: TrainShape) -> tuple[float | None, str]:
    """The memory plan's per-GPU total (GiB) for this run (``zerotrain.memory_plan``, as ``train.py --plan``):
    Llama-2-7B with ``shape.layers`` layers, ZeRO-3 on one GPU, bf16, Adam, activation checkpointing, unmasked
    sdpa, ``shape.micro_batch`` x ``shape.seq_len``. The reserve term (CUDA context, workspaces) is included:
    compare with the peak *reserved* as well as the peak allocated."""
    from zerotrain import memory_plan
    from zerotrain.distributed import Accelerator
    from zerotrain.run_config import Config

    cfg = Config()  # the schema's model defaults are Llama-2-7B's shape
    cfg.model.num_layers = shape.layers
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, shape.seq_len)
    cfg.train.micro_batch_size, cfg.train.seq_len = shape.micro_batch, shape.seq_len
    cfg.cluster.accelerator = Accelerator.cuda
    p = memory_plan.plan(cfg, memory_plan.World(1, 1, "one GPU"), (None, "not checked"), checkpointing=True)
    reserve = p.term("reserve")
    return p.total / GIB, (f"{p.total / GIB:.1f} GiB (states {p.term('model states') / GIB:.1f}, activations "
                           f"{p.term('activations') / GIB:.1f}, logits+loss {p.term('logits and loss') / GIB:.1f}, "
                           f"buffers {p.term('buffers') / GIB:.1f}, reserve {reserve / GIB:.1f})")


def contained(fn: Callable, *args: Any) -> tuple[float | None, str]:
    """``fn(*args)``, or (None, why it failed): for the annotations of a measurement, which must not lose it."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 -- any failure becomes a note in the table
        return None, f"n/a ({type(e).__name__}: {e})"[:300]


def race_rows(raw: dict) -> list[dict]:
    """Verdicts of the race: racy modes must read poison (else the check proves nothing), the others none."""
    rows = []
    for arm_data in raw["arms"]:
        arm, n, bad = arm_data["arm"], arm_data["elements_read"], arm_data["poisoned_read"]
        racy = arm in RACY_MODES
        result = f"{bad:,} of {n:,} ({100 * bad / max(n, 1):.0f}%), {arm_data['reps']} reps"
        harness = _harness_error(arm_data["shards_built"], arm_data["poisoned_allocations"], arm_data["shards_read"])
        if harness:
            verdict, result = "ERROR", f"{result}; {harness}"
        elif not raw["has_streams"]:
            verdict = "INFO"
            result += " (synchronous device: nothing can race)"
        elif racy:
            verdict = "PASS" if bad > 0 else "INCONCLUSIVE"
        else:
            verdict = "PASS" if bad == 0 and arm_data["wrong_read"] == 0 else "FAIL"
        rows.append(row("race", arm, MEASURE["race"], result, expectation("race", arm), verdict, arm_data))
    return rows


def _harness_error(shards: int, poisoned: int, read: int) -> str:
    """Why a race measurement proves nothing: fresh shards not all poisoned, or not all read through DeepSpeed."""
    problems = []
    if poisoned != shards:
        problems.append(f"harness poisoned {poisoned} of {shards} fresh shards")
    if read != shards:
        problems.append(f"DeepSpeed's gather read {read} of {shards} shards")
    return "; ".join(problems)


def record_stream_rows(raw: dict) -> list[dict]:
    """Protected = the arm record_stream-ed its shards (hpz counters); its blocks must not be handed out again.

    Unprotected arms are the negative control: if none of them saw its block recycled, the check proves nothing.
    """
    data = raw["arms"]
    control_seen = any(d["recycled"] > 0 and d["poisoned_read"] > 0 for d in data if not d["record_streams"])
    rows = []
    for d in data:
        protected = bool(d["record_streams"])
        result = (f"{d['recycled']} of {d['shards']} blocks recycled, {d['poisoned_read']:,} of "
                  f"{d['elements_read']:,} elements read poisoned")
        if d["shards_read"] != d["shards"]:
            verdict, result = "ERROR", f"{result}; DeepSpeed's gather read {d['shards_read']} of {d['shards']} shards"
        elif not raw["has_streams"]:
            verdict, result = "INFO", result + " (synchronous device)"
        elif raw.get("emulated"):  # the emulator has no caching allocator: record_stream is recorded, not enforced
            verdict, result = "INFO", result + " (emulated streams: no caching allocator)"
        elif not protected:
            verdict = "INFO"
        elif d["recycled"] or d["poisoned_read"] or d["wrong_read"]:
            verdict = "FAIL"
        else:
            verdict = "PASS" if control_seen else "INCONCLUSIVE"
        rows.append(row("record_stream", d["arm"], MEASURE["record_stream"], result,
                        expectation("record_stream", d["arm"], record_stream=protected), verdict, d))
    return rows


def stall_rows(raw: dict) -> list[dict]:
    """``ordered`` must never stall the host and must stall it less than ``sync``; every arm gathers exact bytes.

    What one GPU shows: the host's blocked time in the release (the shard build) with the GPU kept busy by the
    step's GEMMs, and the step time each arm pays over the GEMMs alone. What only several nodes show: a host blocked
    in the release issues the next layer's inter-node gather late, so on a slow link the gather is no longer
    hidden behind compute (here the hpZ group has one rank: no inter-node traffic), and the race's effect on a loss.
    """
    by_arm = {d["arm"]: d for d in raw["arms"]}
    sync = by_arm.get("sync")
    compute = raw.get("compute_ms")
    rows = []
    for d in raw["arms"]:
        syncs = d["host_syncs_per_step"]
        result = (f"{d['release_ms']:.2f} | {d['step_ms']:.2f} ms/step (fetch {d['fetch_ms']:.2f}), host syncs/step "
                  f"{'n/a' if syncs is None else syncs}, waits/step {d['waits_per_step'] or 0}, {d['steps']} steps, "
                  f"bytes {'ok' if d['bytes_ok'] else 'WRONG'}")
        if compute is not None:
            result += f", GEMMs alone {compute:.2f} ms (+{d['step_ms'] - compute:.2f})"
        if sync and d["arm"] != "sync":
            result += (f", step {d['step_ms'] / sync['step_ms']:.3f}x sync ({d['step_ms'] - sync['step_ms']:+.2f} ms), "
                       f"host blocked {d['release_ms'] - sync['release_ms']:+.2f} ms vs sync")
        ordered = d["arm"] == "ordered"
        # The emulator orders work but has no timing: there only the counters are judged.
        fast = sync is None or raw.get("emulated") or d["release_ms"] < sync["release_ms"]
        if raw.get("emulated"):
            result += " (emulated streams: times are the CPU's)"
        if d["shards_read_per_step"] != d["shard_copies_per_step"]:
            verdict, result = "ERROR", f"{result}; read {d['shards_read_per_step']} shards per step"
        elif not d["bytes_ok"]:
            verdict = "FAIL"
        elif not raw["has_streams"]:
            verdict = "INFO"
        elif ordered and not (syncs == 0 and fast):
            verdict = "FAIL"
        else:
            verdict = "PASS"
        rows.append(row("stall", d["arm"], MEASURE["stall"], result, expectation("stall", d["arm"]), verdict, d))
    return rows


def train_rows(raw: dict) -> list[dict]:
    shape = TrainShape(**raw["shape"])
    arm = f"{TRAIN_ARM} {shape.layers}L"
    t = throughput(raw["tokens"], raw["seconds"], raw["flops_per_token"], raw["peak_tflops"])
    finite = all(math.isfinite(x) for x in raw["losses"])
    losses = f"loss {raw['losses'][0]:.3f} -> {raw['losses'][-1]:.3f}" if raw["losses"] else "no steps"
    peak = raw["peak_tflops"]
    plan_gib, plan_note = raw["plan"]
    measured = raw["peak_allocated"] / GIB
    checkpointed = raw.get("activation_checkpointing", True)
    tokens_note = "" if checkpointed else "; activation checkpointing was NOT active"
    rows = [
        row("train", arm, "tokens/s", f"{t['tokens_per_s']:,.0f} ({shape.describe()}; {raw['steps']} steps after "
            f"{raw['warmup']} warm-up; {losses}{tokens_note})", expectation("train", arm, "tokens/s"),
            "PASS" if finite and raw["steps"] and checkpointed else "FAIL"),
        row("train", arm, "TFLOP/s per GPU", f"{t['tflops']:.1f} (model FLOPs {raw['flops_per_token'] / 1e9:.2f} "
            f"GFLOP/token, recomputation not counted)", "", "INFO"),
        row("train", arm, "MFU, one GPU", "n/a (unknown device peak)" if t["mfu"] is None else
            f"{100 * t['mfu']:.1f}% of {peak:.0f} TFLOP/s dense bf16 (one GPU: no gradient or parameter traffic; "
            f"a multi-GPU run adds its exposed communication)", "", "INFO"),
        row("train", arm, "peak memory, one GPU", f"{measured:.1f} GiB allocated, {raw['peak_reserved'] / GIB:.1f} GiB "
            f"reserved, of {raw['device_total'] / GIB:.1f} GiB; memory plan for this shape: "
            + (plan_note if plan_gib is None else f"{plan_gib:.1f} GiB"), "", "INFO"),
        row("train", arm, "size-rule estimate", f"{shape.estimate_bytes / GIB:.1f} GiB "
            f"({shape.estimate_bytes / max(raw['peak_allocated'], 1):.2f}x measured)", "", "INFO"),
        row("train", arm, "memory plan prediction",
            plan_note if plan_gib is None else f"{plan_gib:.1f} GiB ({plan_gib / measured:.2f}x measured)", "", "INFO"),
    ]
    for r in rows:
        r["data"] = raw
    return rows


ROWS_OF = {"race": race_rows, "record_stream": record_stream_rows, "stall": stall_rows, "train": train_rows}


NEEDS = ("one NVIDIA GPU with bf16 (compute capability >= 8.0: A100, H100, H200); >= 16 GiB of GPU memory for the "
         "hpZ sections (race, record_stream, stall), >= 23 GiB for a reduced training step, ~127 GiB for full "
         "Llama-2-7B (a 141 GB H200); a CUDA build of torch >= 2.11 (torch==2.13.0 from PyPI on a Linux CUDA node, "
         "or the node's own) and an NVIDIA driver that supports its CUDA version")


def format_table(title: str, rows: list[dict]) -> str:
    header = ("section", "arm", "measure", "result", "expected", "verdict")
    cells = [header] + [tuple(str(r[k]) for k in header) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(header))).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([title] + lines)


def write_json_atomically(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(payload, f, indent=2, default=str)
    os.replace(f.name, path)


# --------------------------------------------------------------------------- the device (probe child)


def probe() -> dict:
    """What this machine offers, and why the check cannot run here (``reason``), if it cannot."""
    import deepspeed

    from zerotrain import hpz

    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "deepspeed": deepspeed.__version__,
            "modes": list(hpz.MODES), "reason": None}
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH:
        info["reason"] = (f"torch {torch.__version__} is older than {'.'.join(map(str, MIN_TORCH))}, the oldest "
                          f"zerotrain supports (docs/offline_install.md)")
    elif torch.version.cuda is None:
        info["reason"] = (f"torch {torch.__version__} is a CPU-only build; on a Linux CUDA node "
                          f"`pip install -r requirements.txt` installs PyPI's CUDA build of torch==2.13.0; a node's "
                          f"own CUDA torch >= 2.11 will do (docs/offline_install.md)")
    elif not torch.cuda.is_available():
        info["reason"] = (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees no GPU "
                          f"(check nvidia-smi, the driver version, CUDA_VISIBLE_DEVICES)")
    else:
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, total_memory=props.total_memory, capability=f"{props.major}.{props.minor}",
                    device_count=torch.cuda.device_count())
        if props.major < 8:
            info["reason"] = f"{props.name} has no bf16 (compute capability {props.major}.{props.minor} < 8.0)"
    return info


def section_requirement(section: str, device: dict, quick: bool) -> str | None:
    """Why this device cannot run this section (too little memory), or None. ``train`` decides in its child."""
    need_gib = {"race": 4, "record_stream": 4, "stall": 8 if quick else 16}.get(section)
    if need_gib and device["total_memory"] < need_gib * GIB:
        return f"needs {need_gib} GiB of GPU memory, {device['name']} has {device['total_memory'] / GIB:.1f}"
    return None


def train_requirement(device_bytes: int, quick: bool) -> str:
    micro_batch, seq_len = (1, 2048) if quick else (2, LLAMA2_7B["seq"])
    need = train_memory_estimate(2, micro_batch, seq_len)
    return f"needs {need / GIB:.0f} GiB for 2 Llama-2-7B layers; the device has {device_bytes / GIB:.1f}"


# --------------------------------------------------------------------------- DeepSpeed's ZeRO-3 on one device


def init_world_of_one() -> None:
    """A real single-rank process group (NCCL on a GPU): what DeepSpeed's gather needs to run at all."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False,
                                   auto_mpi_discovery=False)


def layer_shapes(hidden: int, ffn: int) -> list[tuple[int, ...]]:
    """One Llama decoder layer's parameters, [out, in]: q k v o, gate up down, two RMSNorm weights."""
    return [(hidden, hidden)] * 4 + [(ffn, hidden)] * 2 + [(hidden, ffn)] + [(hidden, )] * 2


class DecoderLayerWeights(torch.nn.Module):
    """A Llama decoder layer's weights as direct parameters, so ZeRO-3 fetches and releases them as one module."""

    def __init__(self, hidden: int, ffn: int, device: torch.device, generator: torch.Generator):
        super().__init__()
        for i, shape in enumerate(layer_shapes(hidden, ffn)):
            weight = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=generator)
            self.register_parameter(f"w{i}", torch.nn.Parameter(weight))


class OneDeviceZero3:
    """DeepSpeed 0.19.8's ZeRO-3 parameter machinery with hpZ, on one device, driven by hand.

    ``DeepSpeedZeRoOffload`` (what a ZeRO-3 engine builds) converts the layers through ``zero.Init`` with the hpZ
    group set to a real single-rank group, and owns the parameter coordinator and its all-gather stream. We call the
    coordinator the way its module hooks do: ``fetch`` before a layer's compute, ``release`` after it. Release builds
    shards through ``Init._partition_param_sec`` (ours while zerotrain.hpz is installed, DeepSpeed's otherwise).
    """

    def __init__(self, n_layers: int, hidden: int, ffn: int):
        import deepspeed.comm as dist
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

        init_world_of_one()
        self.accel = get_accelerator()
        self.device = torch.device(self.accel.current_device_name())
        generator = torch.Generator(self.device).manual_seed(0)
        self.layers = torch.nn.ModuleList(DecoderLayerWeights(hidden, ffn, self.device, generator)
                                          for _ in range(n_layers))
        config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        self.offload = DeepSpeedZeRoOffload(self.layers, timers=None, ds_config=config, overlap_comm=True,
                                            prefetch_bucket_size=0, max_reuse_distance=0,
                                            max_live_parameters=10**12, param_persistence_threshold=0,
                                            zero_param_parallel_group=dist.new_group([0]))
        self.coordinator = self.offload.get_param_coordinator()
        self.allgather_stream = _private(self.coordinator, "_PartitionedParameterCoordinator__allgather_stream")
        for param in self.layers.parameters():
            serve_shards_in_a_world_of_one(cast("ZeroParam", param))
        self.cycle(self.layers[0])  # brings up the hpZ group's communicator before anything is measured

    def cycle(self, layer: torch.nn.Module) -> None:
        """Forward fetch and release (builds shards), backward fetch from the shards and release, step."""
        self.fetch(layer, forward=True)
        self.release(layer, forward=True)
        self.fetch(layer, forward=False)
        self.release(layer, forward=False)
        self.invalidate_shards(layer)
        self.accel.synchronize()

    def params(self, layer: torch.nn.Module) -> list[ZeroParam]:
        # not layer.parameters(): no ZeRO attribute hooks involved
        return cast("list[ZeroParam]", list(layer._parameters.values()))

    def fetch(self, layer: torch.nn.Module, forward: bool) -> None:
        self.coordinator.fetch_sub_module(layer, forward=forward)

    def release(self, layer: torch.nn.Module, forward: bool) -> None:
        self.coordinator.release_sub_module(layer, forward=forward)

    def prefetch(self, layer: torch.nn.Module) -> None:
        """Queue the gather of a layer without waiting for it, as the coordinator's backward prefetch does."""
        gather = _private(self.coordinator, "_PartitionedParameterCoordinator__all_gather_params")
        gather(set(self.params(layer)), False)

    def invalidate_shards(self, layer: torch.nn.Module) -> None:
        """What DeepSpeed's ``invalidate_secondary_tensor`` does after every optimizer step."""
        for param in self.params(layer):
            param.ds_secondary_tensor = None

    def gathered_errors(self, layer: torch.nn.Module) -> tuple[int, int, int]:
        """(elements, NaN elements, elements differing from the primary partition) of the fetched layer."""
        total = nan = wrong = 0
        for p in self.params(layer):
            primary = p.ds_tensor.narrow(0, 0, p.ds_numel).view(p.ds_shape)  # a world of one: the whole parameter
            total += p.ds_numel
            nan += int(torch.isnan(p.data).sum())
            wrong += int((p.data != primary).sum())
        return total, nan, wrong


def shard_of(param: ZeroParam) -> ZeroShard:
    if param.ds_secondary_tensor is None:
        raise RuntimeError(f"parameter ds_id={param.ds_id} has no hpZ secondary shard after its release")
    return param.ds_secondary_tensor


def _private(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise RuntimeError(f"DeepSpeed {type(obj).__name__} has no {name} (written against DeepSpeed 0.19.8)") from None


def _closure(fn: Callable, names: tuple[str, ...]) -> Mapping[str, Any]:
    """Variables of the closure that holds ``names``, looking through DeepSpeed's instrument_w_nvtx wrappers."""
    scope = inspect.getclosurevars(fn).nonlocals
    while not all(n in scope for n in names) and callable(scope.get("func")):
        scope = inspect.getclosurevars(scope["func"]).nonlocals
    missing = [n for n in names if n not in scope]
    if missing:
        raise RuntimeError(f"DeepSpeed's all_gather_coalesced closure has no {missing} (written against 0.19.8)")
    return scope


# Parameters DeepSpeed's gather served from shards (through the wrapper below): every arm, DeepSpeed's included,
# must really read the shards, or "0 poisoned" would prove nothing.
SHARD_READS = {"params": 0}


def serve_shards_in_a_world_of_one(param: ZeroParam) -> None:
    """Make ``param.all_gather_coalesced`` gather from hpZ shards although the world has one rank.

    DeepSpeed's ``all_gather_coalesced`` returns early when the partition group has one rank, so on one device the
    shard would never be read. For parameters with shards we make the call it makes after that early return --
    statuses to INFLIGHT, sorted by ds_id, then its own ``_all_gather_coalesced`` (-> ``_all_gather_dtype``) or
    ``_all_gather_sequential`` on the hpZ group -- and leave everything else to DeepSpeed's function.
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    original = param.all_gather_coalesced
    scope = _closure(original, ("self", "_all_gather_coalesced", "_all_gather_sequential"))
    init = scope["self"]

    def all_gather_coalesced(params, safe_mode: bool = False, quantize: bool = False):
        params = list(params)
        if not params or params[0].ds_secondary_tensor is None:
            return original(params, safe_mode=safe_mode, quantize=quantize)
        for p in params:
            if p.ds_status != ZeroParamStatus.NOT_AVAILABLE:
                raise RuntimeError(p.ds_summary())
            p.ds_status = ZeroParamStatus.INFLIGHT
        params = sorted(params, key=lambda p: p.ds_id)
        SHARD_READS["params"] += len(params)
        world, group = init.num_ranks_in_param_group, init.zero_param_process_group
        if init.allgather_sequential or len(params) == 1:
            return scope["_all_gather_sequential"](params, world, True, group, quantize)
        return scope["_all_gather_coalesced"](params, world, init.rank_in_group, True, group, quantize)

    param.all_gather_coalesced = all_gather_coalesced


def use_arm(arm: str) -> None:
    from zerotrain import hpz

    if arm == DEEPSPEED_ARM:
        hpz.uninstall()
    else:
        hpz.install(mode=arm)
    hpz.reset_counters()
    SHARD_READS["params"] = 0


def arm_counters(arm: str) -> dict | None:
    from zerotrain import hpz

    return None if arm == DEEPSPEED_ARM else hpz.counters()


class Busy:
    """Keeps the current (compute) stream busy for ``ms``: a spinning kernel. No-op without CUDA.

    ``torch.cuda._sleep`` spins for a number of SM clock cycles, so its duration follows the clock: an idle H200
    reads 345 MHz and 1980 under load. The cycles per millisecond are therefore measured after a warm-up of bf16
    GEMMs has brought the clocks up, as the median of five timed spins, the spread recorded beside it.
    """

    def __init__(self, ms: float):
        self.ms, self.cycles, self.calibration = ms, 0, None
        if torch.cuda.is_available():
            self.calibration = calibrate_sleep()
            self.cycles = int(self.calibration["cycles_per_ms"] * ms)

    def __call__(self) -> None:
        if self.cycles:
            torch.cuda._sleep(self.cycles)


def calibrate_sleep(warmup_s: float = 1.0, probe_cycles: int = 20_000_000) -> dict:
    """Cycles of ``torch.cuda._sleep`` per millisecond at steady (loaded) clocks, and how steady they were."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warmup_s:  # ~0.14 ms per GEMM on an H200: the clocks ramp up under load
        for _ in range(20):
            a = torch.mm(a, a).clamp_(-1, 1)
        torch.cuda.synchronize()
    rates = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe_cycles)
        end.record()
        end.synchronize()
        rates.append(probe_cycles / start.elapsed_time(end))
    rates.sort()
    return {"cycles_per_ms": rates[2], "min": rates[0], "max": rates[-1], "warmup_s": warmup_s,
            "implied_mhz": rates[2] / 1e3}


class PoisonFreshShards(contextlib.AbstractContextManager):
    """While active, every fresh tensor of a shard's size is NaN-filled, then the compute stream is made busy.

    The fill runs on a side stream and the host waits for it, so the poison is in memory before anything can read
    it, without ordering anything else; the busy kernel then delays the shard copy the builder enqueues next on the
    compute stream. A reader that is not ordered after that copy reads NaN. A ``TorchDispatchMode`` sees every
    allocation however the builder makes it.
    """

    def __init__(self, shard_numels: set[int], busy: Callable[[], None], accel: Any):
        from torch.utils._python_dispatch import TorchDispatchMode

        aten = torch.ops.aten
        factories = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}
        stream = accel.Stream() if accel.Stream is not None else None  # the CPU accelerator has no streams
        outer = self
        self.fresh: list[weakref.ref] = []  # what was poisoned, without keeping it alive

        class _Mode(TorchDispatchMode):

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if (func.overloadpacket in factories and isinstance(out, torch.Tensor) and out.is_floating_point()
                        and out.numel() in shard_numels):
                    with accel.stream(stream):
                        out.fill_(float("nan"))
                    if stream is not None:
                        stream.synchronize()
                    busy()
                    outer.fresh.append(weakref.ref(out))
                return out

        self._mode = _Mode()

    @property
    def poisoned(self) -> int:
        return len(self.fresh)

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


# --------------------------------------------------------------------------- sections (child processes)


def race_section(opts: argparse.Namespace) -> dict:
    shape = TINY if opts.tiny else LLAMA2_7B
    zero3 = OneDeviceZero3(1, shape["hidden"], shape["ffn"])
    layer, accel = zero3.layers[0], zero3.accel
    params = zero3.params(layer)
    busy = Busy(ms=10.0)  # per shard: well above the host's time to reach the read (~3 ms for 9 shards)
    reps = 2 if opts.quick else 5
    results = []
    for arm in arms("race", opts.modes):
        use_arm(arm)
        d: dict[str, Any] = {"arm": arm, "reps": reps, "elements_read": 0, "poisoned_read": 0, "wrong_read": 0,
             "shards_built": reps * len(params), "poisoned_allocations": 0}
        for _ in range(reps):
            zero3.invalidate_shards(layer)
            zero3.fetch(layer, forward=True)  # from the primary partitions (no shards yet)
            accel.synchronize()
            with PoisonFreshShards({p.ds_numel for p in params}, busy, accel) as poison:
                zero3.release(layer, forward=True)  # builds the shards: copies queued behind the busy kernel
            zero3.fetch(layer, forward=False)  # reads the shards on the all-gather stream
            accel.synchronize()
            total, nan, wrong = zero3.gathered_errors(layer)
            d["elements_read"] += total
            d["poisoned_read"] += nan
            d["wrong_read"] += wrong
            d["poisoned_allocations"] += poison.poisoned
            zero3.release(layer, forward=False)
        d["counters"] = arm_counters(arm)
        d["shards_read"] = SHARD_READS["params"]
        results.append(d)
    return {"arms": results, "has_streams": not accel.is_synchronized_device(), "emulated": emulated(),
            "busy_cycles": busy.cycles,
            "busy_calibration": busy.calibration}


def record_stream_section(opts: argparse.Namespace) -> dict:
    shape = TINY if opts.tiny else LLAMA2_7B
    zero3 = OneDeviceZero3(1, shape["hidden"], shape["ffn"])
    layer, accel = zero3.layers[0], zero3.accel
    params = zero3.params(layer)
    late = Busy(ms=50.0)
    results = []
    for arm in arms("record_stream", opts.modes):
        use_arm(arm)
        zero3.invalidate_shards(layer)
        zero3.fetch(layer, forward=True)
        zero3.release(layer, forward=True)  # shards built normally
        accel.synchronize()
        accel.empty_cache()  # no spare cached blocks: a new allocation gets a freed shard's block or fresh memory
        freed = {shard_of(p).data_ptr() for p in params}
        with accel.stream(zero3.allgather_stream):
            late()  # the all-gather stream is behind: the gather queued next reads late
        zero3.prefetch(layer)  # the gather (and, in ordered, record_stream) is queued; nobody waits for it yet
        zero3.invalidate_shards(layer)  # shards freed while their gather is still queued
        reused = [torch.empty(p.ds_numel, dtype=p.dtype, device=zero3.device).fill_(float("nan")) for p in params]
        recycled = sum(t.data_ptr() in freed for t in reused)
        zero3.fetch(layer, forward=False)  # waits for the queued gather
        accel.synchronize()
        total, nan, wrong = zero3.gathered_errors(layer)
        del reused
        zero3.release(layer, forward=False)
        counters = arm_counters(arm)
        results.append({"arm": arm, "shards": len(params), "shards_read": SHARD_READS["params"],
                        "recycled": recycled, "elements_read": total, "poisoned_read": nan, "wrong_read": wrong,
                        "record_streams": counters["record_streams"] if counters else 0})
    return {"arms": results, "has_streams": not accel.is_synchronized_device(), "emulated": emulated()}


def emulated() -> bool:
    from zerotrain.hpz import async_emulator

    return async_emulator.is_installed()


class LayerCompute:
    """A layer's forward (1 GEMM per weight) and backward (2 GEMMs per weight) on the compute stream, in bf16."""

    def __init__(self, tokens: int, hidden: int, ffn: int, device: torch.device):
        def randn(*shape):
            return torch.randn(*shape, device=device, dtype=torch.bfloat16)

        self.act = {hidden: randn(tokens, hidden), ffn: randn(tokens, ffn)}
        self.out = {hidden: randn(tokens, hidden), ffn: randn(tokens, ffn)}
        self.grad = {s: randn(*s) for s in set(layer_shapes(hidden, ffn)) if len(s) == 2}

    def forward(self, weights: Sequence[torch.Tensor]) -> None:
        for w in (w for w in weights if w.dim() == 2):
            torch.mm(self.act[w.shape[1]], w.t(), out=self.out[w.shape[0]])

    def backward(self, weights: Sequence[torch.Tensor]) -> None:
        for w in (w for w in weights if w.dim() == 2):
            torch.mm(self.act[w.shape[0]], w, out=self.out[w.shape[1]])  # input gradient
            weight_grad = self.grad[(w.shape[0], w.shape[1])]
            torch.mm(self.act[w.shape[0]].t(), self.act[w.shape[1]], out=weight_grad)


def stall_section(opts: argparse.Namespace) -> dict:
    shape = TINY if opts.tiny else LLAMA2_7B
    n_layers, tokens = (2, 16) if opts.tiny else ((4, 2048) if opts.quick else (8, 4096))
    warmup, steps = (1, 3) if opts.quick or opts.tiny else (2, 10)
    zero3 = OneDeviceZero3(n_layers, shape["hidden"], shape["ffn"])
    compute = LayerCompute(tokens, shape["hidden"], shape["ffn"], zero3.device)
    accel = zero3.accel

    def step(verify: bool) -> tuple[float, float, bool]:
        release_s = fetch_s = 0.0
        exact = True
        for layer in zero3.layers:
            t0 = time.perf_counter()
            zero3.fetch(layer, forward=True)
            t1 = time.perf_counter()
            compute.forward(zero3.params(layer))
            t2 = time.perf_counter()
            zero3.release(layer, forward=True)  # builds the shards: where sync stalls the host
            release_s += time.perf_counter() - t2
            fetch_s += t1 - t0
        for layer in reversed(zero3.layers):
            t0 = time.perf_counter()
            zero3.fetch(layer, forward=False)  # gathers from the shards; DeepSpeed's fetch throttle may wait here
            fetch_s += time.perf_counter() - t0
            compute.backward(zero3.params(layer))
            if verify:
                exact &= zero3.gathered_errors(layer)[2] == 0
            zero3.release(layer, forward=False)
        for layer in zero3.layers:
            zero3.invalidate_shards(layer)  # the optimizer step
        return release_s, fetch_s, exact

    results = []
    with torch.no_grad():
        for arm in arms("stall", opts.modes):
            use_arm(arm)
            for _ in range(warmup):
                step(verify=False)
            use_arm(arm)  # counters from the measured steps only
            release, fetch, times, exact = [], [], [], True
            for i in range(steps):
                accel.synchronize()
                t0 = time.perf_counter()
                r, f, ok = step(verify=i == steps - 1)
                accel.synchronize()
                times.append(time.perf_counter() - t0)
                release.append(r)
                fetch.append(f)
                exact &= ok
            c = arm_counters(arm)
            results.append({"arm": arm, "steps": steps, "release_ms": 1e3 * sum(release) / steps,
                            "fetch_ms": 1e3 * sum(fetch) / steps,
                            "step_ms": 1e3 * sum(times) / steps, "step_ms_min": 1e3 * min(times),
                            "host_syncs_per_step": c["host_syncs"] // steps if c else None,
                            "waits_per_step": c["waits_issued"] // steps if c else None,
                            "shard_copies_per_step": sum(len(zero3.params(x)) for x in zero3.layers),
                            "shards_read_per_step": SHARD_READS["params"] // steps, "bytes_ok": exact})
        # The same GEMMs without ZeRO: the GPU time of a step, so each arm's step time minus it is what the arm
        # leaves the GPU idle (launch gaps after a blocked host, gathers not hidden).
        zero3.fetch(zero3.layers[0], forward=True)
        weights = zero3.params(zero3.layers[0])  # layer 0's, the same shapes as every layer's
        for _ in range(warmup):
            compute_step(weights, n_layers, compute)
        compute_times = []
        for _ in range(steps):
            accel.synchronize()
            t0 = time.perf_counter()
            compute_step(weights, n_layers, compute)
            accel.synchronize()
            compute_times.append(time.perf_counter() - t0)
        zero3.release(zero3.layers[0], forward=True)
    return {"arms": results, "has_streams": not accel.is_synchronized_device(), "emulated": emulated(),
            "layers": n_layers, "tokens": tokens,
            "compute_ms": 1e3 * sum(compute_times) / steps, "compute_ms_min": 1e3 * min(compute_times)}


def compute_step(weights: Sequence[torch.Tensor], n_layers: int, compute: LayerCompute) -> None:
    """A stall step's GEMMs alone, on weights gathered once."""
    for _ in range(n_layers):
        compute.forward(weights)
    for _ in range(n_layers):
        compute.backward(weights)


def train_section(opts: argparse.Namespace) -> dict:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from zerotrain import hpz, metrics, models

    hpz.uninstall()  # one GPU: no hpZ group, plain ZeRO-3 (what train.py does for hpZ size 1)
    accel = get_accelerator()
    shape: TrainShape | None
    if opts.tiny:
        s = TINY
        shape = TrainShape(s["layers"], 2, s["seq"], False, 0)
    else:
        s = LLAMA2_7B
        device_bytes = torch.cuda.get_device_properties(0).total_memory
        shape = choose_train_shape(device_bytes, opts.quick, opts.train_layers)
        if shape is None:
            return {"skipped": train_requirement(device_bytes, opts.quick)}
    warmup, steps = (1, 2) if opts.tiny else ((2, 4) if opts.quick else (3, 10))
    # Before training, and contained: a failure of the plan must not cost the measurement.
    plan = (None, "n/a: the tiny CPU shape") if opts.tiny else contained(memory_plan_prediction, shape)
    init_world_of_one()
    ds_config = {"train_micro_batch_size_per_gpu": shape.micro_batch, "gradient_accumulation_steps": 1,
                 "bf16": {"enabled": True}, "gradient_clipping": 1.0, "zero_allow_untested_optimizer": True,
                 "steps_per_print": 10**9, "zero_optimization": {"stage": 3}}
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                      num_hidden_layers=shape.layers, num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                      max_position_embeddings=max(shape.seq_len, s["seq"]), rms_norm_eps=1e-5, use_cache=False)
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841 -- while alive, transformers builds the model under zero.Init
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.activation_checkpointing_enable()  # acts in train mode only (engine.train() below)
    # torch's fused AdamW needs no compiler (DeepSpeed's FusedAdam is JIT-built with nvcc).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    models.set_fetch_unit(model, models.ParamFetch.layer)  # train.param_fetch's default, as train.py does
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    engine.train()
    checkpointing = model.training and model.is_activation_checkpointing
    flops = metrics.flops_per_token(metrics.matmul_params(model), shape.layers, s["hidden"], shape.seq_len)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, s["vocab"], (shape.micro_batch, shape.seq_len), generator=g).to(engine.device)
               for _ in range(warmup + steps)]
    deadline = STARTED + 0.85 * opts.budget_s
    losses = []

    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    for x in batches[:warmup]:
        train_step(x)
    accel.synchronize()
    accel.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for x in batches[warmup:]:
        losses.append(train_step(x))
        if time.monotonic() > deadline:  # keep inside the section's budget: report the steps measured
            break
    accel.synchronize()
    seconds = time.perf_counter() - t0
    return {"shape": asdict(shape), "warmup": warmup, "steps": len(losses), "seconds": seconds,
            "tokens": len(losses) * shape.micro_batch * shape.seq_len, "losses": [float(x) for x in losses],
            "flops_per_token": flops, "peak_tflops": metrics.peak_tflops("bf16"),
            "peak_allocated": accel.max_memory_allocated(), "peak_reserved": accel.max_memory_reserved(),
            "device_total": accel.total_memory(), "plan": plan,
            "device": metrics.device_name(), "activation_checkpointing": checkpointing}


def dry_probe() -> dict:
    """The probe of a dry run: also JIT-builds DeepSpeed's CPU shared-memory comm op (once per TORCH_EXTENSIONS_DIR)
    under the probe's longer budget, so no section is killed mid-build (which would leave the build's lock behind
    and hang every later section)."""
    from deepspeed.comm.torch import build_shm_op

    info = probe()
    t0 = time.perf_counter()
    info["shm_comm_op"] = build_shm_op() is not None
    info["shm_comm_op_s"] = time.perf_counter() - t0
    return info


RUNNERS = {"probe": lambda opts: dry_probe() if opts.tiny else probe(), "race": race_section,
           "record_stream": record_stream_section, "stall": stall_section, "train": train_section}


def run_child(opts: argparse.Namespace) -> int:
    if opts.emulate:  # first: before DeepSpeed asks the accelerator for streams
        from zerotrain.hpz import async_emulator

        async_emulator.install(poison=float("nan"))
    from zerotrain import hpz

    opts.modes = list(hpz.MODES)
    result = RUNNERS[opts.run_section](opts)
    write_json_atomically(Path(opts.section_out), result)
    return 0


# --------------------------------------------------------------------------- orchestration (the parent)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_in_child(section: str, args: argparse.Namespace, log: Path, gpu: bool) -> tuple[dict | None, str]:
    """Run one section in its own process within its budget: (result, "") or (None, why it has none)."""
    budget = section_budget(section, args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--run-section", section, "--section-out", str(out),
               "--budget-s", str(budget)] + (["--quick"] if args.quick else [])
        if args.train_layers:
            cmd += ["--train-layers", str(args.train_layers)]
        if args.dry_run:  # tiny shapes on the CPU; emulated streams for the sections whose code paths need them
            cmd += ["--tiny"] + (["--emulate"] if section in EMULATED else [])
        # A world of one of its own, whatever launcher (SLURM, torchrun) the check itself was started under.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
               "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
        if args.dry_run:
            env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
        elif gpu:
            env["DS_ACCELERATOR"] = "cuda"  # a Makefile's DS_ACCELERATOR=cpu must not win on a GPU node
        with log.open("a") as f:
            f.write(f"\n===== {section}: {' '.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
            try:
                rc = proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                return None, f"timed out after its {budget} s budget (see {log})"
            except BaseException:  # Ctrl-C: the child runs in its own session and would outlive us
                os.killpg(proc.pid, 9)
                raise
        if rc != 0 or not out.is_file():
            return None, f"exited {rc}: {_last_error_line(log)} (see {log})"
        return json.loads(out.read_text()), ""


def section_budget(section: str, args: argparse.Namespace) -> int:
    if args.dry_run:
        return DRY_PROBE_BUDGET_S if section == "probe" else DRY_BUDGET_S
    return BUDGET_S[section][int(args.quick)]


def _last_error_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["no output"])[-1][:200]


def format_markdown(title: str, rows: list[dict]) -> str:
    header = ("section", "arm", "measure", "result", "expected", "verdict")
    lines = [f"# {title.splitlines()[0]}", ""] + [f"{ln}  " for ln in title.splitlines()[1:]]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(r[k]).replace("|", "\\|") for k in header) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_text_atomically(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        f.write(text)
    os.replace(f.name, path)


def device_probe(args: argparse.Namespace, log: Path) -> tuple[dict | None, str]:
    if not args.dry_run:
        return run_in_child("probe", args, log, gpu=torch.cuda.is_available())
    device, why = run_in_child("probe", args, log, gpu=False)
    if device is not None:  # the CPU stands in for the GPU: nothing is skipped
        device.update(reason=None, name="CPU (dry run: tiny shapes, emulated streams)", total_memory=0,
                      capability="n/a")
    return device, why


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # through run_in_child's handler, which kills the section's process group


def check(args: argparse.Namespace) -> int:
    """Run the sections one by one; each one's JSON and Markdown are written as soon as it ends, then the summary."""
    signal.signal(signal.SIGTERM, _terminated)  # `timeout` must not leave a section running on the GPU
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = Path(args.json) if args.json else out_dir / "gpu_check.json"
    log = out_dir / "gpu_check.log"
    log.write_text("")
    device, why = device_probe(args, log)
    if device is None:
        print(f"gpu_check.py: the device probe failed: {why}", file=sys.stderr)
        return 2
    modes = device["modes"]
    name = device.get("name", "no GPU")
    memory = (f" ({device['total_memory'] / GIB:.1f} GiB, sm {device['capability']})" if device.get("total_memory")
              else "")
    title = (f"zerotrain GPU check{' --quick' if args.quick else ''}{' --dry-run' if args.dry_run else ''}: {name}"
             f"{memory}, torch {device['torch']} (CUDA {device['torch_cuda']}), DeepSpeed {device['deepspeed']}, "
             f"hpZ modes {', '.join(modes)}")
    if device["reason"] is not None:
        title += f"\n{'no GPU: ' if 'name' not in device else ''}skipped ({device['reason']})\nneeds: {NEEDS}"
    if args.dry_run:
        title += ("\ndry run: every section's code on the CPU with tiny shapes; race, record_stream and stall through "
                  "the emulated asynchronous accelerator (ordering, not timing): no number here is a GPU's")
    rows, sections = [], {}
    for section in args.sections:
        t0 = time.monotonic()
        raw, error = None, ""
        skipped = device["reason"] or (None if args.dry_run else section_requirement(section, device, args.quick))
        if skipped is None:
            raw, error = run_in_child(section, args, log, gpu=True)
            skipped = (raw or {}).get("skipped")
        if device["reason"] is not None:
            gpu_less = "name" not in device  # a GPU without bf16 is not "no GPU"
            new = planned_rows(section, modes, "SKIPPED", "no GPU: skipped" if gpu_less else "skipped",
                                skipped or device["reason"])
        elif skipped is not None:
            new = planned_rows(section, modes, "SKIPPED", f"skipped: {skipped}", skipped)
        elif raw is None:
            new = planned_rows(section, modes, "ERROR", error, error)
        else:
            new = ROWS_OF[section](raw)
        rows += new
        sections[section] = {"budget_s": section_budget(section, args), "elapsed_s": time.monotonic() - t0,
                             "skipped": skipped, "error": error or None, "raw": raw}
        write_json_atomically(out_dir / f"{section}.json", {"title": title, **sections[section], "rows": new})
        write_text_atomically(out_dir / f"{section}.md", format_markdown(title, new))
        print(f"[{section}: {sections[section]['elapsed_s']:.0f} s of {sections[section]['budget_s']} s] "
              f"{out_dir / section}.json, .md", flush=True)
        write_summary(summary, title, args, device, sections, rows)
    print(format_table(title, rows))
    ok, checked = write_summary(summary, title, args, device, sections, rows)
    verdict = "SOME CHECKS FAILED" if not ok else ("all checks passed" if checked else "nothing was checked")
    print(f"\n{verdict}; JSON: {summary}; Markdown: {summary.with_suffix('.md')}; section output: {log}")
    return 0 if ok else 1


def write_summary(path: Path, title: str, args: argparse.Namespace, device: dict, sections: dict,
                  rows: list[dict]) -> tuple[bool, bool]:
    ok = not any(r["verdict"] in BAD_VERDICTS for r in rows)
    checked = any(r["verdict"] != "SKIPPED" for r in rows)
    write_json_atomically(path, {"title": title, "command": [sys.executable] + sys.argv, "quick": args.quick,
                                 "dry_run": args.dry_run, "device": device, "sections": sections, "rows": rows,
                                 "ok": ok, "checked": checked})
    write_text_atomically(path.with_suffix(".md"), format_markdown(title, rows))
    return ok, checked


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/gpu_check", help="directory for each section's JSON and Markdown, the "
                    "summary and the log (default: %(default)s)")
    ap.add_argument("--json", default=None, help="the summary's JSON file (default: OUT/gpu_check.json)")
    ap.add_argument("--quick", action="store_true", help="the 2-minute subset")
    ap.add_argument("--dry-run", action="store_true",
                    help="every section's code on the CPU with tiny shapes (emulated streams): no GPU needed")
    ap.add_argument("--sections", default=",".join(SECTIONS), type=_sections,
                    help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    ap.add_argument("--train-layers", type=_train_layers, default=None,
                    help="Llama-2-7B layers in the training step, 2-32 (default: as many as the size rule fits)")
    # Internal: the parent runs each section as `--run-section NAME --section-out FILE`; --tiny runs the same code
    # on tiny shapes, on any DeepSpeed accelerator; --emulate on the emulated asynchronous one (the dry run).
    ap.add_argument("--run-section", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    ap.add_argument("--section-out", help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, default=600.0, help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--emulate", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_section and not args.section_out:
        ap.error("--run-section needs --section-out")
    return args


def _train_layers(value: str) -> int:
    if not value.isdigit() or not 2 <= int(value) <= LLAMA2_7B["layers"]:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a layer count from 2 to {LLAMA2_7B['layers']}")
    return int(value)


def _sections(value: str) -> list[str]:
    names = [s.strip() for s in value.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown section(s) {unknown or value!r}; valid: {','.join(SECTIONS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_child(args) if args.run_section else check(args)


if __name__ == "__main__":
    sys.exit(main())
