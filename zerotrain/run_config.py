"""The run's config: the components' sections composed into one schema, and the checks that span sections.

Each section is declared next to the code that uses it; this module only puts them together under their keys, adds
the run's own two sections (``run``: which run; ``train``: the loop's shape), and checks what no single section can
(``train.seq_len`` within ``model.max_seq_len``) or what needs a component's library (the model shape through
transformers, the ``zero`` block through DeepSpeed). Composition, overrides and persistence are
:mod:`zerotrain.config`'s.

==============  ======================================================  ===============================================
key             section                                                 used by
==============  ======================================================  ===============================================
``run``         :class:`RunConfig` (here)                               the trainer (run directory, seed)
``model``       :class:`zerotrain.models.ModelConfig`                   building the model
``data``        :class:`zerotrain.data.loader.DataConfig`               the data loaders
``zero``        DeepSpeed's ``zero_optimization`` block, verbatim       DeepSpeed (checked by ``engine.validate_zero``)
``deepspeed``   other top-level DeepSpeed keys, verbatim                DeepSpeed (``engine.validate_deepspeed_keys``)
``hpz``         :class:`zerotrain.hpz.config.HpzConfig`                 ``zerotrain.hpz.install``
``optim``       :class:`zerotrain.engine.OptimConfig`                   the optimizer
``schedule``    :class:`zerotrain.schedule.ScheduleConfig`              the learning-rate schedule
``train``       :class:`TrainConfig` (here)                             the loop, the engine's batch, validation
``checkpoint``  :class:`zerotrain.checkpoint.config.CheckpointConfig`   saving and resuming
``wandb``       :class:`zerotrain.loggers.WandbConfig`                  the metrics logger
``mmlu``        :class:`zerotrain.evaluation.training_hook.MMLUConfig`  MMLU during training
``comm``        :class:`zerotrain.comm_accounting.CommConfig`           communication accounting
``cluster``     :class:`zerotrain.distributed.ClusterConfig`            process-group environment, MFU's peak
``profile``     :class:`zerotrain.profiling.ProfileConfig`              profiler traces, CUDA memory snapshots
==============  ======================================================  ===============================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from zerotrain import config
from zerotrain.attention import AttnImplementation
from zerotrain.checkpoint.config import CheckpointConfig
from zerotrain.comm_accounting import CommConfig
from zerotrain.data.loader import DataConfig
from zerotrain.distributed import ClusterConfig
from zerotrain.engine import OptimConfig, resolve_impl, validate_deepspeed_keys, validate_zero
from zerotrain.errors import ConfigError
from zerotrain.evaluation.training_hook import MMLUConfig
from zerotrain.fields import bounded
from zerotrain.hpz.config import HpzConfig
from zerotrain.loggers import WandbConfig
from zerotrain.models import ModelConfig, ParamFetch, validate_model
from zerotrain.profiling import ProfileConfig
from zerotrain.schedule import ScheduleConfig

RECIPE_KEY = "run.recipe"


class Precision(StrEnum):
    bf16 = "bf16"  # bfloat16 weights and matmuls (DeepSpeed's bf16 mode); fp32 master weights in the optimizer
    fp32 = "fp32"


# "continue" is a keyword, so the members are given by name: stop raises a clear error (exit code 3, the last
# checkpoint kept); continue logs the step and goes on, e.g. to record a diverging curve.
NanPolicy = StrEnum("NanPolicy", [("stop", "stop"), ("continue", "continue")])


class LossReduction(StrEnum):
    token = "token"  # every trained token of the optimizer step weighs the same, over micro-batches and ranks
    micro_batch = "micro_batch"  # the mean over each micro-batch's tokens, then the mean of those means


class MemoryCheck(StrEnum):
    refuse = "refuse"  # a plan over the device's or a node's memory stops train.py (exit 2), before any process group
    warn = "warn"  # logged, and the run starts
    off = "off"  # no plan at start-up


@dataclass
class RunConfig:
    """The ``run`` section: which run this is and where it lives."""

    name: str = "run"
    """The run directory is <output_dir>/<name>; relaunching with the same name resumes."""
    recipe: str | None = None
    """Filled in by compose(): the recipe this run came from."""
    output_dir: str = "runs"
    """Parent of the run directory (config, metrics, checkpoints, W&B offline run)."""
    seed: int = bounded(1234, ge=0, le=2**32 - 1)
    """Seeds Python, NumPy and torch on every rank (model initialisation agrees) and the data order."""


@dataclass
class TrainConfig:
    """The ``train`` section: how many steps of what batch, in which precision, and what happens along the way."""

    steps: int = bounded(1000, ge=1)
    """Optimizer steps of the whole run (a resumed run continues to this)."""
    micro_batch_size: int = bounded(1, ge=1)
    """Sequences per rank per forward pass."""
    grad_accum: int = bounded(1, ge=1)
    """Micro-batches per optimizer step; the global batch is micro_batch_size * grad_accum * data-parallel ranks."""
    seq_len: int = bounded(2048, ge=1)
    """Tokens per sequence; at most model.max_seq_len."""
    precision: Precision = Precision.bf16
    """bf16 | fp32."""
    grad_clip: float = bounded(1.0, ge=0)
    """Clip the global gradient norm to this; 0 disables clipping."""
    log_interval: int = bounded(10, ge=1)
    """Steps per logged line (loss and times averaged over them), and how often the loop waits on the device: the
    steps' losses are reduced over ranks only then (and at checkpoints). A non-finite step gets a record of its own,
    written at the next log step."""
    eval_interval: int = bounded(0, ge=0)
    """Steps between validation-loss evaluations (and after the last step); 0 disables validation."""
    eval_batches: int = bounded(8, ge=1)
    """Validation batches per evaluation: the same first ones every time."""
    nan_policy: NanPolicy = NanPolicy.stop
    """stop | continue, on a non-finite loss. stop acts at the next log step (losses are reduced there, not every
    step) and never saves a checkpoint past it: a checkpoint between log steps reduces the pending losses first."""
    exit_interval: int = bounded(0, ge=0)
    """Save a checkpoint and exit cleanly when step % exit_interval == 0 (Megatron's --exit-interval); 0: never."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input for backward and recompute the layer there (~1/3 more compute, the
    saved activations cut to 2*hidden bytes per token per layer in bf16; see docs/paper.md)."""
    param_fetch: ParamFetch = ParamFetch.layer
    """layer | module: ZeRO-3's unit of gathering. layer: each decoder layer's parameters in one coalesced
    all-gather when the layer starts (forward, and backward from the hpZ shards), hooks on layers only; module:
    DeepSpeed's default, an all-gather and hooks per submodule (every Linear and norm). Same arithmetic; layer
    issues ~1/7 of the all-gathers (fewer latency-bound collectives on slow links) and holds one whole layer
    gathered at a time (the memory plan counts it). Measured: benchmarks/train_throughput.py, docs/paper.md."""
    loss_reduction: LossReduction = LossReduction.token
    """token | micro_batch: how the loss averages over the trained tokens (labels != -100) of an optimizer step.
    token: the mean over all of them, whatever the split into micro-batches, accumulation steps and ranks;
    micro_batch: each micro-batch's own mean, then averaged (what a plain per-forward mean gives)."""
    memory_check: MemoryCheck = MemoryCheck.refuse
    """refuse | warn | off: what train.py does at start-up when the memory plan (zerotrain.memory_plan) exceeds
    cluster.device_memory_gib, or its host row (a pretrained load, offloaded states) a node's memory
    (cluster.host_memory_gib; 0: the node's own). refuse exits with code 2 before any process group; warn starts
    anyway."""

    def log_due(self, step: int) -> bool:
        return step % self.log_interval == 0 or step == self.steps

    def exit_due(self, step: int) -> bool:
        return bool(self.exit_interval) and step % self.exit_interval == 0 and step != self.steps


@dataclass
class Config:
    """A whole run, as ``recipes/<name>.yaml`` + fragments + overrides compose it."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    zero: dict[str, Any] = field(default_factory=lambda: {"stage": 3})
    """DeepSpeed's zero_optimization block, verbatim (checked by DeepSpeed); zero_hpz_partition_size may be 'auto'
    (devices per node)."""
    deepspeed: dict[str, Any] = field(default_factory=dict)
    """Other top-level DeepSpeed config keys, merged into the built config (communication_data_type,
    wall_clock_breakdown, flops_profiler, zero_force_ds_cpu_optimizer, ...), checked by DeepSpeed's own parser;
    the keys our sections own (batch sizes, zero_optimization, bf16, optimizer, ...) are refused."""
    hpz: HpzConfig = field(default_factory=HpzConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mmlu: MMLUConfig = field(default_factory=MMLUConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


def validate(cfg: Config) -> None:
    """What no single field's type or range can say (those are checked before this runs)."""
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    validate_zero(cfg.zero)
    validate_deepspeed_keys(cfg.deepspeed)
    resolve_impl(cfg.optim, cfg.zero, cfg.deepspeed)  # an optimizer impl that cannot work with the zero section
    validate_model(cfg.model)  # also: is the attention implementation installed?
    if (cfg.model.attn_implementation == AttnImplementation.flash_attention_2 and cfg.data.packing
            and cfg.train.micro_batch_size > 1):
        # transformers takes flash-attention's varlen path (documents kept apart) only at batch size 1.
        raise ConfigError("model.attn_implementation=flash_attention_2 with data.packing=true needs "
                          f"train.micro_batch_size=1 (got {cfg.train.micro_batch_size}): transformers keeps packed "
                          "documents apart under flash attention only at batch size 1. Raise train.grad_accum "
                          "instead, or use model.attn_implementation=sdpa")


def compose(recipe: str | None, overrides: Sequence[str] = ()) -> DictConfig:
    """The run's config from a recipe and ``key=value`` overrides, every key, type, range and section checked."""
    return config.compose(Config, recipe, overrides, recipe_key=RECIPE_KEY, check=validate)


def parse_args(argv: Sequence[str]) -> Config:
    """``train.py`` arguments -> the validated, typed run config. ``--help`` is handled by the caller."""
    return config.to_object(compose(None, argv))


def load(path: Path) -> DictConfig:
    """A run directory's ``config.yaml``, against today's schema."""
    return config.load(Config, path)


def load_text(text: str, origin: str = "saved config") -> DictConfig:
    """A config's YAML text (e.g. stored with a checkpoint), against today's schema."""
    return config.load_text(Config, text, origin)
