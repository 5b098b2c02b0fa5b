"""Activation checkpointing keeps only each decoder layer's input for backward, and changes no number.

Saved activations are counted exactly (``torch.autograd.graph.saved_tensors_hooks``, by storage, parameters left
out) with benchmarks/activation_memory.py's counter, on tiny Llama and Falcon-7B-like models in one process (what
DeepSpeed changes is where parameters live, not what is saved). The 4-rank ZeRO-3 + hpZ runs are in
tests/test_training_variants.py.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from tools.launcher import REPO
from zerotrain import models

SHAPES = {
    "llama": dict(family="llama", num_kv_heads=2, intermediate_size=176),
    "falcon_multi_query": dict(family="falcon", num_kv_heads=1),
}
BATCH, SEQ, HIDDEN = 2, 32, 64


def _benchmark():
    spec = importlib.util.spec_from_file_location("activation_memory", REPO / "benchmarks" / "activation_memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["activation_memory"] = module
    spec.loader.exec_module(module)
    return module


def config(shape: str) -> models.ModelConfig:
    return models.ModelConfig(hidden_size=HIDDEN, num_layers=2, num_heads=4, vocab_size=256, max_seq_len=64,
                              **SHAPES[shape])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_checkpointed_layers_save_only_their_input(shape):
    bench = _benchmark()
    without = bench.measure(config(shape), "fp32", BATCH, SEQ, checkpointing=False)
    with_ckpt = bench.measure(config(shape), "fp32", BATCH, SEQ, checkpointing=True)
    layer_input = BATCH * SEQ * HIDDEN * 4  # the fp32 hidden state entering the layer
    assert with_ckpt == [layer_input] * len(with_ckpt), with_ckpt
    assert all(w > 8 * layer_input for w in without), without  # negative control: every intermediate kept


@pytest.mark.parametrize("shape", list(SHAPES))
def test_checkpointing_gives_bitwise_the_same_loss_and_gradients(shape):
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = models.build_model(config(shape), "fp32", activation_checkpointing=checkpointing).train()
        assert model.is_activation_checkpointing == checkpointing
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append([loss.detach()] + [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
