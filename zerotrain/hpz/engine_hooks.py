"""Hooks on DeepSpeed's engine (and on transformers) that are about *which* engine, not streams.

* ``_configure_zero_optimizer``: run inside the engine's own hpZ size scope
  (per-engine groups, see :mod:`.groups`), then register the engine's
  parameter names for verify messages and a ``load_state_dict`` post-hook that
  drops stale shards (see :mod:`.stale`).
* ``load_checkpoint`` / ``load_module_state_dict``: drop every shard after
  loading -- DeepSpeed's own ``checkpoint_event_epilogue`` only drops the
  shards of trainable parameters, and an evaluation engine has no epilogue.
* ``transformers.PreTrainedModel.resize_token_embeddings``: drop shards after
  resizing (DeepSpeed PR #7130).
"""

from __future__ import annotations

import functools
from typing import Any

from zerotrain.ds_patches import PatchSet

from . import groups, stale, verify

ENGINE_ATTR = "_zt_hpz_registered"


def _is_hpz_engine(engine: Any) -> bool:
    try:
        return engine.zero_optimization_stage() == 3 and engine.zero_hpz_partition_size() > 1
    except Exception:  # a half-built engine: nothing to register
        return False


def _register(engine: Any, patches: PatchSet, fix_stale: bool) -> None:
    if getattr(engine, ENGINE_ATTR, False) or not _is_hpz_engine(engine):
        return
    setattr(engine, ENGINE_ATTR, True)
    verify.register_engine(engine)
    if fix_stale:
        def _drop_shards(module, incompatible_keys) -> None:  # post-hooks must return None
            stale.invalidate_module(module)

        handle = engine.module.register_load_state_dict_post_hook(_drop_shards)
        patches.on_restore(handle.remove)


def install(patches: PatchSet, engine_cls: Any, fix_groups: bool, fix_stale: bool) -> None:
    configure = engine_cls._configure_zero_optimizer

    @functools.wraps(configure)
    def _configure_zero_optimizer(self, *args, **kwargs):
        if fix_groups:
            with groups.configured_size(self.zero_hpz_partition_size()):
                optimizer = configure(self, *args, **kwargs)
        else:
            optimizer = configure(self, *args, **kwargs)
        # self.module is final here; optimizer is assigned by the caller, which we don't need.
        _register(self, patches, fix_stale)
        return optimizer

    patches.replace(engine_cls, "_configure_zero_optimizer", _configure_zero_optimizer)

    if not fix_stale:
        return

    def _after(name: str) -> None:
        original = getattr(engine_cls, name)

        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            if _is_hpz_engine(self):
                stale.invalidate_module(self.module)
            return result

        patches.replace(engine_cls, name, wrapper)

    _after("load_checkpoint")
    _after("load_module_state_dict")

    try:
        from transformers import PreTrainedModel
    except Exception:  # transformers is optional
        return
    resize = PreTrainedModel.resize_token_embeddings

    @functools.wraps(resize)
    def resize_token_embeddings(self, *args, **kwargs):
        result = resize(self, *args, **kwargs)
        stale.invalidate_module(self)
        return result

    patches.replace(PreTrainedModel, "resize_token_embeddings", resize_token_embeddings)
