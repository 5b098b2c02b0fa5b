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
from zerotrain.models import ModelConfig, ModelFamily

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
    P7, largest, gpus = 6_738_415_616, 131_072_000, 16
    assert p.params.total == P7 and p.params.largest_module == largest
    assert p.term("model states") == 4 * largest + int(2 * P7 / gpus)  # only bf16 weights stay on the GPU
    assert p.term("hpZ secondary shard") == 2 * P7 // 8
    assert p.host_bytes_per_node == int(P7 * 16 / 2 * 1.5)


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


def test_train_py_plan_and_refusal_before_any_process_group(tmp_path):
    out = run([PYTHON, "train.py", "recipe=tiny_llama", "cluster.device_memory_gib=2", "--plan"], timeout=300)
    assert out.returncode == 0, out.stderr
    for term in ("model states", "hpZ secondary shard", "activations", "logits and loss", "buffers", "reserve",
                 "total", "with activation checkpointing"):
        assert term in out.stdout
    assert "fits" in out.stdout
    # In a run directory of its own: the demo's (runs/tiny-llama) may hold a finished run, which would say so first.
    refused = run([PYTHON, "train.py", "recipe=tiny_llama", "cluster.device_memory_gib=0.001", "train.steps=1",
                   f"run.output_dir={tmp_path}"], timeout=300, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "error: memory plan" in refused.stderr and "train.memory_check=warn" in refused.stderr
    assert "rendezvous" not in refused.stderr.lower()  # it stopped before distributed start-up
