"""Evaluation inside training must not change the model's mode, autograd or RNG streams."""

from __future__ import annotations

import random

import numpy as np
import torch
from mmlu_testlib import MAX_POSITIONS, MMLU_JSONL, load_tiny

from zerotrain.evaluation import evaluate, load_mmlu


class RandomDrawingModel(torch.nn.Module):
    """Wraps the tiny Llama; every forward draws random numbers and records its context."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.frozen = torch.nn.Linear(2, 2)
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, **kwargs):
        torch.rand(3)
        random.random()
        np.random.rand()
        self.seen.append((self.training, torch.is_grad_enabled()))
        return self.inner(**kwargs)


def draws() -> tuple:
    return random.random(), torch.rand(2).tolist(), float(np.random.rand())


def test_mode_grad_and_rng_are_restored():
    inner, tokenizer = load_tiny()
    model = RandomDrawingModel(inner)
    model.train()
    model.frozen.eval()  # a submodule the trainer keeps in eval mode must stay so
    data = load_mmlu(MMLU_JSONL, subjects=["anatomy"], shots=1, limit_per_subject=3)

    random.seed(1), torch.manual_seed(1), np.random.seed(1)
    expected = draws()
    random.seed(1), torch.manual_seed(1), np.random.seed(1)
    try:
        result = evaluate(model, tokenizer, data, batch_size=2, max_length=MAX_POSITIONS, device="cpu")
        after = draws()
        modes = (model.training, model.inner.training, model.inner.model.layers[0].training)
    finally:
        inner.eval()  # the tiny model is shared with other tests
    assert after == expected

    assert result.micro.total == 3
    assert model.seen and all(seen == (False, False) for seen in model.seen)
    assert modes == (True, True, True)
    assert not model.frozen.training
    assert torch.is_grad_enabled()


def test_restores_eval_mode_too():
    model, tokenizer = load_tiny()
    model.eval()
    data = load_mmlu(MMLU_JSONL, subjects=["anatomy"], shots=0, limit_per_subject=1)
    evaluate(model, tokenizer, data, batch_size=1, max_length=MAX_POSITIONS, device="cpu")
    assert not any(m.training for m in model.modules())
