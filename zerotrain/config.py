"""The run configuration: typed schema, recipe composition and command-line overrides.

A run is described by one recipe (``recipes/<name>.yaml``). A recipe names reusable fragments from
``configs/<group>/<name>.yaml`` in its ``defaults`` mapping (model size, ZeRO preset, optimizer, data set,
cluster profile) and overrides whatever it needs. The command line then overrides the result with the same
dotted ``key=value`` grammar everywhere (``train.steps=50``), or swaps a whole fragment (``model=falcon_tiny``).

Everything is validated against the dataclasses below (OmegaConf structured configs) before any process group
exists: an unknown or misspelt key, or a value of the wrong type, is a :class:`ConfigError` that names the key and
suggests the closest valid one. The DeepSpeed ``zero`` section is DeepSpeed's own ``zero_optimization`` block,
passed through verbatim and validated by DeepSpeed's own pydantic model.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPES_DIR = REPO_ROOT / "recipes"
FRAGMENTS_DIR = REPO_ROOT / "configs"


class ConfigError(ValueError):
    """A configuration problem a user can fix: the message names the key, file or value and what is valid."""


# --------------------------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------------------------


@dataclass
class RunConfig:
    name: str = "run"
    recipe: Optional[str] = None  # filled in by compose(): which recipe this run came from
    # The run directory is <output_dir>/<name>: config, metrics, checkpoints. Relaunching with the same name resumes.
    output_dir: str = "runs"
    seed: int = 1234


@dataclass
class ModelConfig:
    family: str = "llama"  # llama | falcon
    # A local Hugging Face checkpoint directory to fine-tune from; None trains the shape below from scratch.
    pretrained_path: Optional[str] = None
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: Optional[int] = None  # None: multi-head attention (= num_heads)
    intermediate_size: Optional[int] = None  # None: the family's default (Falcon: 4 * hidden)
    vocab_size: int = 32000
    max_seq_len: int = 4096
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # Falcon only: layout of the decoder block (see transformers' FalconConfig).
    parallel_attn: bool = True
    new_decoder_architecture: bool = False
    bias: bool = False
    # Published parameter count of this shape, checked by the tests; None for shapes of our own.
    published_params: Optional[float] = None


@dataclass
class HpzConfig:
    # stock: DeepSpeed <= 0.13.4 (racy, reproduces the failure) | sync: host waits (the paper's fix, DeepSpeed today)
    # | ordered: device-side ordering with events (ours).
    mode: str = "ordered"
    verify: bool = False


@dataclass
class DataSourceConfig:
    path: str = "???"  # a directory written by data/prepare.py
    weight: float = 1.0


@dataclass
class DataConfig:
    kind: str = "pretrain"  # pretrain | sft
    train: list[DataSourceConfig] = field(default_factory=list)
    # Validation set: a prepared directory; None uses the 'valid' split of the first train source if it has one.
    valid: Optional[str] = None
    # sft: pack several examples into one sequence, or pad each to seq_len.
    packing: bool = True


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adam
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass
class ScheduleConfig:
    name: str = "cosine"  # cosine | linear | constant
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine/linear decay to lr * min_lr_ratio at the last step


@dataclass
class TrainConfig:
    steps: int = 1000
    micro_batch_size: int = 1
    grad_accum: int = 1
    seq_len: int = 2048
    precision: str = "bf16"  # bf16 | fp32
    grad_clip: float = 1.0  # 0 disables clipping
    log_interval: int = 10
    eval_interval: int = 0  # 0 disables periodic validation
    eval_batches: int = 8
    nan_policy: str = "stop"  # stop (clear error, last checkpoint kept) | continue (log it, e.g. to record divergence)
    # Save a checkpoint and exit cleanly when step % exit_interval == 0 (Megatron's --exit-interval); 0: never.
    exit_interval: int = 0


@dataclass
class CheckpointConfig:
    interval: int = 0  # steps between checkpoints; 0 only at the end
    keep_last: int = 3
    resume: bool = True  # resume automatically from <run dir>/checkpoints/latest
    save_final: bool = True
    export_hf: bool = False  # also write a Hugging Face directory after the last step
    # Before each save, free space is compared with the last checkpoint's size: warn (and try) | skip the save.
    low_space: str = "warn"
    verify: bool = True  # check each file's CRC32 on resume (each rank reads back the files it loads)


@dataclass
class WandbConfig:
    enabled: bool = True
    project: str = "zerotrain"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None  # default: run.name
    tags: list[str] = field(default_factory=list)
    mode: str = "auto"  # auto (offline without an API key) | online | offline | disabled


@dataclass
class MMLUConfig:
    """MMLU during training (zerotrain.evaluation): every ``interval`` steps and after the last step."""

    enabled: bool = False
    interval: int = 0  # 0: only after the last step
    data: str = "data/mmlu/test.jsonl"  # cais/mmlu (the hub), a local JSONL/parquet file, or a Hendrycks CSV dir
    subjects: list[str] = field(default_factory=list)  # empty: all 57
    limit_per_subject: int = 0  # 0: all questions; a small cap keeps in-training evaluation quick
    shots: int = 5
    batch_size: int = 8


@dataclass
class CommConfig:
    # Count the bytes of every collective, split intra-/inter-node by the real node layout (zerotrain.comm_accounting),
    # logged per step as comm/*. Costs one small all-reduce per log interval.
    accounting: bool = False


@dataclass
class ClusterConfig:
    name: str = "local"
    # Accelerator peak dense TFLOP/s used for MFU; 0 looks the device up in zerotrain.metrics.PEAK_TFLOPS.
    peak_tflops: float = 0.0
    # Environment for the collective library (NCCL_SOCKET_IFNAME, ...); set before the process group is created.
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # DeepSpeed's zero_optimization block, verbatim (validated by DeepSpeed). zero_hpz_partition_size may be 'auto'.
    zero: dict[str, Any] = field(default_factory=lambda: {"stage": 3})
    hpz: HpzConfig = field(default_factory=HpzConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mmlu: MMLUConfig = field(default_factory=MMLUConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


# Fragment groups a recipe (or the command line) can select by name: group -> key in Config.
FRAGMENT_GROUPS = ("model", "data", "zero", "optim", "schedule", "cluster")

CHOICES = {
    "model.family": ("llama", "falcon"),
    "hpz.mode": ("stock", "sync", "ordered"),
    "data.kind": ("pretrain", "sft"),
    "optim.name": ("adamw", "adam"),
    "schedule.name": ("cosine", "linear", "constant"),
    "train.precision": ("bf16", "fp32"),
    "train.nan_policy": ("stop", "continue"),
    "checkpoint.low_space": ("warn", "skip"),
    "wandb.mode": ("auto", "online", "offline", "disabled"),
}


# --------------------------------------------------------------------------------------------------------------
# Composition
# --------------------------------------------------------------------------------------------------------------


def available(directory: Path) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.yaml"))


def _close(word: str, options: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _fragment(group: str, name: str) -> dict:
    directory = FRAGMENTS_DIR / group
    path = directory / f"{name}.yaml"
    if not path.is_file():
        options = available(directory)
        raise ConfigError(
            f"{group}={name}: no fragment {path.relative_to(REPO_ROOT)}.{_close(name, options)} "
            f"Available {group} fragments: {', '.join(options)}"
        )
    return _read_yaml(path)


def _recipe_path(recipe: str) -> Path:
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    path = RECIPES_DIR / f"{recipe}.yaml"
    if not path.is_file():
        options = available(RECIPES_DIR)
        raise ConfigError(f"recipe={recipe}: no such recipe.{_close(recipe, options)} Available: {', '.join(options)}")
    return path


def _split_overrides(overrides: Sequence[str]) -> tuple[Optional[str], dict[str, str], list[str]]:
    """Separate ``recipe=``, fragment swaps (``model=falcon_tiny``) and dotted overrides; reject malformed ones."""
    recipe, swaps, dotted = None, {}, []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key or key != key.strip() or any(c.isspace() for c in key):
            raise ConfigError(
                f"malformed override '{item}': expected key=value, e.g. train.steps=100 or model=llama2_7b"
            )
        if key == "recipe":
            recipe = value
        elif key in FRAGMENT_GROUPS and "." not in key:
            swaps[key] = value
        else:
            dotted.append(item)
    return recipe, swaps, dotted


def _unknown_key_message(cfg: Any, dotted_key: str) -> str:
    """Name the first part of ``dotted_key`` that does not exist, with the closest valid key at that level."""
    parts = dotted_key.split(".")
    node = cfg
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i])
        if isinstance(node, ListConfig):
            if not part.isdigit() or int(part) >= len(node):
                return f"'{prefix}' is a list of {len(node)} item(s); '{part}' is not an index into it"
            node = node[int(part)]
            continue
        if not isinstance(node, DictConfig):
            return f"'{prefix}' is a value, it has no key '{part}'"
        keys = [str(k) for k in node.keys()]
        if part not in keys:
            valid = [f"{prefix}.{k}" if prefix else k for k in keys]
            guess = _close(".".join(parts[: i + 1]), valid)
            return f"unknown config key '{dotted_key}'.{guess} Valid keys here: {', '.join(sorted(valid))}"
        node = node[part]
    return f"invalid config key '{dotted_key}'"


def _merge(base: DictConfig, update: Any, origin: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, update)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        if "not in struct" in str(e) or "Key '" in str(e) and "not in" in str(e):
            raise ConfigError(f"{origin}: {_unknown_key_message(base, key)}") from None
        message = str(getattr(e, "msg", e)).splitlines()[0]
        raise ConfigError(f"{origin}: bad value for '{key}': {message}") from None


def _apply_override(cfg: DictConfig, item: str) -> None:
    """``a.b.0.c=value``: the value is parsed with OmegaConf's grammar (numbers, lists, mappings), the key must exist
    (list items by index), and the structured schema checks the type on assignment."""
    key, _, text = item.partition("=")
    origin = f"override '{item}'"
    try:
        value = OmegaConf.from_dotlist([f"value={text}"])["value"]
    except OmegaConfBaseException as e:
        raise ConfigError(f"{origin}: cannot parse the value: {str(e).splitlines()[0]}") from None
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if isinstance(parent, ListConfig):
        if not leaf.isdigit() or int(leaf) >= len(parent):
            raise ConfigError(f"{origin}: '{parent_key}' is a list of {len(parent)} item(s); '{leaf}' is not an index")
    # Free-form mappings (zero: DeepSpeed's block, checked by DeepSpeed; cluster.env) take new keys; schema
    # sections do not.
    free_form = isinstance(parent, DictConfig) and OmegaConf.get_type(parent) is dict
    if not isinstance(parent, DictConfig) or (leaf not in parent and not free_form):
        raise ConfigError(f"{origin}: {_unknown_key_message(cfg, key)}")
    try:
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value)
        OmegaConf.update(cfg, key, value, merge=True, force_add=free_form)
    except OmegaConfBaseException as e:
        message = str(getattr(e, "msg", e)).splitlines()[0]
        raise ConfigError(f"{origin}: bad value for '{key}': {message}") from None


def compose(recipe: Optional[str], overrides: Sequence[str] = ()) -> DictConfig:
    """Build the full run config: schema defaults < fragments < recipe body < command-line overrides."""
    cli_recipe, swaps, dotted = _split_overrides(overrides)
    recipe = cli_recipe or recipe
    if not recipe:
        raise ConfigError(f"no recipe given: add recipe=<name>. Available: {', '.join(available(RECIPES_DIR))}")
    path = _recipe_path(recipe)
    body = _read_yaml(path)
    defaults = body.pop("defaults", {}) or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{path}: 'defaults' must map fragment groups to names, e.g. {{model: llama2_7b}}")
    for group in defaults:
        if group not in FRAGMENT_GROUPS:
            raise ConfigError(
                f"{path}: unknown fragment group '{group}' in defaults.{_close(group, FRAGMENT_GROUPS)} "
                f"Valid groups: {', '.join(FRAGMENT_GROUPS)}"
            )
    defaults.update(swaps)

    cfg = OmegaConf.structured(Config)
    for group, name in defaults.items():
        cfg = _merge(cfg, {group: _fragment(group, str(name))}, f"configs/{group}/{name}.yaml")
    cfg = _merge(cfg, body, str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path))
    for item in dotted:
        _apply_override(cfg, item)
    cfg.run.recipe = str(recipe)
    validate(cfg)
    return cfg


# --------------------------------------------------------------------------------------------------------------
# Validation beyond types
# --------------------------------------------------------------------------------------------------------------


def validate(cfg: DictConfig) -> None:
    for key, options in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in options:
            raise ConfigError(f"{key}={value} is not valid.{_close(str(value), options)} Valid: {', '.join(options)}")
    missing = OmegaConf.missing_keys(cfg)
    if missing:
        raise ConfigError(f"required config keys have no value: {', '.join(sorted(missing))}")
    if not cfg.data.train:
        raise ConfigError("data.train is empty: name at least one prepared data directory (see data/prepare.py)")
    positive = ["train.steps", "train.micro_batch_size", "train.grad_accum", "train.seq_len", "train.log_interval"]
    for key in positive:
        if OmegaConf.select(cfg, key) <= 0:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be a positive integer")
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    if cfg.checkpoint.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1")
    validate_zero(OmegaConf.to_container(cfg.zero, resolve=True))
    validate_model(OmegaConf.to_object(cfg.model))


def validate_model(model: ModelConfig) -> None:
    """Build the Hugging Face config of the shape: transformers' own checks (ranges, head counts) run here."""
    from zerotrain.models import hf_config  # deferred: importing transformers is slow

    if model.hidden_size % model.num_heads:
        raise ConfigError(
            f"model.hidden_size={model.hidden_size} is not divisible by model.num_heads={model.num_heads}"
        )
    if model.num_kv_heads and model.num_heads % model.num_kv_heads:
        raise ConfigError(f"model.num_heads={model.num_heads} is not divisible by "
                          f"model.num_kv_heads={model.num_kv_heads} (grouped-query attention)")
    try:
        hf_config(model)
    except Exception as e:  # transformers raises its own validation error types
        detail = " ".join(str(e).split())
        raise ConfigError(f"invalid model section for {model.family}: {detail}") from None


def validate_zero(zero: dict) -> None:
    """Check the zero section with DeepSpeed's own schema, so a misspelt DeepSpeed key fails before launch."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # deferred: importing deepspeed is slow

    checked = dict(zero)
    if checked.get("zero_hpz_partition_size") == "auto":
        checked["zero_hpz_partition_size"] = 1
    try:
        DeepSpeedZeroConfig(**checked)
    except Exception as e:  # pydantic.ValidationError; message lists every bad field
        fields = list(DeepSpeedZeroConfig.model_fields)
        aliases = [f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias]
        hints = []
        for error in getattr(e, "errors", lambda: [])():
            name = str(error["loc"][0]) if error.get("loc") else ""
            if error.get("type") == "extra_forbidden":
                hints.append(f"unknown key 'zero.{name}'.{_close(name, fields + aliases)}")
            else:
                hints.append(f"zero.{name}: {error.get('msg')} (got {error.get('input')!r})")
        detail = "; ".join(hints) or str(e)
        raise ConfigError(f"invalid DeepSpeed zero_optimization section: {detail}") from None


# --------------------------------------------------------------------------------------------------------------
# Command-line entry points and persistence
# --------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> DictConfig:
    """``train.py`` arguments -> validated config. ``--help`` style flags are handled by the caller."""
    return compose(None, argv)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def save(cfg: DictConfig, path: Path) -> None:
    """Write the fully resolved config atomically (never a half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(to_yaml(cfg))
    tmp.replace(path)


def load(path: Path) -> DictConfig:
    """Load a config saved by :func:`save` (e.g. from a run directory), validated against today's schema."""
    return _merge(OmegaConf.structured(Config), _read_yaml(Path(path)), str(path))


def load_text(text: str, origin: str = "saved config") -> DictConfig:
    """Like :func:`load`, from the YAML text stored in a checkpoint's metadata."""
    data = yaml.safe_load(text) or {}
    return _merge(OmegaConf.structured(Config), data, origin)


def parse_dataclass_args(schema: type, argv: Sequence[str], prog: str) -> Any:
    """The same ``key=value`` grammar for the other commands (data/prepare.py, ...): returns a validated object."""
    if dataclasses.is_dataclass(schema) is False:
        raise TypeError(f"{schema} is not a dataclass")
    cfg = OmegaConf.structured(schema)
    for item in argv:
        key, sep, _ = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{prog}: malformed argument '{item}': expected key=value")
        cfg = _merge(cfg, OmegaConf.from_dotlist([item]), f"{prog}: argument '{item}'")
    missing = OmegaConf.missing_keys(cfg)
    if missing:
        raise ConfigError(f"{prog}: required arguments missing: {', '.join(sorted(missing))}")
    return OmegaConf.to_object(cfg)


def as_container(node: Any) -> Any:
    """Plain Python dicts/lists from an OmegaConf node (for DeepSpeed's config and W&B)."""
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node
