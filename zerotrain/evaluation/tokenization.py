"""The small tokenizer protocol the evaluator needs, and its Hugging Face adapter.

The evaluator only needs ``encode(text) -> list[int]`` (no special tokens) and
``bos_id`` (the token to put in front of every context, or None). Any tokenizer
(the trainer's own wrapper, sentencepiece, ...) can be adapted to it in a few
lines; ``HFTokenizerAdapter`` does it for ``transformers`` tokenizers.

``encode_pair`` splits a (context, continuation) pair into token ids the way
lm-evaluation-harness does: it encodes ``context`` and ``context +
continuation`` and takes the extra tokens of the latter as the continuation.
Encoding the continuation alone would be wrong for sentencepiece tokenizers,
which treat a leading space specially ("Answer: A" ends in "▁A", while " A" on
its own encodes as "▁", "▁A" or similar).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EvalTokenizer(Protocol):
    """What the evaluator needs from a tokenizer."""

    bos_id: int | None  # prepended to every context when not None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without any special tokens."""
        ...


class HFTokenizerAdapter:
    """Adapts a ``transformers`` tokenizer to ``EvalTokenizer``.

    ``add_bos=None`` follows the tokenizer's own default (what lm-evaluation-harness
    does since it stopped forcing ``add_bos_token=False``): Llama's tokenizer adds
    ``<s>``, Falcon's adds nothing. Pass True/False to override.
    """

    def __init__(self, tokenizer: Any, add_bos: bool | None = None) -> None:
        self.tokenizer = tokenizer
        if add_bos is None:
            add_bos = _adds_bos_by_default(tokenizer)
        bos = getattr(tokenizer, "bos_token_id", None)
        if add_bos and bos is None:
            raise ValueError("add_bos=True but the tokenizer has no bos_token_id")
        self.bos_id: int | None = bos if add_bos else None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def __repr__(self) -> str:
        return f"HFTokenizerAdapter({type(self.tokenizer).__name__}, bos_id={self.bos_id})"


def _adds_bos_by_default(tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > len(without) and with_special[0] == bos


def as_eval_tokenizer(tokenizer: Any) -> EvalTokenizer:
    """Wrap Hugging Face tokenizers; pass objects already following the protocol through."""
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        PreTrainedTokenizerBase = ()  # type: ignore[assignment,misc]
    # HF tokenizers also have an encode() (adding special tokens), so test them first.
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return HFTokenizerAdapter(tokenizer)
    if isinstance(tokenizer, EvalTokenizer):
        return tokenizer
    raise TypeError(
        f"{type(tokenizer).__name__} is not a transformers tokenizer and does not follow "
        f"zerotrain.evaluation.EvalTokenizer (encode(text) -> list[int], bos_id)"
    )


def encode_context(tokenizer: EvalTokenizer, context: str) -> list[int]:
    """Context ids as ``encode_pair`` computes them (BOS, trailing spaces removed)."""
    prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    context = context.rstrip()
    if not context and not prefix:
        raise ValueError("empty context and no BOS token: nothing to condition on")
    return prefix + tokenizer.encode(context) if context else prefix


def encode_choices(
    tokenizer: EvalTokenizer, context: str, continuations: Sequence[str]
) -> tuple[list[int], list[list[int]]]:
    """(context ids, [continuation ids]) as lm-evaluation-harness computes each pair."""
    # Trailing spaces of the context belong to the continuation (lm-eval does the same:
    # "Answer: " + "A" is scored as "Answer:" + " A").
    stripped = context.rstrip()
    moved = context[len(stripped):]
    context_ids = encode_context(tokenizer, stripped)
    prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    out = []
    for continuation in continuations:
        whole = prefix + tokenizer.encode(stripped + moved + continuation)
        ids = whole[len(context_ids):]
        if not ids:
            raise ValueError(f"continuation {continuation!r} encodes to no tokens")
        out.append(ids)
    return context_ids, out


def encode_pair(
    tokenizer: EvalTokenizer, context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of one pair, as lm-evaluation-harness computes them."""
    context_ids, (continuation_ids,) = encode_choices(tokenizer, context, [continuation])
    return context_ids, continuation_ids
