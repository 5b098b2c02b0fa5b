"""The memory plan (zerotrain/memory_plan.py): its activation rows against what autograd really saves, its totals
against hand-computed values for the tiny recipe, and train.py's --plan and start-up refusal (one process each,
no process group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tools.launcher import PYTHON, run
from zerotrain import memory_plan as mp
from zerotrain import models, run_config
from zerotrain.errors import ConfigError
from zerotrain.launch.world import World
from zerotrain.models import ModelConfig, ModelFamily

GIB = 2**30

# Shapes chosen so that h, kvd, f, a and s are not proportional: a wrong coefficient cannot hide behind another.
LLAMA_GQA = ModelConfig(family="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=176, vocab_size=512, max_seq_len=256)
LLAMA_MHA = ModelConfig(family="llama", hidden_size=96, num_layers=2, num_heads=4, intermediate_size=160,
                        vocab_size=512, max_seq_len=256)
FALCON_7B_STYLE = ModelConfig(family="falcon", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1,
                              vocab_size=512, max_seq_len=256, new_decoder_architecture=False, parallel_attn=True)
FALCON_40B_STYLE = ModelConfig(family="falcon", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                               vocab_size=512, max_seq_len=256, new_decoder_architecture=True)


def saved_bytes_of_last_layer(mc: ModelConfig, seq_len: int, attn_impl: str, masked: bool, dtype: torch.dtype,
                              batch: int = 2) -> int:
    """Bytes autograd saves in the last decoder layer for one training forward: every saved tensor once per
    storage, parameters excluded, attributed by forward pre-hooks (the measurement the formula was fitted on)."""
    torch.manual_seed(0)
    mc = dataclasses.replace(mc, attn_implementation=attn_impl)
    model = models.build_model(mc, "bf16" if dtype == torch.bfloat16 else "fp32").train()  # as training builds it
    base = model.model if mc.family == ModelFamily.llama else model.transformer
    layers = base.layers if mc.family == ModelFamily.llama else base.h
    final_norm = base.norm if mc.family == ModelFamily.llama else base.ln_f
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    scope, per_scope, seen = ["embedding"], {}, set()
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda module, args, i=i: scope.__setitem__(0, i))
    final_norm.register_forward_pre_hook(lambda module, args: scope.__setitem__(0, "head"))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in parameters and key not in seen and storage.nbytes():
            seen.add(key)
            per_scope[scope[0]] = per_scope.get(scope[0], 0) + storage.nbytes()
        return t

    ids = torch.randint(0, mc.vocab_size, (batch, seq_len))
    extra = {}
    if masked:  # a packed batch as the loader makes it: a second document starts at 20 (a per-document mask)
        positions = torch.arange(seq_len)
        extra["position_ids"] = torch.where(positions < 20, positions, positions - 20).expand(batch, seq_len)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids, **extra)
    return per_scope[len(layers) - 1]


CASES = [  # (model, attention, masked, precision); each at two sequence lengths
    (LLAMA_GQA, "sdpa", False, "bf16"), (LLAMA_GQA, "sdpa", True, "bf16"), (LLAMA_GQA, "eager", False, "fp32"),
    (LLAMA_MHA, "sdpa", False, "fp32"), (LLAMA_MHA, "sdpa", True, "fp32"), (LLAMA_MHA, "eager", False, "bf16"),
    (FALCON_7B_STYLE, "sdpa", True, "bf16"), (FALCON_7B_STYLE, "eager", False, "bf16"),
    (FALCON_7B_STYLE, "sdpa", True, "fp32"),
    (FALCON_40B_STYLE, "sdpa", False, "bf16"), (FALCON_40B_STYLE, "eager", False, "fp32"),
]


@pytest.mark.parametrize("mc,attn_impl,masked,precision", CASES,
                         ids=[f"{c[0].family}-{c[0].num_kv_heads}kv-{c[1]}{'-mask' if c[2] else ''}-{c[3]}"
                              for c in CASES])
def test_activation_row_is_what_autograd_saves(mc, attn_impl, masked, precision):
    for seq_len in (48, 80):
        tokens = 2 * seq_len
        measured = saved_bytes_of_last_layer(mc, seq_len, attn_impl, masked, models.torch_dtype(precision))
        planned = tokens * mp.layer_bytes_per_token(mc, seq_len, attn_impl, masked=masked, precision=precision)
        # Llama fits to the byte; Falcon's layers save one 16-byte scalar per layer on top (not per token).
        slack = 0 if mc.family == ModelFamily.llama else 16
        assert 0 <= measured - planned <= slack, (seq_len, measured, planned)


def test_the_falcon_7b_row_has_no_attention_probabilities_once_kv_is_expanded():
    # Stock transformers runs Falcon-7B (71 query heads, 1 K/V head) on the math kernel: 4 a s bytes of fp32
    # probabilities per token, ~45 GiB at 2048 tokens. build_model expands K/V under sdpa, so the row is linear in s.
    falcon_7b = run_config.parse_args(["recipe=paper_falcon_7b"]).model
    row = mp.layer_bytes_per_token(falcon_7b, 2048)
    h, a, f = 4544, 71, 4 * 4544
    assert row == 12 * h + 4 * f + 4 * a + 2 * 2048 + 4
    assert 7 < 32 * 2048 * row / mp.GIB < 9  # 8 GiB (the math kernel's row: 45 GiB)


# ---------------------------------------------------------------------------------------- the plan, by hand


@pytest.fixture(scope="module")
def tiny():
    """tiny_llama as shipped: fp32, 2 nodes x 2 ranks, hpZ 2, micro-batch 4 x 128 packed."""
    return run_config.parse_args(["recipe=tiny_llama"])


H, V, KVD, F, A, L, TOKENS = 64, 2048, 32, 176, 4, 2, 4 * 128
# Untied Llama: embedding + head (2 V h), final norm (h); per layer q, o (h^2 each), k, v (h kvd each), gate, up,
# down (h f each), two norms (h each).
P = 2 * V * H + H + L * (2 * H * H + 2 * H * KVD + 3 * H * F + 2 * H)
# Llama sdpa with the packed batch's block mask, fp32 (measured above): K/V repeated to every head (8h, not 8kvd)
# and the [b, 1, s, s] mask as fp32 (4s).
ROW_FP32 = 32 * H + 8 * H + 16 * F + 4 * A + 8 + 4 * 128


def test_plan_of_the_tiny_recipe_equals_the_hand_computed_terms(tiny):
    p = mp.plan(tiny)
    assert P == 354_624 and p.params.total == P  # our meta-device count; DeepSpeed's model_to_params gives 131 072
    assert p.params.largest_module == V * H  # the embedding
    assert (p.world.nodes, p.world.gpus_per_node, p.hpz_size) == (2, 2, 2)
    gpus = 4
    # DeepSpeed's estimator without offload: 4 x largest layer + 18 P / gpus; fp32 adds 4 P / gpus.
    assert p.term("model states") == 4 * V * H + int(18 * P / gpus) + 4 * P // gpus
    assert p.term("hpZ secondary shard") == 4 * P // 2  # fp32 weights over the hpZ group of 2
    assert p.term("activations") == TOKENS * L * ROW_FP32
    assert p.term("logits and loss") == TOKENS * (12 * H + 12 * V)
    # zero3_hpz_cpu: DeepSpeed's default 5e8 reduce bucket and 1e9 live parameters, capped at the model; prefetch 0.
    assert p.term("buffers") == 4 * P + 4 * P
    assert p.term("reserve") == 0  # a CPU cluster
    assert p.total == sum(t.bytes for t in p.terms)
    # The other column: checkpointing keeps each layer's fp32 input and recomputes one layer at a time.
    assert p.activations_other == TOKENS * (L * 4 * H + ROW_FP32)
    assert p.device_bytes is None and p.fits is None  # local_cpu: device memory 0, not checked


def test_checkpointing_attribute_is_read_when_present(tiny):
    # h10a's train.activation_checkpointing key: read defensively, so the plan follows it once it exists.
    with_key = type("Train", (), {**{k: getattr(tiny.train, k) for k in ("precision", "micro_batch_size",
                                                                         "seq_len")},
                                  "activation_checkpointing": True})()
    cfg = type("Cfg", (), {k: getattr(tiny, k) for k in ("model", "zero", "cluster", "data", "run")})()
    cfg.train = with_key
    p = mp.plan(cfg)
    assert p.checkpointing and p.term("activations") == TOKENS * (L * 4 * H + ROW_FP32)
    assert p.activations_other == TOKENS * L * ROW_FP32


def test_offload_and_bf16_follow_deepspeeds_estimator():
    cfg = run_config.parse_args(["recipe=paper_llama2_7b", "zero=zero3_offload_optimizer"])
    p = mp.plan(cfg)
    P7, largest, layer, gpus = 6_738_415_616, 131_072_000, 202_383_360, 16
    assert p.params.total == P7 and p.params.largest_module == largest and p.params.largest_fetch == layer
    # Only bf16 weights stay on the GPU, and the gathered fetch: a whole decoder layer (train.param_fetch=layer).
    assert p.term("model states") == 4 * layer + int(2 * P7 / gpus)
    assert "largest layer fetched 202,383,360" in mp.describe(p)
    assert p.term("hpZ secondary shard") == 2 * P7 // 8
    assert p.host_bytes_per_node == int(P7 * 16 / 2 * 1.5)
    # DeepSpeed's own unit, every submodule: its largest, the embedding.
    per_module = mp.plan(run_config.parse_args(["recipe=paper_llama2_7b", "zero=zero3_offload_optimizer",
                                                "train.param_fetch=module"]))
    assert per_module.params.largest_fetch == largest
    assert per_module.term("model states") == 4 * largest + int(2 * P7 / gpus)
    assert "largest layer fetched" not in mp.describe(per_module)


def test_launched_world_comes_from_the_launchers_variables():
    from zerotrain.launch.world import World, launched_world

    assert launched_world({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == World(2, 8, launched_world(
        {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}).source)
    assert launched_world({}).gpus == 1


def test_start_up_check_refuses_warns_or_passes():
    tiny = run_config.parse_args(["recipe=tiny_llama", "cluster.device_memory_gib=0.001"])  # 1 MiB: under the plan
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(ConfigError, match=r"exceeds the device.*\n.*\n(.*\n)*.*train.memory_check=warn"):
        mp.check_at_start(tiny, env)
    tiny.train.memory_check = run_config.MemoryCheck.warn
    assert mp.check_at_start(tiny, env).fits is False  # warned, not refused
    tiny.train.memory_check = run_config.MemoryCheck.refuse
    tiny.cluster.device_memory_gib = 1.0  # negative control: the same check passes when the plan fits
    assert mp.check_at_start(tiny, env).fits is True


def _checkpoint(directory, *sizes: int, suffix: str = "safetensors"):
    """A directory of weight files of these sizes (sparse: nothing is written); the plan reads only their sizes."""
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    for i, size in enumerate(sizes):
        with open(directory / f"model-{i + 1:05d}-of-{len(sizes):05d}.{suffix}", "wb") as f:
            f.truncate(size)
    return directory


def test_pretrained_load_row_is_the_checkpoint_once_plus_every_ranks_partition_and_module(tmp_path):
    shards = _checkpoint(tmp_path / "ckpt", 3 * 2**20, 2**20 + 5)
    cfg = run_config.parse_args(["recipe=tiny_llama", f"model.pretrained_path={shards}"])
    p = mp.plan(cfg)  # 2 nodes x 2 ranks, fp32: rank 0's node maps the checkpoint once, whatever its shard count
    assert p.load is not None and p.load.bytes == (4 * 2**20 + 5) + 2 * 4 * (-(-P // 4) + 2 * V * H)
    assert p.host_peak == max(p.load.bytes, p.host_bytes_per_node) == p.load.bytes
    assert p.host_memory_bytes is None and p.host_fits is None  # --plan: cluster.host_memory_gib=0, not checked
    resharded = mp.plan(run_config.parse_args(["recipe=tiny_llama", f"model.pretrained_path="
                                               f"{_checkpoint(tmp_path / 'one', 4 * 2**20 + 5)}"]))
    assert resharded.load is not None and resharded.load.bytes == p.load.bytes  # the shard size does not matter
    legacy = _checkpoint(tmp_path / "bin", 2**20, suffix="bin")  # no safetensors: transformers reads the .bin
    assert mp.checkpoint_bytes(str(legacy), P) == (2**20, f"1 weight file(s) in {legacy}")
    hub_id = mp.plan(run_config.parse_args(["recipe=tiny_llama", "model.pretrained_path=org/absent"]))
    assert hub_id.load is not None and hub_id.load.bytes == 2 * P + 2 * 4 * (-(-P // 4) + 2 * V * H)
    assert mp.plan(cfg, World(1, 4, "test")).load.bytes == (4 * 2**20 + 5) + 4 * 4 * (-(-P // 4) + 2 * V * H)
    assert mp.plan(run_config.parse_args(["recipe=tiny_llama"])).load is None  # from scratch: no load row
    assert "pretrained load" in mp.describe(p) and "host peak" in mp.describe(p)


def test_host_check_refuses_a_load_over_the_nodes_memory_and_passes_under_it(tmp_path):
    huge = _checkpoint(tmp_path / "ckpt", 6 * GIB, 2 * GIB)  # 8 GiB, sparse
    cfg = run_config.parse_args(["recipe=tiny_llama", f"model.pretrained_path={huge}", "cluster.host_memory_gib=4"])
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    with pytest.raises(ConfigError) as refused:
        mp.check_at_start(cfg, env)
    message = str(refused.value)
    for needed in ("of host memory per node (pretrained load) exceeds the node's 4.00 GiB (cluster.host_memory_gib)",
                   "8.00 GiB checkpoint", "rank 0 alone maps the whole 8.00 GiB checkpoint", "fewer ranks per node",
                   "train.memory_check=warn"):
        assert needed in message, needed
    assert "per GPU exceeds the device" not in message  # the device is not the problem
    cfg.train.memory_check = run_config.MemoryCheck.warn
    assert mp.check_at_start(cfg, env).host_fits is False  # warned, not refused
    cfg.train.memory_check = run_config.MemoryCheck.refuse
    cfg.cluster.host_memory_gib = 9.0  # negative control: the same check passes on a node that holds the load
    assert mp.check_at_start(cfg, env).host_fits is True
    cfg.cluster.host_memory_gib = 0  # at start-up: this machine's own memory (MemTotal or the job's cgroup limit)
    at_start = mp.check_at_start(run_config.parse_args(["recipe=tiny_llama"]), env)
    assert at_start.host_memory_bytes and at_start.host_memory_bytes <= mp._meminfo_total()
    assert "MemTotal" in at_start.host_source or "cgroup" in at_start.host_source


def test_host_check_names_offloaded_states_when_they_dominate():
    cfg = run_config.parse_args(["recipe=paper_llama2_7b", "zero=zero3_offload_optimizer",
                                 "model.pretrained_path=org/absent", "cluster.host_memory_gib=64"])
    p = mp.plan(cfg, host=mp.host_memory(cfg.cluster))
    assert p.load is not None and p.host_bytes_per_node > p.load.bytes and p.host_fits is False
    with pytest.raises(ConfigError, match=r"\(training states\) exceeds.*less offload"):
        mp.check_at_start(cfg, {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "RANK": "1"})


def test_train_py_plan_and_refusal_before_any_process_group(tmp_path):
    out = run([PYTHON, "train.py", "recipe=tiny_llama", "cluster.device_memory_gib=2", "--plan"], timeout=300)
    assert out.returncode == 0, out.stderr
    for term in ("model states", "hpZ secondary shard", "activations", "logits and loss", "buffers", "reserve",
                 "total", "with activation checkpointing"):
        assert term in out.stdout
    assert "fits" in out.stdout and "host peak" in out.stdout
    # In a run directory of its own: the demo's (runs/tiny-llama) may hold a finished run, which would say so first.
    refused = run([PYTHON, "train.py", "recipe=tiny_llama", "cluster.device_memory_gib=0.001", "train.steps=1",
                   f"run.output_dir={tmp_path}"], timeout=300, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "error: memory plan" in refused.stderr and "train.memory_check=warn" in refused.stderr
    assert "rendezvous" not in refused.stderr.lower()  # it stopped before distributed start-up
