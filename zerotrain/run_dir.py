"""Checks of the run directory before anything is started or written: can it be written, is the run finished, does
the new config fit the checkpoint it would resume from.

``train.py`` runs :func:`preflight` after the config is composed and before any process group, model or file
exists, so a relaunch that cannot work (or has nothing to do) leaves the run directory exactly as it was:

* the output directory must be a writable directory, or creatable under one (:func:`check_writable`);
* a relaunch with keys changed that a resume cannot honour (the model's shape, the optimizer, the data, ...) is
  refused, naming them; the keys in :data:`MAY_CHANGE_ON_RESUME` may change (:func:`check_resumable`);
* a run whose latest checkpoint is at ``train.steps`` (or beyond) is finished: it says so and nothing is rewritten;
* a run with a checkpoint resumes only on a data set with its tokenizer
  (:func:`zerotrain.run_tokenizer.check_relaunch`).

The trainer checks the rest (shard and tokenizer checksums, the checkpoint's CRC32s) before it writes
``config.yaml``, ``deepspeed_config.json`` and ``tokenizer/``: nothing in the run directory is created or changed by
a launch that fails a check.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import yaml

from zerotrain import checkpoint, config, run_config, run_tokenizer
from zerotrain.errors import CheckpointError, ConfigError, StorageError

# Keys (or whole sections) a resumed run may change: how long it runs, what it logs, evaluates and keeps, where it
# runs, and how it computes and communicates the same thing (attention kernel, recomputation, hpZ's shard and gradient
# paths). Everything else shapes the state the checkpoint holds (model, optimizer, schedule, data order, batch).
MAY_CHANGE_ON_RESUME = (
    "run.output_dir", "run.name", "run.recipe",  # where the run directory is: a copied or moved one resumes too
    "train.steps", "train.log_interval", "train.eval_interval", "train.eval_batches", "train.exit_interval",
    "train.nan_policy", "train.activation_checkpointing", "model.attn_implementation", "data.valid",
    "hpz", "checkpoint", "wandb", "mmlu", "comm", "cluster",
)


# The split of the global batch may change with the number of ranks (a resume on fewer ranks after losing a node),
# as long as the global batch itself stays the checkpoint's: zerotrain.checkpoint.universal checks that, naming the fix.
BATCH_SPLIT_KEYS = ("train.micro_batch_size", "train.grad_accum")


def run_directory(cfg: Any) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def _may_change(key: str) -> bool:
    return any(key == allowed or key.startswith(allowed + ".") for allowed in MAY_CHANGE_ON_RESUME)


def check_writable(run_dir: Path) -> None:
    """The run directory is a writable directory, or can be created (with its missing parents) under one."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    blocker = next((p for p in [existing, *existing.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise StorageError(f"run directory {run_dir}: {blocker} is a file, not a directory; choose another "
                           f"run.output_dir (or run.name)")
    if os.access(existing, os.W_OK | os.X_OK):
        return
    why = ("a read-only file system" if os.statvfs(existing).f_flag & os.ST_RDONLY
           else "not writable by this user")
    what = f"{existing} is {why}" if existing == run_dir else f"cannot create it: its parent {existing} is {why}"
    raise StorageError(f"run directory {run_dir}: {what}; choose a writable run.output_dir")


def _latest_meta(root: Path) -> Optional[tuple[Path, dict[str, Any]]]:
    """The latest checkpoint's directory and metadata; None when there is none or it is unusable (the trainer
    reports an unusable one when it tries to resume)."""
    try:
        tag = checkpoint.latest_tag(root)
        if tag is None:
            return None
        return root / tag, checkpoint.read_meta(root / tag, verify_rank=None)
    except CheckpointError:
        return None


def check_resumable(cfg: Any, tag_dir: Path, saved_yaml: str, saved_world_size: Optional[int] = None) -> None:
    """Raise :class:`ConfigError` naming every key that differs from the checkpoint's config and cannot change on
    resume. With ``saved_world_size`` the split of the global batch (:data:`BATCH_SPLIT_KEYS`) may change when the
    global batch stays the same (:func:`zerotrain.checkpoint.check_global_batch` refuses otherwise)."""
    try:
        changed = config.differences(run_config.load_text(saved_yaml, origin=str(tag_dir)), cfg)
    except ConfigError:  # saved under an older schema (a key since removed): compare the keys both configs have
        old, new = config.flatten(yaml.safe_load(saved_yaml) or {}), config.flatten(config.as_container(cfg))
        changed = {key: (old[key], new[key]) for key in sorted(old.keys() & new.keys()) if old[key] != new[key]}
    refused = {key: values for key, values in changed.items() if not _may_change(key)}
    if saved_world_size is not None and set(refused) & set(BATCH_SPLIT_KEYS):
        from zerotrain.checkpoint import GlobalBatch, check_global_batch, saved_global_batch
        from zerotrain.launch.world import launched_world

        saved = saved_global_batch({"config": saved_yaml, "world_size": saved_world_size})
        check_global_batch(tag_dir, saved, GlobalBatch(cfg.train.micro_batch_size, cfg.train.grad_accum,
                                                       launched_world().gpus))
        refused = {key: values for key, values in refused.items() if key not in BATCH_SPLIT_KEYS}
    if not refused:
        return
    listed = "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in refused.items())
    allowed = [key for key in changed if key not in refused]
    also = f" (also changed, which is allowed: {', '.join(allowed)})" if allowed else ""
    raise ConfigError(
        f"run.name={cfg.run.name} resumes from {tag_dir}, but these keys differ from the config it was trained "
        f"with and cannot change on resume: {listed}{also}. Nothing was written. Restore them to continue the run, "
        f"or start a new one (another run.name; model.pretrained_path=<an export of this run> to start from its "
        f"weights). Keys that may change on resume: {', '.join(MAY_CHANGE_ON_RESUME)}")


def preflight(cfg: Any) -> Optional[str]:
    """All of the above, in order, reading only. Returns a message when the run is already finished (nothing to
    do), None when it should start or resume; raises when it cannot."""
    run_dir = run_directory(cfg)
    check_writable(run_dir)
    if not cfg.checkpoint.resume:
        return None
    latest = _latest_meta(run_dir / "checkpoints")
    if latest is None:
        return None
    tag_dir, meta = latest
    if meta.get("config"):
        check_resumable(cfg, tag_dir, meta["config"], meta.get("world_size"))
    if meta["step"] < cfg.train.steps:
        run_tokenizer.check_relaunch(cfg.data.train[0].path, run_dir, latest)
        return None
    return (f"run {run_dir} is finished: its latest checkpoint {tag_dir} is at step {meta['step']} "
            f"(train.steps={cfg.train.steps}). Nothing was written; raise train.steps to train further, or choose "
            f"another run.name for a new run")
