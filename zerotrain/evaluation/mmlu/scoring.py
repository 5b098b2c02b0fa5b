"""Scoring MMLU with a causal language model: ``prepare_mmlu`` tokenises the questions once (few-shot examples
dropped to fit the context), ``evaluate`` scores them on every rank and aggregates the result.

``evaluate`` must be called on every rank of the data-parallel group when
torch.distributed is initialised (ZeRO-3 forwards are collective); every rank
gets the same, complete ``MMLUResult``, equal to a single-process run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerotrain.data.tokenizer import as_tokenizer
from zerotrain.evaluation.isolation import isolated_evaluation
from zerotrain.evaluation.loglikelihood import Request, score_requests
from zerotrain.evaluation.mmlu.data import MMLUData
from zerotrain.evaluation.mmlu.prompt import (
    EncodedQuestion,
    SkippedQuestion,
    TooLongPolicy,
    encode_question,
)
from zerotrain.evaluation.mmlu.report import MMLUResult, QuestionResult, aggregate, predict


@dataclass
class PreparedMMLU:
    """MMLU questions tokenised for one tokenizer and context length; reusable."""

    data: MMLUData
    encoded: list[EncodedQuestion]
    skipped: list[SkippedQuestion]
    max_length: int


def prepare_mmlu(
    data: MMLUData,
    tokenizer: Any,
    *,
    max_length: int,
    on_too_long: TooLongPolicy = "skip",
) -> PreparedMMLU:
    """Build and tokenise every prompt, dropping few-shot examples where needed.

    ``tokenizer``: a transformers tokenizer or a ``zerotrain.data.tokenizer.Tokenizer``.
    ``on_too_long``: "skip" (count in the report) or "error" (PromptTooLongError)
    for questions that do not fit ``max_length`` tokens even zero-shot.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    tok = as_tokenizer(tokenizer)
    encoded: list[EncodedQuestion] = []
    skipped: list[SkippedQuestion] = []
    for index, question in enumerate(data.questions):
        item = encode_question(
            index, question, data.fewshot.get(question.subject, []), tok, max_length, on_too_long
        )
        if isinstance(item, EncodedQuestion):
            encoded.append(item)
        else:
            skipped.append(item)
    return PreparedMMLU(data, encoded, skipped, max_length)


def evaluate(
    model: torch.nn.Module,
    tokenizer: Any,
    questions: MMLUData | PreparedMMLU,
    *,
    batch_size: int = 8,
    max_length: int,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
    on_too_long: TooLongPolicy = "skip",
    progress: bool = False,
) -> MMLUResult:
    """Score MMLU questions with ``model`` (any module whose output has ``.logits``).

    The model is put in eval mode and back, runs under no_grad, and the RNG states
    are restored, so calling this inside a training loop does not change training.
    ``max_length``: the model's context in tokens (few-shot examples are dropped to
    fit it). ``group``: the data-parallel process group (default: the world).
    ``batch_size``: sequences per forward pass (per rank).
    """
    if isinstance(questions, PreparedMMLU):
        prepared = questions
        if prepared.max_length > max_length:
            raise ValueError(
                f"questions were prepared for max_length={prepared.max_length} but the model "
                f"takes {max_length}; call prepare_mmlu again"
            )
    else:
        prepared = prepare_mmlu(questions, tokenizer, max_length=max_length, on_too_long=on_too_long)
    requests = [Request(e.context, e.continuations) for e in prepared.encoded]
    with isolated_evaluation(model):
        scores = score_requests(
            model, requests, batch_size=batch_size, device=device, group=group, progress=progress
        )
    return _result(prepared, scores)


def _result(prepared: PreparedMMLU, scores: torch.Tensor) -> MMLUResult:
    data = prepared.data
    results = []
    for encoded, row in zip(prepared.encoded, scores.tolist()):
        question = data.questions[encoded.index]
        results.append(
            QuestionResult(
                index=encoded.index,
                subject=question.subject,
                source=question.source,
                answer=question.answer,
                prediction=predict(row),
                loglikelihoods=tuple(row),
                num_shots=encoded.num_shots,
            )
        )
    return aggregate(
        results,
        prepared.skipped,
        shots=data.shots,
        fewshot_policy=data.fewshot_policy,
        held_out=data.held_out,
        source=data.source,
    )
