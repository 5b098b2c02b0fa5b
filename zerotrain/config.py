"""Composing a config: recipes and fragments, ``key=value`` overrides, the "did you mean" hint, save and load.

A run is described by one recipe (``recipes/<name>.yaml``). A recipe names reusable fragments from
``configs/<group>/<name>.yaml`` in its ``defaults`` mapping (model size, ZeRO preset, optimizer, data set,
cluster profile) and overrides whatever it needs. The command line then overrides the result with the same
dotted ``key=value`` grammar everywhere (``train.steps=50``), or swaps a whole fragment (``model=falcon_tiny``).

This module knows no section: it composes against whatever dataclass schema it is given (OmegaConf structured
configs). The run's schema is :class:`zerotrain.run_config.Config`, made of the sections each component declares next
to its code (``zerotrain.models.ModelConfig``, ``zerotrain.engine.OptimConfig``, ...). Everything is checked before
any process group exists: an unknown or misspelt key, a value of the wrong type or not one of an enum's members (with
the closest valid one suggested), a missing required value, and a number outside the range declared beside its field
(:mod:`zerotrain.fields`); then the schema's own checks (``check``) run on the typed object.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from zerotrain import durable
from zerotrain.errors import ConfigError
from zerotrain.fields import check_ranges

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPES_DIR = REPO_ROOT / "recipes"
FRAGMENTS_DIR = REPO_ROOT / "configs"

# Fragment groups a recipe (or the command line) can select by name: configs/<group>/ fills the top-level key <group>.
FRAGMENT_GROUPS = ("model", "data", "zero", "optim", "schedule", "cluster")


def available(directory: Path) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.yaml"))


def did_you_mean(word: str, options: Sequence[str]) -> str:
    """`` Did you mean 'x'?`` for the closest of ``options`` to ``word``, or an empty string."""
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
            f"{group}={name}: no fragment {path.relative_to(REPO_ROOT)}.{did_you_mean(name, options)} "
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
        raise ConfigError(f"recipe={recipe}: no such recipe.{did_you_mean(recipe, options)} "
                          f"Available: {', '.join(options)}")
    return path


def _split_overrides(overrides: Sequence[str]) -> tuple[str | None, dict[str, str], list[str]]:
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
        keys = [str(k) for k in node]
        if part not in keys:
            valid = [f"{prefix}.{k}" if prefix else k for k in keys]
            guess = did_you_mean(".".join(parts[: i + 1]), valid)
            return f"unknown config key '{dotted_key}'.{guess} Valid keys here: {', '.join(sorted(valid))}"
        node = node[part]
    return f"invalid config key '{dotted_key}'"


def _enum_choices(cfg: DictConfig, key: str) -> list[str] | None:
    """The member names of the enum the schema declares for ``key``, or None when it is not an enum field."""
    parent_key, _, leaf = key.rpartition(".")
    try:
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    except OmegaConfBaseException:
        return None
    schema = OmegaConf.get_type(parent) if isinstance(parent, DictConfig) else None
    if schema is None or not dataclasses.is_dataclass(schema):
        return None
    declared = typing.get_type_hints(schema).get(leaf)
    for candidate in (declared, *typing.get_args(declared)):  # Optional[SomeEnum] too
        if isinstance(candidate, type) and issubclass(candidate, enum.Enum):
            return list(candidate.__members__)
    return None


def _bad_value(cfg: DictConfig, key: str, error: OmegaConfBaseException) -> str:
    choices = _enum_choices(cfg, key)
    if choices is not None:
        value = str(getattr(error, "value", ""))
        return f"{key}={value} is not valid.{did_you_mean(value, choices)} Valid: {', '.join(choices)}"
    message = str(getattr(error, "msg", error)).splitlines()[0]
    return f"bad value for '{key}': {message}"


def _merge(base: DictConfig, update: Any, origin: str) -> DictConfig:
    try:
        return typing.cast(DictConfig, OmegaConf.merge(base, update))  # merged over a DictConfig: a DictConfig
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        if "not in struct" in str(e) or "Key '" in str(e) and "not in" in str(e):
            raise ConfigError(f"{origin}: {_unknown_key_message(base, key)}") from None
        raise ConfigError(f"{origin}: {_bad_value(base, key, e)}") from None


def _free_form_parent(cfg: DictConfig, parent_key: str) -> DictConfig | None:
    """The node at ``parent_key`` when it lies inside a free-form mapping (``deepspeed``, ``zero``, ``cluster.env``):
    missing levels below the deepest free-form node that exists are created as empty mappings, so that
    ``deepspeed.flops_profiler.enabled=true`` needs no YAML block. None when ``parent_key`` is not in such a mapping
    (the caller then reports an unknown key the usual way)."""
    if not parent_key:
        return None
    node: Any = cfg
    for part in parent_key.split("."):
        if not isinstance(node, DictConfig):
            return None
        if part not in node:
            if OmegaConf.get_type(node) is not dict:
                return None  # a schema section takes no new keys
            with open_dict(node):
                node[part] = {}
        node = node[part]
    free_form = isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict
    return node if free_form else None


def _declared_section(parent: DictConfig, key: str) -> type | None:
    """The dataclass the schema of ``parent`` declares for ``key`` (``Optional[RopeScaling]`` -> RopeScaling)."""
    schema = OmegaConf.get_type(parent)
    if schema is None or not dataclasses.is_dataclass(schema):
        return None
    declared = typing.get_type_hints(schema).get(key)
    for candidate in (declared, *typing.get_args(declared)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _fill_optional_sections(cfg: DictConfig, parent_key: str) -> None:
    """An optional section left at None (``model.rope_scaling: null``) that an override reaches into
    (``model.rope_scaling.factor=16``) is created with its declared defaults first, as if the YAML had set it."""
    node: Any = cfg
    for part in parent_key.split(".") if parent_key else ():
        if not isinstance(node, DictConfig) or part not in node:
            return
        child = node._get_node(part)
        assert child is not None  # part in node
        if child._is_none():
            section = _declared_section(node, part)
            if section is None:
                return
            node[part] = OmegaConf.structured(section)
        node = node[part]


def _apply_override(cfg: DictConfig, item: str) -> None:
    """``a.b.0.c=value``: the value is parsed with OmegaConf's grammar (numbers, lists, mappings), the key must exist
    (list items by index), and the structured schema checks the type on assignment."""
    key, _, text = item.partition("=")
    origin = f"override '{item}'"
    try:
        value = OmegaConf.from_dotlist([f"value={text}"])["value"]
    except OmegaConfBaseException as e:
        raise ConfigError(f"{origin}: cannot parse the value: {str(e).splitlines()[0]}") from None
    except yaml.YAMLError as e:  # OmegaConf hands the text to YAML: '[0.9' (unbalanced), 'a: b: c', ...
        reason = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{origin}: the value '{text}' of '{key}' is not valid YAML ({reason}); quote a string "
                          f"(key='\"text\"') or write a complete "
                          f"list or mapping, e.g. optim.betas=[0.9,0.95]") from None
    parent_key, _, leaf = key.rpartition(".")
    _fill_optional_sections(cfg, parent_key)
    try:
        parent = _free_form_parent(cfg, parent_key)
    except OmegaConfBaseException as e:  # cluster.env.A.B=1: a mapping of strings holds no mappings
        raise ConfigError(f"{origin}: '{parent_key}' cannot be created as a mapping there: "
                          f"{str(getattr(e, 'msg', e)).splitlines()[0]}") from None
    if parent is None:
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if isinstance(parent, ListConfig) and (not leaf.isdigit() or int(leaf) >= len(parent)):
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
        raise ConfigError(f"{origin}: {_bad_value(cfg, key, e)}") from None


def compose(schema: type, recipe: str | None, overrides: Sequence[str] = (), *, recipe_key: str | None = None,
            check: Callable[[Any], None] | None = None) -> DictConfig:
    """Build a config: ``schema``'s defaults < fragments < recipe body < command-line overrides, then check it.

    ``recipe_key`` (e.g. ``run.recipe``) records which recipe the config came from; ``check`` gets the typed object
    (``OmegaConf.to_object``) after every declared range has been checked, for the schema's own checks.
    """
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
                f"{path}: unknown fragment group '{group}' in defaults.{did_you_mean(group, FRAGMENT_GROUPS)} "
                f"Valid groups: {', '.join(FRAGMENT_GROUPS)}"
            )
    defaults.update(swaps)

    cfg = OmegaConf.structured(schema)
    for group, name in defaults.items():
        cfg = _merge(cfg, {group: _fragment(group, str(name))}, f"configs/{group}/{name}.yaml")
    cfg = _merge(cfg, body, str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path))
    for item in dotted:
        _apply_override(cfg, item)
    if recipe_key:
        OmegaConf.update(cfg, recipe_key, str(recipe))
    typed = to_object(cfg)
    if check is not None:
        check(typed)
    return cfg


def to_object(cfg: DictConfig) -> Any:
    """The typed object of a composed config (dataclass instances, enums), once every value is present and in range."""
    missing = OmegaConf.missing_keys(cfg)
    if missing:
        raise ConfigError(f"required config keys have no value: {', '.join(sorted(missing))}")
    typed = OmegaConf.to_object(cfg)
    check_ranges(typed)
    return typed


# --------------------------------------------------------------------------------------------------------------
# Command-line entry points and persistence
# --------------------------------------------------------------------------------------------------------------


def _as_node(cfg: Any) -> DictConfig:
    return OmegaConf.structured(cfg) if dataclasses.is_dataclass(cfg) else cfg


def to_yaml(cfg: DictConfig | Any) -> str:
    """The fully resolved YAML of a composed config or of its typed object (the same text for both)."""
    return OmegaConf.to_yaml(_as_node(cfg), resolve=True)


def save(cfg: DictConfig | Any, path: Path) -> None:
    """Write the fully resolved config atomically (never a half-written file, no temporary left on a failure);
    raises :class:`~zerotrain.errors.StorageError` when it cannot be written (a full disk, say)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        durable.atomic_write_text(path, to_yaml(cfg))
    except OSError as e:
        raise durable.write_error(e, path) from None


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Plain nested mappings -> ``{"a.b.c": leaf}``; lists are leaves (compared whole)."""
    if not isinstance(data, dict) or not data:
        return {prefix: data} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def differences(old: Any, new: Any) -> dict[str, tuple[Any, Any]]:
    """The dotted keys whose values differ between two configs (typed objects or nodes), with (old, new) values;
    a key missing on one side has ``None`` there."""
    a, b = flatten(as_container(old)), flatten(as_container(new))
    return {key: (a.get(key), b.get(key)) for key in sorted(a.keys() | b.keys()) if a.get(key) != b.get(key)}


def load(schema: type, path: Path) -> DictConfig:
    """Load a config saved by :func:`save` (e.g. from a run directory), validated against today's ``schema``."""
    return _merge(OmegaConf.structured(schema), _read_yaml(Path(path)), str(path))


def load_text(schema: type, text: str, origin: str = "saved config") -> DictConfig:
    """Like :func:`load`, from YAML text (e.g. stored in a checkpoint's metadata)."""
    data = yaml.safe_load(text) or {}
    return _merge(OmegaConf.structured(schema), data, origin)


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
    typed = OmegaConf.to_object(cfg)
    try:
        check_ranges(typed)
    except ConfigError as e:
        raise ConfigError(f"{prog}: {e}") from None
    return typed


def as_container(node: Any) -> Any:
    """Plain Python dicts, lists and strings (enum members by name) from an OmegaConf node or a typed config object,
    e.g. for W&B's run config."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        node = OmegaConf.structured(node)
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    return node
