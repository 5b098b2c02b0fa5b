"""Saved-activation memory per decoder layer, with and without train.activation_checkpointing.

What autograd keeps for backward is counted exactly: every tensor a forward saves passes through
``torch.autograd.graph.saved_tensors_hooks``; its storage is counted once (views share it), parameters are left
out, and each tensor is attributed to the decoder layer running when it was saved (forward pre-hooks). One warm-up
step runs first. Plain models, no DeepSpeed (ZeRO-3 does not change activations), bf16, CPU.

    python benchmarks/activation_memory.py            # the table in docs/paper.md
    python benchmarks/activation_memory.py --quick    # a smaller shape, seconds
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from zerotrain import models


class SavedActivations:
    """Bytes autograd saves per decoder layer during the forward passes run inside :meth:`counting`."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.layers = _decoder_layers(model)
        self.by_layer = [0] * len(self.layers)
        self._current: int | None = None
        self._seen: set[int] = set()
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if self._current is not None and key not in self._params and key not in self._seen and storage.nbytes():
            self._seen.add(key)
            self.by_layer[self._current] += storage.nbytes()
        return tensor

    @contextlib.contextmanager
    def counting(self):
        def enter(index):
            return lambda module, args: setattr(self, "_current", index)

        handles = [layer.register_forward_pre_hook(enter(i)) for i, layer in enumerate(self.layers)]
        handles.append(self.layers[-1].register_forward_hook(lambda m, a, o: setattr(self, "_current", None)))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for handle in handles:
                handle.remove()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    base = model.model if hasattr(model, "model") else model.transformer
    return list(base.layers if hasattr(base, "layers") else base.h)


def measure(cfg: models.ModelConfig, precision: str, batch: int, seq: int, checkpointing: bool) -> list[int]:
    """Saved bytes of each decoder layer for one training forward of ``batch`` x ``seq`` tokens."""
    torch.manual_seed(0)
    model = models.build_model(cfg, precision, activation_checkpointing=checkpointing).train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()  # warm-up: lazily created caches are not activations
    model.zero_grad(set_to_none=True)
    counter = SavedActivations(model)
    with counter.counting():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return counter.by_layer


SHAPES = {
    # Llama-2 proportions (SwiGLU width 8/3 h rounded to 256), grouped-query attention
    "llama h1024": models.ModelConfig(family="llama", hidden_size=1024, num_layers=2, num_heads=16, num_kv_heads=4,
                                      intermediate_size=2816, vocab_size=1024, max_seq_len=512),
    # Falcon-7B's layout: multi-query (one K/V head), parallel attention/MLP
    "falcon-7b-like h1024": models.ModelConfig(family="falcon", hidden_size=1024, num_layers=2, num_heads=16,
                                               num_kv_heads=1, vocab_size=1024, max_seq_len=512),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="hidden 256, seq 128")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seq = 128 if args.quick else 512
    print(f"saved activations per decoder layer, bf16, batch 1, seq {seq}, sdpa")
    print(f"{'shape':<22} {'without (MB)':>13} {'with (MB)':>10} {'reduction':>10} {'with / (2h bytes/token)':>24}")
    for name, cfg in SHAPES.items():
        if args.quick:
            cfg = models.ModelConfig(**{**cfg.__dict__, "hidden_size": 256, "num_heads": 4,
                                        "intermediate_size": 704 if cfg.family == "llama" else None})
        without = measure(cfg, "bf16", 1, seq, checkpointing=False)[-1]
        with_ckpt = measure(cfg, "bf16", 1, seq, checkpointing=True)[-1]
        print(f"{name:<22} {without / 1e6:>13.2f} {with_ckpt / 1e6:>10.3f} {without / with_ckpt:>9.1f}x "
              f"{with_ckpt / (2 * cfg.hidden_size * seq):>24.3f}")


if __name__ == "__main__":
    main()
