"""Resuming on a different number of ranks: DeepSpeed's universal checkpoint, made from ours, and the repairs its
load needs.

A ZeRO-3 checkpoint holds each rank's partition of the flattened parameter and optimizer groups, so it loads only on
the world size that wrote it. DeepSpeed's *universal* checkpoint (``deepspeed.checkpoint.ds_to_universal``) holds
every parameter's fp32 value and Adam moments whole, one file each, and an engine built with
``"checkpoint": {"load_universal": true}`` cuts its own partitions out of them, on any world size.

    python -m zerotrain.checkpoint_convert runs/tiny-llama           # latest -> runs/tiny-llama/checkpoints/universal/
    python -m zerotrain.checkpoint_convert runs/big/checkpoints/step_00001000 --workers 16

:func:`prepare_resume` (collective, every rank, before the engine is built; :func:`zerotrain.checkpoint.plan_resume`
calls it) decides whether a resume needs the copy:

1. no checkpoint, or one written by this many ranks: nothing to do (the ordinary, bitwise-exact resume);
2. the global batch (``train.micro_batch_size`` x ``train.grad_accum`` x ranks) must be the checkpoint's, or the
   resume is refused with the override that keeps it (fewer ranks: more accumulation);
3. the universal copy of the latest checkpoint (``checkpoints/universal/<tag>``) is used when it was made from that
   very checkpoint; otherwise each rank checks the CRC32 of its share of the source files, and rank 0 converts
   (``checkpoint.convert_on_resize=false`` refuses instead, naming the command above). The other ranks wait by
   polling a one-integer all-reduce, so a conversion longer than the collective timeout is not an error;
4. it returns True: the engine is built to read the copy, :func:`zerotrain.checkpoint.execute_resume` loads it
   (each rank checking the CRC32 of its share of the copy's files) and calls :func:`repair`, which undoes the
   defects of DeepSpeed 0.19.8's load of it (without it the resumed run optimises differently from the run that
   saved; ``tests/test_resume_resize.py`` keeps a control with the repair switched off).

What carries over: the weights, Adam moments and step counts, the learning-rate schedule (DeepSpeed's files); step,
tokens and the W&B run id (``meta.json``); the data position: the loader's state counts the samples of all ranks
together and the sample order does not depend on the world size (:mod:`zerotrain.data.loader`), so it is the same
on every rank and serves every rank of the new world. The RNG states are per rank (on the tiny Llama they differ
between ranks) and do not map onto another world: every new rank takes old rank 0's, which changes nothing while no
model draws random numbers in training (dropout is 0 in every shipped one). The conversion checks the loader states
agree (a checkpoint whose ranks differ is refused) and records whether the RNG states did. What changes is the order
of summation (another split of each step's micro-batches over ranks, other partition boundaries), so the loss curve
continues within float tolerance, not bitwise; ``tests/test_resume_resize.py`` measures it.

hpZ is not part of a checkpoint: its secondary shards are rebuilt from the primary partitions by the first forward
pass, and ``zero_hpz_partition_size`` is resolved against the new world's node layout (it must divide the new ranks
per node; ``auto`` follows them).

Cost: the conversion reads every shard and writes about 12 bytes per parameter twice (fragments, then the merged
copy; the fragments are deleted), on one node: about 830 GB for a 70B model. At that size run the command above with
``--workers`` before relaunching rather than holding every node of the job while rank 0 converts. The next
checkpoint saved removes ``universal/``: it served the one resume that needed it.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Optional, TypeVar, cast

import numpy as np
import torch
import yaml

from zerotrain import durable
from zerotrain.checkpoint import sharded
from zerotrain.checkpoint.layout import META, OURS, RANK_STATE, latest_tag, rank_file, universal_dir
from zerotrain.distributed import all_agree, gather_objects
from zerotrain.ds_patches import require_supported
from zerotrain.errors import CheckpointError, ZerotrainError

log = logging.getLogger("zerotrain")

POLL_S = 1.0  # how often waiting ranks ask whether rank 0 has finished converting
T = TypeVar("T")


# ----------------------------------------------------------------------------------------------------------------
# The global batch
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GlobalBatch:
    micro_batch_size: int
    grad_accum: int
    ranks: int

    @property
    def sequences(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.ranks

    def describe(self) -> str:
        return (f"{self.sequences} sequences (train.micro_batch_size={self.micro_batch_size} x "
                f"train.grad_accum={self.grad_accum} x {self.ranks} ranks)")


def saved_global_batch(meta: dict[str, Any]) -> GlobalBatch:
    """The global batch a checkpoint was trained with, from its saved config."""
    train = yaml.safe_load(meta["config"])["train"]
    return GlobalBatch(int(train["micro_batch_size"]), int(train["grad_accum"]), int(meta["world_size"]))


def check_global_batch(tag_dir: Path, saved: GlobalBatch, new: GlobalBatch) -> None:
    """Refuse a resume that would change the global batch, naming the override that keeps it."""
    if saved.sequences == new.sequences:
        return
    total = saved.sequences
    fixes = []
    if total % (new.micro_batch_size * new.ranks) == 0:
        fixes.append(f"train.grad_accum={total // (new.micro_batch_size * new.ranks)}")
    if total % (new.grad_accum * new.ranks) == 0:
        fixes.append(f"train.micro_batch_size={total // (new.grad_accum * new.ranks)}")
    fix = (f"relaunch with {' or '.join(fixes)}" if fixes else
           f"{total} sequences do not split evenly over {new.ranks} ranks: relaunch on a number of ranks that "
           f"divides {total}")
    raise CheckpointError(
        f"checkpoint {tag_dir} was trained with a global batch of {saved.describe()}; this run has "
        f"{new.describe()}. Resuming would change the optimisation. Keep the global batch: {fix}")


# ----------------------------------------------------------------------------------------------------------------
# Converting (one process)
# ----------------------------------------------------------------------------------------------------------------


def _same(a: Any, b: Any) -> bool:
    """Deep equality of saved states (tensors, arrays, tuples, dicts)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def shared_rank_state(tag_dir: Path, world_size: int) -> tuple[dict[str, Any], bool]:
    """(the per-rank state every rank of a new world takes, whether the old ranks' RNG states all agreed).

    The loader's state is global (the same on every rank by design); a checkpoint whose ranks disagree on it cannot
    be resumed on another world size, and is refused."""
    states = [torch.load(rank_file(tag_dir, r), weights_only=False) for r in range(world_size)]
    first = states[0]
    for rank, state in enumerate(states[1:], start=1):
        if not _same(state["loader"], first["loader"]):
            raise CheckpointError(
                f"checkpoint {tag_dir}: rank {rank}'s data-loader state {state['loader']} differs from rank 0's "
                f"{first['loader']}; the data position is not known for another world size. Resume on "
                f"{world_size} ranks")
    return first, all(_same(state["rng"], first["rng"]) for state in states[1:])


def _meta_crc(tag_dir: Path) -> int:
    return durable.file_crc32(tag_dir / OURS / META)


def is_current(target: Path, source: Path) -> bool:
    """Whether ``target`` is a complete universal copy made from checkpoint ``source`` as it is now (a tag saved
    again, e.g. after ``latest`` was moved back, gets a new copy)."""
    try:
        meta = json.loads((target / OURS / META).read_text())
        return meta["universal"]["source_meta_crc32"] == _meta_crc(source)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _ds_to_universal(tag_dir: Path, out: Path, workers: int) -> None:
    from deepspeed.checkpoint import ds_to_universal

    ds_to_universal.main(argparse.Namespace(
        input_folder=str(tag_dir), output_folder=str(out), num_extract_workers=workers,
        num_merge_workers=workers, keep_temp_folder=False, strict=True, inject_missing_state=False))


def convert(tag_dir: Path, workers: int = 1, verify: bool = True) -> Path:
    """Write the universal copy of checkpoint ``tag_dir`` (``<root>/step_*``) to ``<root>/universal/<tag>`` and
    return it; a copy already made from this checkpoint is kept. One process, no process group.

    ``verify``: check the CRC32 of every source file first (the distributed resume has its ranks share that check
    and passes False). ``workers`` > 1: DeepSpeed's extraction and merge run in that many processes."""
    tag_dir = Path(tag_dir)
    root = tag_dir.parent
    meta = sharded.read_meta(tag_dir)
    target = universal_dir(root, tag_dir.name)
    if is_current(target, tag_dir):
        log.info("%s is already the universal copy of %s", target, tag_dir)
        return target
    started = time.perf_counter()
    if verify:
        sharded.read_meta(tag_dir, verify_rank=0, world_size=1)  # one process: every file
    rank_state, rng_agreed = shared_rank_state(tag_dir, meta["world_size"])
    with durable.staged_directory(target) as staging:
        _ds_to_universal(tag_dir, staging, workers)
        (staging / OURS).mkdir()
        files: dict[str, dict[str, int]] = {}
        with durable.checksummed_file(staging / OURS / RANK_STATE) as f:
            torch.save(rank_state, cast(IO[bytes], f))  # a binary file object; typeshed's RawIOBase is no IO
        for path in sorted(p for p in staging.rglob("*") if p.is_file()):  # DeepSpeed's writes: hashed from disk
            files[str(path.relative_to(staging))] = {"bytes": path.stat().st_size, "crc32": durable.file_crc32(path)}
        seconds = time.perf_counter() - started
        universal = {"source": tag_dir.name, "source_world_size": meta["world_size"],
                     "source_meta_crc32": _meta_crc(tag_dir), "rng_states_agreed": rng_agreed,
                     "seconds": round(seconds, 3)}
        copy = {**{k: v for k, v in meta.items() if k != "files"}, "universal": universal, "files": files}
        durable.atomic_write_text(staging / OURS / META, json.dumps(copy, indent=1))
    # ds_to_universal points <output>/../latest_universal at the staging name; point it at the real one, so that
    # DeepSpeed's own loader, given <root>/universal, finds the copy.
    durable.atomic_write_text(target.parent / "latest_universal", target.name)
    log.info("converted %s (%d ranks) to the universal checkpoint %s in %.1f s%s", tag_dir, meta["world_size"],
             target, seconds, "" if rng_agreed else "; the ranks' RNG states differed: every rank takes rank 0's")
    return target


# ----------------------------------------------------------------------------------------------------------------
# Repairing DeepSpeed 0.19.8's load of the copy (every rank, right after the engine loaded it)
# ----------------------------------------------------------------------------------------------------------------


# Keys of a torch optimizer's param group that choose a kernel, not a hyperparameter: they belong to the run that
# resumes (a run saved on CPUs and resumed on GPUs must not keep the CPU's foreach path, nor the other way round).
KERNEL_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def step_device(group: dict[str, Any], param: torch.Tensor) -> torch.device:
    """The device torch's Adam/AdamW keeps a parameter's ``step`` on (``Adam._init_group``, torch 2.11-2.13): the
    parameter's device for a capturable or fused group (the fused CUDA kernel refuses a CPU ``step``, pytorch
    #104767), the CPU otherwise (torch hosts it there on purpose, to save a kernel launch per increment)."""
    if group.get("capturable") or group.get("fused"):
        return param.device
    return torch.device("cpu")


def restore_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]],
                   keep: tuple[str, ...] = KERNEL_FLAGS) -> None:
    """Put every saved group's hyperparameters back into the optimizer's group of the same index, except
    ``params`` and the ``keep`` keys, which stay this run's."""
    for group, values in zip(optimizer.param_groups, saved):
        group.update({key: value for key, value in values.items() if key != "params" and key not in keep})


def separate_steps(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter's state its own ``step`` tensor (a copy, same dtype) on :func:`step_device`.

    The states are walked, not the groups: between steps DeepSpeed's ZeRO-3 leaves the groups' ``params`` lists
    empty (it puts each sub-group's flat partition in for that sub-group's step only), so a walk of the groups would
    find no parameter and leave the shared ``step`` in place. A state whose group cannot be found takes the kernel
    flags any group has (a fused or capturable group needs its ``step`` on the parameter's device)."""
    groups = optimizer.param_groups
    any_group = {flag: any(g.get(flag) for g in groups) for flag in ("capturable", "fused")}
    for param, state in optimizer.state.items():
        if isinstance(state.get("step"), torch.Tensor):
            group = next((g for g in groups if any(p is param for p in g["params"])), any_group)
            state["step"] = state["step"].clone().to(step_device(group, param))


def repair(engine, universal: Path) -> None:
    """Undo the defects of DeepSpeed 0.19.8's ZeRO-3 universal load (``load_hp_checkpoint_state_from_checkpoint_
    dir_stage3``) that change the optimisation after a resume, or break its first step on GPUs; measured on the tiny
    Llama, 4 -> 2 ranks, the curve drifts by 8e-3 in 4 steps with them and stays within 5e-7 (one ulp) of the
    uninterrupted run without (``tests/test_resume_resize.py``):

    - it copies the *first* parameter group's hyperparameters into every group, so the no-decay group (norms,
      biases) comes back with ``weight_decay=0.1``; the copy holds every group's values, put back here, except the
      kernel choices (:data:`KERNEL_FLAGS`), which stay this run's;
    - it gives every partition's Adam state one shared ``step`` tensor, which torch's Adam increments in place, once
      per partition stepped: with two groups the bias correction then runs two steps ahead per step. Each partition
      gets its own copy here;
    - that ``step`` is on the CPU (``ds_to_universal`` saved it from the CPU), which torch's fused CUDA AdamW refuses
      at the first step; each copy goes where torch itself would put it (:func:`step_device`)."""
    require_supported("zerotrain.checkpoint.universal.repair", "ZeRO-3 universal-checkpoint load "
                      "(load_hp_checkpoint_state_from_checkpoint_dir_stage3)",
                      "resume on the number of ranks that saved the checkpoint")
    saved = torch.load(universal / "zero" / "optimizer_state.pt", weights_only=False)
    groups = saved.get("optimizer_state_dict", saved).get("param_groups")
    optimizer = engine.optimizer.optimizer  # the torch optimizer under ZeRO-3's partitioning
    if not groups or len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"universal checkpoint {universal} holds {len(groups or [])} optimizer parameter groups, this run's "
            f"optimizer has {len(optimizer.param_groups)}: the optimizer's configuration changed since the "
            f"checkpoint was saved")
    restore_groups(optimizer, groups)
    separate_steps(optimizer)


# ----------------------------------------------------------------------------------------------------------------
# Resuming (every rank)
# ----------------------------------------------------------------------------------------------------------------


def _rank0_decides(value: T) -> T:
    """Rank 0's value on every rank (so that every rank takes the same branch)."""
    return gather_objects(value)[0]


def _on_rank0_while_others_wait(rank: int, work: Callable[[], T], what: str) -> Optional[T]:
    """Run ``work`` on rank 0 (in a thread) while every rank polls a tiny all-reduce until it is done; an error
    there is raised on every rank. Waiting in a barrier instead would hit the collective timeout (30 minutes) on a
    conversion that takes longer."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zt-convert") if rank == 0 else None
    future = executor.submit(work) if executor else None
    try:
        while not all_agree(future.done() if future else True):
            time.sleep(POLL_S)
    finally:
        if executor:
            executor.shutdown(wait=True)
    error = future.exception() if future else None
    if isinstance(error, ZerotrainError):
        text = str(error)
    elif error is not None:
        text = f"{what} failed on rank 0 ({type(error).__name__}: {error}); nothing was written"
    else:
        text = None
    text = _rank0_decides(text)
    if text is not None:
        raise CheckpointError(text) from error
    return future.result() if future else None


def prepare_resume(root: Path, rank: int, world_size: int, micro_batch_size: int, grad_accum: int, *,
                   convert_on_resize: bool = True, verify: bool = True) -> bool:
    """Collective, before the engine is built: whether resuming from ``<root>/latest`` reads a universal checkpoint
    (then the DeepSpeed config needs ``"checkpoint": {"load_universal": true}``), which this call makes if needed.
    Raises :class:`CheckpointError` on every rank when the resume cannot go ahead (see the module docstring)."""
    root = Path(root)
    tag = _rank0_decides(latest_tag(root) if root.is_dir() else None)
    if tag is None:
        return False
    tag_dir = root / tag
    meta = sharded.read_meta_on_all_ranks(tag_dir, rank, world_size, verify=False)  # presence and sizes
    if meta["world_size"] == world_size:
        return False
    check_global_batch(tag_dir, saved_global_batch(meta), GlobalBatch(micro_batch_size, grad_accum, world_size))
    target = universal_dir(root, tag)
    if not _rank0_decides(is_current(target, tag_dir)):
        if not convert_on_resize:
            raise CheckpointError(
                f"checkpoint {tag_dir} was written by {meta['world_size']} ranks, this run has {world_size}, and "
                f"checkpoint.convert_on_resize=false. Convert it first: python -m zerotrain.checkpoint_convert "
                f"{root.parent} (or set checkpoint.convert_on_resize=true), then relaunch")
        if verify:  # the conversion reads every file: each rank checks its share first
            sharded.read_meta_on_all_ranks(tag_dir, rank, world_size, verify=True)
        _on_rank0_while_others_wait(rank, lambda: convert(tag_dir, verify=False),
                                    f"converting {tag_dir} to a universal checkpoint")
    if rank == 0:
        log.info("resuming %s (%d ranks) on %d ranks from its universal copy %s", tag_dir, meta["world_size"],
                 world_size, target)
    return True
