"""Worker: every multi-process check of ``hpz.grad_reduce=hierarchical`` in one launch per phase.

Runs under ``tools.launcher.launch_nodes`` (2 emulated nodes x 2 ranks, ``ZEROTRAIN_NODE_NAME=node0/node1``, gloo), so
the nodes the reduction assumes are the launch's nodes. Usage::

    worker_grad_reduce.py OUT.json main DATA RUNS_DIR [VARIANTS key=value ...]  # [comm,] ring, unit check,
                                                          # refusals, loss parity, resume's 1st launch
    worker_grad_reduce.py OUT.json resume DATA RUNS_DIR    # resume's relaunch
    worker_grad_reduce.py OUT.json ring DATA RUNS_DIR      # the ring stage alone

Stages (each records its result or its error; rank 0 writes OUT.json):

* ``unit``: DeepSpeed's own ``reduce_scatter_coalesced`` on random gradient lists, flat vs hierarchical (vs an
  exact float64 oracle), each rank's partition; integer-valued floats (exactly equal); the negative control
  (the hierarchical reduction without the reordering of the flat buffer);
* ``refusals``: engine builds that must fail with a clear error, each beside the same build with ``flat``;
* ``parity``: the real trainer, 50 steps, gradient accumulation 2, clipping, evaluation, fp32 and bf16, plain
  ZeRO-3 vs hierarchical, and the negative control (hierarchical without the reorder) (a 1-layer tiny Llama: the
  step time is ZeRO-3's per-parameter collectives, not compute); plus
  ``contiguous_gradients=false`` (a path that still goes through the patched reduction);
* ``ring``: :mod:`zerotrain.ring_collectives` (``cluster.collectives=ring``) against gloo's own collectives on the
  world, the hpZ pairs and the same-local-rank pairs (fp32, bf16, integer-valued; DeepSpeed's aliasing of output
  and input; ``async_op``), the bytes each rank's rings really sent to whom against the ring model and the
  accounting's ring-model count, and the hierarchical engine's first-step check (stage 2 a ring reduce-scatter),
  with its negative control (DeepSpeed's flat reduce-scatter restored under the hierarchical plan: it must fail);
* ``resume``: hierarchical fp32 stopped at step 7 (``train.exit_interval=7``, log interval 5), relaunched with the
  same command: it resumes and stops at step 14;
* ``comm`` (tests/comm/test_comm_bytes.py's job, sharing the start-up): first in the launch, so in fresh processes
  as in a launch of its own (its plain ZeRO-3 variant must find no hpZ group: DeepSpeed keeps the last one built as
  a module global), ``worker_comm.run_variants(VARIANTS, key=value ...)``: the trainer with communication accounting.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as tdist

from zerotrain import ds_patches, hpz
from zerotrain.hpz import grad_reduce
from zerotrain.run_config import parse_args

# torch warns that DeepSpeed's collectives are deprecated names on every call: megabytes of log per run.
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)

STEPS = 50
RESUME_STOP = 7  # not a multiple of the log interval below
RESUME_LOG_INTERVAL = 5
# Clip hard enough that clipping is active (the tiny Llama's gradient norm is ~0.3-1 here).
COMMON = ["recipe=tiny_llama", "model.num_layers=1", "train.micro_batch_size=2", "train.seq_len=32",
          "train.grad_accum=2", "train.grad_clip=0.2", "train.eval_interval=25", "train.eval_batches=2",
          "schedule.warmup_steps=5", "optim.lr=3e-3", "wandb.enabled=false", "checkpoint.interval=0"]
# (precision, variant): flat = plain ZeRO-3; unordered = hierarchical without the reorder (the negative control).
PARITY = [(precision, reduce) for precision in ("fp32", "bf16") for reduce in ("flat", "hierarchical")]
PARITY.append(("fp32", "unordered"))
# ZT_GRAD_REDUCE_REFERENCE=1 adds the measurement the tolerances in test_grad_reduce.py come from: plain ZeRO-3
# whose reduce-scatter sums the ranks' contributions in another order (see reordered_flat_reduce_scatter).
if os.environ.get("ZT_GRAD_REDUCE_REFERENCE") == "1":
    PARITY += [("fp32", "reordered"), ("bf16", "reordered"), ("bf16", "unordered")]


def rank() -> int:
    return tdist.get_rank()


def gather(obj):
    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------------------------------------------
# unit: the reduction itself, through DeepSpeed's reduce_scatter_coalesced
# ----------------------------------------------------------------------------------------------------------------

SIZES = [1000, 37, 4099, 1, 64]  # odd sizes: DeepSpeed pads each to a multiple of the world size


def _gradients(kind: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank())
    if kind == "integer":  # integer-valued floats: every summation order is exact (and /4 is exact)
        return [torch.randint(-4096, 4096, (n,), generator=g).float() for n in SIZES]
    if kind == "single":  # one tensor, numel a multiple of 4: DeepSpeed reduces the gradient's own memory
        return [torch.randn(4096, generator=g)]
    tensors = [torch.randn(n, generator=g) for n in SIZES]
    return [t.bfloat16() for t in tensors] if kind == "bf16" else tensors


def unit() -> dict:
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
    from deepspeed.utils import groups as ds_groups

    from zerotrain.hpz import groups

    hpz.uninstall()
    hpz.install(grad_reduce="hierarchical")
    groups.create_group(2)
    grad_reduce.check_layout(2)  # the launch's two nodes: groups [0,1] and [2,3] lie inside them
    plan = grad_reduce.build_plan(2, ds_groups._get_zero_param_intra_parallel_group())
    unordered = dataclasses.replace(plan, reorder=False)
    world = tdist.get_world_size()
    out = {"peer_group": grad_reduce.group_ranks(plan.peer_group), "hpz_group": grad_reduce.group_ranks(plan.hpz_group)}
    for kind in ("random", "integer", "bf16", "single"):
        grads = _gradients(kind)
        # Oracle: the exact mean over ranks in float64, this rank's ceil(n/W) chunk of each tensor.
        oracle = []
        for t in grads:
            total = t.double().clone()
            tdist.all_reduce(total)
            chunk = -(-t.numel() // world)
            oracle.append((total / world)[rank() * chunk:(rank() + 1) * chunk])
        before = hpz.counters()["hierarchical_grad_reduces"]
        flat = reduce_scatter_coalesced([t.clone() for t in grads])
        with grad_reduce.reducing_with(plan):
            hier = reduce_scatter_coalesced([t.clone() for t in grads])
        with grad_reduce.reducing_with(unordered):
            control = reduce_scatter_coalesced([t.clone() for t in grads])
        calls = hpz.counters()["hierarchical_grad_reduces"] - before

        def diff(a, b):
            return max(float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))

        tol = 2e-2 if kind == "bf16" else 1e-5
        out[kind] = {
            "equal": all(torch.equal(a, b) for a, b in zip(flat, hier)),
            "allclose": all(torch.allclose(a.double(), b.double(), rtol=tol, atol=tol) for a, b in zip(flat, hier)),
            "max_diff": diff(flat, hier),
            "flat_vs_oracle": diff(flat, oracle),
            "hier_vs_oracle": diff(hier, oracle),
            "control_allclose": all(torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)
                                    for a, b in zip(flat, control)),
            "control_max_diff": diff(flat, control),
            "shapes_equal": [a.shape for a in flat] == [b.shape for b in hier],
            "hierarchical_calls": calls,
        }
    # One hpZ group holding the whole world (a single node): stage 1 is the whole reduction. DeepSpeed's "current"
    # hpZ group is a module global that later stages' (plain ZeRO-3) layout checks read: put it back afterwards.
    current = ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP
    groups.create_group(4)
    whole = grad_reduce.build_plan(4, ds_groups._get_zero_param_intra_parallel_group())
    ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = current
    grads = _gradients("integer")
    flat = reduce_scatter_coalesced([t.clone() for t in grads])
    with grad_reduce.reducing_with(whole):
        hier = reduce_scatter_coalesced([t.clone() for t in grads])
    out["one_group"] = {"groups": whole.num_groups, "equal": all(torch.equal(a, b) for a, b in zip(flat, hier))}
    hpz.uninstall()
    return {"per_rank": gather(out)}


# ----------------------------------------------------------------------------------------------------------------
# refusals: clear errors at engine build, each beside the same build with flat
# ----------------------------------------------------------------------------------------------------------------

REFUSALS = {  # name -> (zero_optimization extras, ZeRO stage, hpZ size, node names per rank or None)
    "no_hpz_group": ({}, 3, 1, None),
    "uneven_nodes": ({}, 3, 2, ["node0", "node0", "node0", "node1"]),
    "hpz_group_spans_nodes": ({}, 3, 2, ["node0", "node1", "node2", "node3"]),
    # (zero_force_ds_cpu_optimizer: DeepSpeed would otherwise refuse our torch AdamW before we see the config)
    "offload_optimizer": ({"offload_optimizer": {"device": "cpu"}}, 3, 2, None),
    "offload_param": ({"offload_param": {"device": "cpu"}}, 3, 2, None),
    "quantized_gradients": ({"zero_quantized_gradients": True}, 3, 2, None),
    "reduce_scatter_off": ({"reduce_scatter": False}, 3, 2, None),
    "zero_stage_2": ({}, 2, 2, None),
}


def _build_engine(extra: dict, stage: int, hpz_size: int):
    import deepspeed

    zero = {"stage": stage, "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0, **extra}
    if stage == 3:
        zero["zero_hpz_partition_size"] = hpz_size
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    engine.destroy()


def _attempt(grad_reduce_mode: str, extra: dict, stage: int, hpz_size: int, names) -> dict:
    hpz.uninstall()
    hpz.install(grad_reduce=grad_reduce_mode)
    saved = os.environ.get("ZEROTRAIN_NODE_NAME")
    if names is not None:
        os.environ["ZEROTRAIN_NODE_NAME"] = names[rank()]
    try:
        _build_engine(extra, stage, hpz_size)
        result = {"built": True}
    except Exception as e:  # noqa: BLE001 -- the error is the result
        result = {"built": False, "type": type(e).__name__, "message": str(e),
                  "is_grad_reduce_error": isinstance(e, grad_reduce.GradReduceConfigError)}
    finally:
        if saved is not None:
            os.environ["ZEROTRAIN_NODE_NAME"] = saved
        hpz.uninstall()
    tdist.barrier()
    return result


def refusals(runs: Path, data: str) -> dict:
    out = {}
    for name, (extra, stage, hpz_size, names) in REFUSALS.items():
        out[name] = {"hierarchical": _attempt("hierarchical", extra, stage, hpz_size, names),
                     "flat": _attempt("flat", extra, stage, hpz_size, names)}
    # The trainer's path: hpz.grad_reduce=hierarchical without hpZ (zero3_cpu) is refused at the engine build.
    from zerotrain.trainer import Trainer

    try:
        Trainer(parse_args([*COMMON, "zero=zero3_cpu", "hpz.grad_reduce=hierarchical", f"data.train.0.path={data}",
                            f"run.output_dir={runs}", "run.name=refused", "train.steps=2"]))
        out["trainer_no_hpz"] = {"built": True}
    except Exception as e:  # noqa: BLE001 -- the error is the result
        out["trainer_no_hpz"] = {"built": False, "type": type(e).__name__, "message": str(e),
                                 "is_grad_reduce_error": isinstance(e, grad_reduce.GradReduceConfigError)}
    hpz.uninstall()
    tdist.barrier()
    return out


# ----------------------------------------------------------------------------------------------------------------
# Training runs through the real trainer
# ----------------------------------------------------------------------------------------------------------------


def train(name: str, runs: Path, data: str, overrides: list[str]) -> dict:
    """One trainer run; per-step losses (every step, whatever the log interval), metrics.jsonl records."""
    from zerotrain.trainer import StepCallback, Trainer

    per_step: list[float] = []

    class RecordLoss(StepCallback):  # every step's loss, whatever the log interval
        def on_step_end(self, trainer, step, result):
            per_step.append(result.loss)

    hpz.uninstall()  # a fresh install per run, as in a fresh process
    trainer = Trainer(parse_args([*COMMON, f"data.train.0.path={data}", f"run.output_dir={runs}",
                                  f"run.name={name}", *overrides]), callbacks=[RecordLoss()])
    plan = getattr(trainer.engine.optimizer, grad_reduce.PLAN_ATTR, None)
    start_step = trainer.state.step
    t0 = time.perf_counter()
    rc = trainer.fit()
    seconds = time.perf_counter() - t0
    trainer.engine.destroy()
    hpz.uninstall()
    tdist.barrier()
    records = [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
    return {"rc": rc, "start_step": start_step, "losses": per_step, "records": records, "seconds": seconds,
            "plan": None if plan is None else {"hpz": plan.hpz_size, "groups": plan.num_groups},
            # The trainer logs (and resets) hpZ's counters with every record.
            "hierarchical_grad_reduces": sum(r.get("hpz/hierarchical_grad_reduces", 0) for r in records)}


def reordered_flat_reduce_scatter(input_tensor, output_tensor, group=None, async_op=False, prof=False):
    """Plain ZeRO-3's reduce-scatter with another, equally valid summation order (the tolerance reference): every
    rank's contribution to this rank's partition arrives by an all-to-all over the world and is summed here."""
    import deepspeed.comm as dist

    world = dist.get_world_size(group)
    received = torch.empty_like(input_tensor)
    dist.all_to_all_single(received, input_tensor.contiguous(), group=group)
    torch.sum(received.view(world, output_tensor.numel()), dim=0, out=output_tensor)


def _unordered_plan(build_plan):
    """The negative control in training: hierarchical plans that skip the reordering of the flat buffer."""
    return lambda *args, **kwargs: dataclasses.replace(build_plan(*args, **kwargs), reorder=False)


def parity(runs: Path, data: str) -> dict:
    from deepspeed.runtime.comm import coalesced_collectives

    out = {}
    for precision, reduce in PARITY:
        collective, build_plan = coalesced_collectives._torch_reduce_scatter_fn, grad_reduce.build_plan
        if reduce == "reordered":
            coalesced_collectives._torch_reduce_scatter_fn = reordered_flat_reduce_scatter
        if reduce == "unordered":
            grad_reduce.build_plan = _unordered_plan(build_plan)
        hpz_runs = reduce in ("hierarchical", "unordered")
        try:
            out[f"{precision}-{reduce}"] = train(
                f"{precision}-{reduce}", runs, data,
                [f"train.steps={STEPS}", f"train.precision={precision}",
                 *([] if hpz_runs else ["zero=zero3_cpu"]),  # the reference: plain ZeRO-3
                 f"hpz.grad_reduce={'hierarchical' if hpz_runs else 'flat'}",
                 "train.log_interval=1", "checkpoint.save_final=false", "checkpoint.resume=false"])
        finally:
            coalesced_collectives._torch_reduce_scatter_fn, grad_reduce.build_plan = collective, build_plan
    # Compared with fp32-flat's first steps: contiguous_gradients does not change what is reduced.
    out["nocontig-hierarchical"] = train(
        "nocontig-hierarchical", runs, data,
        ["train.steps=4", "train.precision=fp32", "hpz.grad_reduce=hierarchical", "zero.contiguous_gradients=false",
         "train.log_interval=1", "checkpoint.save_final=false", "checkpoint.resume=false"])
    return out


# ----------------------------------------------------------------------------------------------------------------
# ring: the ring collectives against gloo's, their bytes, and the hierarchical path's first-step check
# ----------------------------------------------------------------------------------------------------------------


def _inputs(kind: str, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(77 + rank())
    if kind == "integer":
        return torch.randint(-4096, 4096, (numel,), generator=g).float()
    t = torch.randn(numel, generator=g)
    return t.bfloat16() if kind == "bf16" else t


def _left_fold(inputs: list[torch.Tensor], group_rank: int, g: int) -> torch.Tensor:
    """The ring's order for chunk ``group_rank``: ((x[c+1] + x[c+2]) + ...) + x[c], on this rank."""
    chunks = [t.view(g, -1)[group_rank] for t in inputs]
    acc = chunks[(group_rank + 1) % g].clone()
    for j in range(2, g + 1):
        acc = acc + chunks[(group_rank + j) % g]
    return acc


def _ring_collectives_vs_native(groups: dict) -> dict:
    import deepspeed.comm as dist

    from zerotrain import ring_collectives

    native_rs = ring_collectives._installed["reduce_scatter_function"]
    native_ag = ring_collectives._installed["all_gather_function"]
    out = {}
    for gname, group in groups.items():
        g, me = tdist.get_world_size(group), tdist.get_rank(group)
        members = grad_reduce.group_ranks(group)
        for kind in ("random", "bf16", "integer"):
            numel = g * 1031
            x = _inputs(kind, numel)
            everyone = [torch.empty_like(x) for _ in range(g)]
            tdist.all_gather(everyone, x, group=group)  # torch's own list all-gather: not the ring
            ring_out = torch.empty(numel // g, dtype=x.dtype)
            ring_collectives.bytes_sent(reset=True)
            ring_collectives.exchanges(reset=True)
            dist.reduce_scatter_fn(ring_out, x.clone(), group=group)
            sent = ring_collectives.bytes_sent(reset=True)
            exchanges = ring_collectives.exchanges(reset=True)
            native_out = torch.empty_like(ring_out)
            native_rs(native_out, x.clone(), op=tdist.ReduceOp.SUM, group=group)
            # DeepSpeed's own layout: the output is this rank's chunk of the input buffer.
            aliased = x.clone()
            dist.reduce_scatter_fn(aliased.view(g, -1)[me], aliased, group=group)
            handle = dist.reduce_scatter_fn(asynced := torch.empty_like(ring_out), x.clone(), group=group,
                                            async_op=True)
            handle.wait()
            gathered = torch.empty(numel * g, dtype=x.dtype)
            dist.allgather_fn(gathered, x, group=group)
            native_gathered = torch.empty_like(gathered)
            native_ag(output_tensor=native_gathered, input_tensor=x, group=group)
            in_place = torch.zeros(numel * g, dtype=x.dtype)
            in_place.view(g, -1)[me].copy_(x)
            dist.allgather_fn(in_place, in_place.view(g, -1)[me], group=group)
            tol = 2e-2 if kind == "bf16" else 1e-5
            out[f"{gname}-{kind}"] = {
                "g": g,
                "rs_equal_native": torch.equal(ring_out, native_out),
                "rs_allclose_native": torch.allclose(ring_out.double(), native_out.double(), rtol=tol, atol=tol),
                "rs_max_diff": float((ring_out.double() - native_out.double()).abs().max()),
                "rs_equal_left_fold": torch.equal(ring_out, _left_fold(everyone, me, g)),
                "rs_aliased_equal": torch.equal(aliased.view(g, -1)[me], ring_out),
                "rs_async_equal": torch.equal(asynced, ring_out),
                "ag_equal_native": torch.equal(gathered, native_gathered),
                "ag_in_place_equal": torch.equal(in_place, native_gathered),
                "rs_sent": {str(k): v for k, v in sent.items()},
                "rs_exchanges": exchanges,
                "rs_expected": {str(members[(me + 1) % g]): (g - 1) * ring_out.numel() * ring_out.element_size()},
            }
    return out


def ring(runs: Path, data: str) -> dict:
    import deepspeed.comm as dist
    from deepspeed.runtime.comm import coalesced_collectives

    from zerotrain import comm_accounting, ring_collectives
    from zerotrain.launch.layout import gather_layout

    hpz.uninstall()
    assert ring_collectives.install("ring") == "ring" and ring_collectives.active()
    # Through ring_collectives.new_group (as zerotrain.hpz.groups makes them): pairs with a twin, so each direction
    # of the exchange has its own connection; and the same pairs made by torch alone (no twin: one connection).
    pairs = [ring_collectives.new_group([0, 1]), ring_collectives.new_group([2, 3])]
    peers = [ring_collectives.new_group([0, 2]), ring_collectives.new_group([1, 3])]
    single = [tdist.new_group([0, 2]), tdist.new_group([1, 3])]
    groups = {"world": None, "hpz_pair": pairs[rank() // 2], "peer_pair": peers[rank() % 2],
              "peer_pair_one_connection": single[rank() % 2]}
    out = {"collectives": _ring_collectives_vs_native(groups)}

    # Bytes: a 4-rank reduce-scatter and all-gather counted by the accounting's ring model vs what the rings sent to
    # a rank of another node.
    layout = gather_layout()
    x = _inputs("random", 4 * 2500)
    comm_accounting.install(layout)
    ring_collectives.bytes_sent(reset=True)
    try:
        dist.reduce_scatter_fn(torch.empty(2500), x.clone())
        dist.allgather_fn(torch.empty(4 * 2500 * 4), x)
        snap = comm_accounting.snapshot_and_reset(all_ranks=True)
    finally:
        comm_accounting.uninstall()
    sent = ring_collectives.bytes_sent(reset=True)
    off_node = sum(v for peer, v in sent.items() if not layout.same_node(peer, rank()))
    total = torch.tensor([float(off_node)], dtype=torch.float64)
    tdist.all_reduce(total)
    out["bytes"] = {"sent_off_node_per_node": total.item() / layout.num_nodes,
                    "ring_model_per_node": comm_accounting.metrics_record(snap, 1, nodes=layout.num_nodes)[
                        "comm/ring_inter_node_bytes_per_node"],
                    "payload": x.numel() * 4}

    # The hierarchical engine's first-step check, and its negative control.
    def first_step(bypass: bool) -> dict:
        hpz.uninstall()
        hpz.install(grad_reduce="hierarchical")
        collective = coalesced_collectives._torch_reduce_scatter_fn
        import deepspeed

        zero = {"stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0,
                "stage3_max_reuse_distance": 0, "zero_hpz_partition_size": 2}
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero,
                  "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
                  "steps_per_print": 10**9}
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                          config=config)
        if bypass:  # what a DeepSpeed whose reduce no longer goes through the patched function would do
            coalesced_collectives._torch_reduce_scatter_fn = hpz_original_reduce_scatter()
        comm_accounting.install(gather_layout())
        try:
            loss = engine(torch.randn(1, 16)).sum()
            engine.backward(loss)
            engine.step()
            result = {"stepped": True}
        except Exception as e:  # noqa: BLE001 -- the error is the result
            result = {"stepped": False, "type": type(e).__name__, "message": str(e)}
        finally:
            coalesced_collectives._torch_reduce_scatter_fn = collective
            snap = comm_accounting.snapshot_and_reset()
            comm_accounting.uninstall()
            engine.destroy()
            hpz.uninstall()
        result["kinds"] = sorted(snap)
        tdist.barrier()
        return result

    out["first_step"] = first_step(bypass=False)
    out["first_step_bypassed"] = first_step(bypass=True)
    ring_collectives.uninstall()

    # hpz.grad_reduce=auto through the trainer's start-up (2x2, hpZ 2: the model says hierarchical saves 1.5x), and
    # without hpZ (plain ZeRO-3: flat, no refusal). Built only: the first-step check is covered above.
    from zerotrain.trainer import Trainer

    for name, zero in (("auto-hpz", "zero3_hpz_cpu"), ("auto-zero3", "zero3_cpu")):
        hpz.uninstall()
        trainer = Trainer(parse_args([*COMMON, f"zero={zero}", "hpz.grad_reduce=auto", "cluster.collectives=ring",
                                      f"data.train.0.path={data}", f"run.output_dir={runs}", f"run.name={name}",
                                      "train.steps=1", "checkpoint.resume=false"]))
        out[name] = {"grad_reduce": trainer.grad_reduce, "collectives": trainer.collectives,
                     "plan": getattr(trainer.engine.optimizer, grad_reduce.PLAN_ATTR, None) is not None}
        trainer.engine.destroy()
        hpz.uninstall()
        ring_collectives.uninstall()
        tdist.barrier()
    return {"per_rank": gather(out)}


def hpz_original_reduce_scatter():
    """DeepSpeed's own ``_torch_reduce_scatter_fn`` (hpz's patch keeps it as the wrapper's ``__wrapped__``)."""
    from deepspeed.runtime.comm import coalesced_collectives

    return coalesced_collectives._torch_reduce_scatter_fn.__wrapped__


# The same run as parity's fp32-hierarchical but for the log interval and the checkpoints: both launches run this
# same command; the first stops at RESUME_STOP (a checkpoint, exit), the relaunch resumes and stops at 2*RESUME_STOP.
RESUME = [f"train.steps={STEPS}", "train.precision=fp32", "hpz.grad_reduce=hierarchical",
          f"train.log_interval={RESUME_LOG_INTERVAL}", f"train.exit_interval={RESUME_STOP}",
          "checkpoint.save_final=false"]


def main(out_path: str, phase: str, data: str, runs_dir: str, comm: list[str]) -> int:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    ds_patches.defer_import_time_compile()  # as the trainer's engine build does (2 CPU s a process)
    runs = Path(runs_dir)
    results: dict = {"seconds": {}}

    def stage(name, fn):
        t0 = time.time()
        try:
            value = fn()
        except Exception:  # noqa: BLE001 -- recorded for the test, and shown in the launch output
            value = {"crashed": traceback.format_exc()[-4000:]}
            print(f"[rank {rank()}] stage {name} crashed:\n{value['crashed']}", file=sys.stderr, flush=True)
        results["seconds"][name] = round(time.time() - t0, 1)
        results[name] = value
        tdist.barrier()
        if rank() == 0:
            Path(out_path + ".tmp").write_text(json.dumps(results))
            os.replace(out_path + ".tmp", out_path)

    if comm:
        import worker_comm

        stage("comm", lambda: worker_comm.run_variants(comm[0], comm[1:]))
    if phase in ("main", "ring"):
        stage("ring", lambda: ring(runs, data))
    if phase == "main":
        stage("unit", unit)
        stage("refusals", lambda: refusals(runs, data))
        stage("parity", lambda: parity(runs, data))
        stage("resume_first", lambda: train("resumed", runs, data, RESUME))
    elif phase == "resume":
        stage("resume_second", lambda: train("resumed", runs, data, RESUME))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5], sys.argv[5:]))
