"""Recipes and overrides: every shipped recipe composes and validates; bad input fails early with a helpful message."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest
import yaml
from omegaconf import OmegaConf

from tools.launcher import PYTHON, run
from zerotrain import config, run_config
from zerotrain.config import ConfigError
from zerotrain.fields import Range, bounded, declared_range
from zerotrain.models import ModelConfig, count_parameters

RECIPES = config.available(config.RECIPES_DIR)
MODEL_FRAGMENTS = config.available(config.FRAGMENTS_DIR / "model")


def test_there_are_recipes_for_both_families():
    families = {run_config.compose(r).model.family for r in RECIPES}
    assert families == {"llama", "falcon"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_recipe_composes_and_validates(recipe):
    cfg = run_config.compose(recipe)
    assert cfg.run.recipe == recipe
    assert cfg.train.seq_len <= cfg.model.max_seq_len
    assert cfg.data.train, "a recipe must name its data"
    # The saved form reloads to the same config (the run directory's config.yaml is the source of truth).
    assert run_config.load_text(config.to_yaml(cfg)) == cfg


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_recipe_fits_its_planned_cluster_and_deepspeed_parses_its_config(recipe):
    """What `train.py recipe=X --plan` checks: the memory plan on the recipe's cluster (cluster.nodes x
    gpus_per_node) fits cluster.device_memory_gib (the tiny CPU recipes: nothing to check against); and the
    DeepSpeed config the trainer builds for that world is accepted by DeepSpeed's own parser."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from zerotrain import engine, memory_plan

    cfg = run_config.parse_args([f"recipe={recipe}"])
    plan = memory_plan.plan(cfg)
    assert plan.fits is not False, memory_plan.describe(plan)
    assert (plan.fits is None) == (cfg.cluster.accelerator == "cpu")
    world = plan.world.nodes * plan.world.gpus_per_node
    ds = engine.deepspeed_config(cfg.zero, micro_batch_size=cfg.train.micro_batch_size,
                                 grad_accum=cfg.train.grad_accum, grad_clip=cfg.train.grad_clip,
                                 precision=cfg.train.precision, seed=cfg.run.seed, dp_size=world,
                                 hpz_size=plan.hpz_size, extra=cfg.deepspeed)
    assert ds["train_batch_size"] == cfg.train.micro_batch_size * cfg.train.grad_accum * world
    # Outside a process group DeepSpeed's parser sees a world of one: the batch is checked per rank.
    parsed = DeepSpeedConfig({**ds, "train_batch_size": ds["train_batch_size"] // world})
    assert parsed.zero_optimization_stage == 3 and parsed.gradient_accumulation_steps == cfg.train.grad_accum
    assert parsed.zero_config.zero_hpz_partition_size == plan.hpz_size


@pytest.mark.parametrize("nodes", [8, 16, 32])
def test_falcon_180b_sft_fits_8_16_and_32_nodes_of_8_80gb_gpus(nodes):
    """docs/recipes.md's Falcon-180B rows; negative control: without the optimizer offload it does not fit 8."""
    from zerotrain import memory_plan

    plan = memory_plan.plan(run_config.parse_args(["recipe=falcon_180b_sft", f"cluster.nodes={nodes}"]))
    assert plan.fits and plan.hpz_size == 8 and plan.checkpointing, memory_plan.describe(plan)
    if nodes == 8:
        resident = memory_plan.plan(run_config.parse_args(["recipe=falcon_180b_sft", "zero=zero3_hpz"]))
        assert resident.fits is False


@pytest.mark.parametrize("fragment", MODEL_FRAGMENTS)
def test_model_shapes_match_their_published_parameter_counts(fragment):
    raw = yaml.safe_load((config.FRAGMENTS_DIR / "model" / f"{fragment}.yaml").read_text())
    model: ModelConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))
    n = count_parameters(model)  # on the meta device: a 180B model costs no memory
    if model.published_params is None:
        assert n < 10_000_000, "only tiny test shapes may go without a published size"
        return
    # Llama-2 sizes are published exactly (6.74B, 13.02B, 68.98B); Falcon's nominally (7B, 40B, 180B).
    tolerance = 0.005 if model.family == "llama" else 0.05
    assert abs(n / model.published_params - 1) < tolerance, f"{fragment}: {n:,} vs {model.published_params:,.0f}"


def test_llama2_70b_uses_grouped_query_attention():
    cfg = run_config.compose("tiny_llama", ["model=llama2_70b", "train.seq_len=4096"])
    assert cfg.model.num_kv_heads == 8 and cfg.model.num_heads == 64


def test_overrides_reach_the_config_with_their_types():
    cfg = run_config.compose("tiny_llama", ["train.steps=7", "optim.lr=1e-4", "optim.betas=[0.9,0.99]",
                                            "zero.zero_hpz_partition_size=4", "hpz.mode=sync", "model=falcon_tiny",
                                            "cluster.env.NCCL_SOCKET_IFNAME=ens1f0"])
    assert cfg.train.steps == 7 and cfg.optim.lr == pytest.approx(1e-4)
    assert list(cfg.optim.betas) == [0.9, 0.99]
    assert cfg.zero.zero_hpz_partition_size == 4 and cfg.hpz.mode == "sync"
    assert cfg.model.family == "falcon"
    assert cfg.cluster.env.NCCL_SOCKET_IFNAME == "ens1f0"  # free-form mappings take new keys


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.stepz=5", "unknown config key 'train.stepz'. Did you mean 'train.steps'?"),
        ("trian.steps=5", "Did you mean 'train'?"),
        ("train.steps=many", "bad value for 'train.steps'"),
        ("train.steps", "malformed override 'train.steps'"),
        ("model=llama2_7bb", "Did you mean 'llama2_7b'?"),
        ("hpz.mode=fast", "hpz.mode=fast is not valid"),
        ("zero.zero_hpz_partition_sise=2", "unknown key 'zero.zero_hpz_partition_sise'. Did you mean "
                                           "'zero_hpz_partition_size'?"),
        ("zero.stage=7", "zero.stage"),
        ("recipe=tiny_lama", "Did you mean 'tiny_llama'?"),
        ("train.seq_len=100000", "exceeds model.max_seq_len"),
        ("model.initializer_range=2.0", "initializer_range"),
        ("model.num_kv_heads=3", "not divisible by model.num_kv_heads=3"),
        # Unbalanced YAML: YAML's own error (a traceback, exit 1) without the catch in _apply_override.
        ("optim.betas=[0.9", "override 'optim.betas=[0.9': the value '[0.9' of 'optim.betas' is not valid YAML "
                             "(expected ',' or ']', but got '<stream end>'); quote a string"),
        ("zero.reduce_bucket_size={a: [1", "override 'zero.reduce_bucket_size={a: [1': the value '{a: [1' of "
                                           "'zero.reduce_bucket_size' is not valid YAML"),
    ],
)
def test_bad_overrides_are_named_with_a_suggestion(override, expected):
    with pytest.raises(ConfigError) as err:
        run_config.compose("tiny_llama", [override])
    assert expected in str(err.value)


def test_malformed_override_exits_nonzero_before_any_process_group(tmp_path):
    proc = run([PYTHON, "train.py", "recipe=tiny_llama", f"run.output_dir={tmp_path}", "train.stepz=3"],
               check=False, timeout=120)
    assert proc.returncode == 2
    assert "Did you mean 'train.steps'?" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir()), "nothing may be written for a run that never started"


def test_missing_data_directory_is_a_clear_error(tmp_path):
    proc = run([PYTHON, "train.py", "recipe=tiny_llama", f"run.output_dir={tmp_path}",
                f"data.train=[{{path: {tmp_path}/nowhere}}]"], check=False, timeout=120)
    assert proc.returncode == 2
    assert f"{tmp_path}/nowhere" in proc.stderr and "data/prepare.py" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_help_lists_recipes():
    proc = run([PYTHON, "train.py", "--help"], timeout=60)
    assert "tiny_llama" in proc.stdout and "recipe=" in proc.stdout


def test_saved_config_is_loaded_against_the_schema(tmp_path):
    cfg = run_config.compose("tiny_falcon", ["train.steps=3"])
    config.save(cfg, tmp_path / "config.yaml")
    assert run_config.load(tmp_path / "config.yaml") == cfg
    (tmp_path / "bad.yaml").write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match="train.stepz"):
        run_config.load(tmp_path / "bad.yaml")


# --------------------------------------------------------------------------------------------------------------
# Ranges, declared beside each field (zerotrain/fields.py) and checked at compose time by one walker
# --------------------------------------------------------------------------------------------------------------

NUMBERS = (int, float)


def numeric_fields(schema: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, type]]:
    """(dotted key, field, number type) of every number or list of numbers in the schema, nested sections and lists
    of sections included (item 0 of a list: the key tiny_llama's recipe has)."""
    found = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        declared = hints[f.name]
        args = [a for a in typing.get_args(declared) if a is not type(None)]
        inner = args[0] if typing.get_origin(declared) in (list, typing.Union, types.UnionType) and args else declared
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(inner):
            found += numeric_fields(inner, f"{key}.0." if typing.get_origin(declared) is list else f"{key}.")
        elif inner in NUMBERS:
            found.append((key, f, inner))
    return found


def out_of_range_values(spec: Range, number: type) -> list[str]:
    """Override values just outside each declared bound."""
    below = [spec.ge - 1 if number is int else spec.ge - 0.5] if spec.ge is not None else []
    below += [spec.gt] if spec.gt is not None else []
    above = [spec.le + 1 if number is int else spec.le + 0.5] if spec.le is not None else []
    above += [spec.lt] if spec.lt is not None else []
    return [str(v) for v in below + above]


RUN_NUMBERS = numeric_fields(run_config.Config)


def test_the_schema_walk_finds_the_numbers():
    keys = {key for key, _, _ in RUN_NUMBERS}
    assert {"optim.lr", "optim.betas", "checkpoint.interval", "train.eval_interval", "data.train.0.weight",
            "model.num_kv_heads", "run.seed"} <= keys


def test_the_schema_walk_finds_a_number_without_a_declared_range():
    @dataclasses.dataclass
    class Section:
        checked: int = bounded(1, ge=1)
        forgotten: float = 0.5

    assert {key: declared_range(f) is not None for key, f, _ in numeric_fields(Section)} == {"checked": True,
                                                                                             "forgotten": False}


@pytest.mark.parametrize("key", [key for key, _, _ in RUN_NUMBERS])
def test_every_numeric_field_declares_its_range(key):
    _, f, _ = next(item for item in RUN_NUMBERS if item[0] == key)
    spec = declared_range(f)
    assert spec is not None and spec.bounds_numbers, f"{key}: declare its range with zerotrain.fields.bounded(...)"


@pytest.mark.parametrize("key", [key for key, f, _ in RUN_NUMBERS if declared_range(f)])
def test_out_of_range_values_are_rejected_naming_key_and_range(key):
    _, f, number = next(item for item in RUN_NUMBERS if item[0] == key)
    spec = declared_range(f)
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    for value in out_of_range_values(spec, number):
        # A list of numbers is overridden whole, its first item out of range.
        text = "[" + ",".join([value, *map(str, default[1:])]) + "]" if isinstance(default, list) else value
        with pytest.raises(ConfigError) as err:
            run_config.compose("tiny_llama", [f"{key}={text}"])
        assert f"{key}=" in str(err.value) and spec.describe() in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optim.lr=-1", "optim.lr=-1.0 is out of range: it must be >= 0"),
        ("optim.betas=[0.9]", "optim.betas=[0.9] has 1 item(s); it must have exactly 2"),
        ("optim.betas=[0.9,1.5]", "item 1 (1.5) must be in [0, 1)"),
        ("checkpoint.interval=-1", "checkpoint.interval=-1 is out of range: it must be >= 0"),
        ("train.eval_interval=-5", "train.eval_interval=-5 is out of range: it must be >= 0"),
        ("data.train=[]", "data.train=[] has 0 item(s); it must have at least 1: name at least one prepared data"),
        ("train.nan_policy=stopp", "train.nan_policy=stopp is not valid. Did you mean 'stop'? Valid: stop, continue"),
    ],
)
def test_values_out_of_range_are_rejected_at_compose_time(override, expected):
    with pytest.raises(ConfigError) as err:
        run_config.compose("tiny_llama", [override])
    assert expected in str(err.value)


def test_without_the_range_walker_these_values_compose(monkeypatch):
    # Negative control of the test above: the walker, not some other check, is what rejects them.
    monkeypatch.setattr(config, "check_ranges", lambda typed: None)
    for override in ("optim.lr=-1", "optim.betas=[0.9]", "checkpoint.interval=-1", "train.eval_interval=-5"):
        run_config.compose("tiny_llama", [override])


@pytest.mark.parametrize("override", ["optim.lr=0", "optim.betas=[0.0,0.999]", "checkpoint.interval=0",
                                      "train.eval_interval=5", "schedule.min_lr_ratio=1", "run.seed=4294967295"])
def test_values_at_the_edge_of_their_range_are_accepted(override):
    key, _, text = override.partition("=")
    composed = run_config.compose("tiny_llama", [override])
    assert config.as_container(OmegaConf.select(composed, key)) == yaml.safe_load(text)



def test_an_unknown_grad_reduce_names_the_key_and_the_choices():
    with pytest.raises(ConfigError, match=r"hpz\.grad_reduce.*flat.*hierarchical"):
        run_config.compose("tiny_llama", ["hpz.grad_reduce=tree"])


def test_the_typed_config_saves_the_same_yaml_as_the_composed_one():
    for recipe in RECIPES:
        cfg = run_config.compose(recipe)
        assert config.to_yaml(config.to_object(cfg)) == config.to_yaml(cfg), recipe


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.rope_scaling.factor=0.5"], "model.rope_scaling.factor=0.5 is out of range: it must be >= 1"),
        (["model.rope_scaling.high_freq_factor=0.5"], "must exceed model.rope_scaling.low_freq_factor=1.0"),
    ],
)
def test_llama3_rope_scaling_is_validated(overrides, expected):
    base = ["model=llama3_tiny"] if overrides[0].startswith("model.") else []
    with pytest.raises(ConfigError) as err:
        run_config.compose("tiny_llama", base + overrides)
    assert expected in str(err.value)


def test_llama3_tiny_composes_with_its_rope_scaling_and_tied_embeddings():
    cfg = run_config.compose("tiny_llama", ["model=llama3_tiny"])
    assert cfg.model.rope_scaling.factor == 32.0 and cfg.model.tie_word_embeddings
