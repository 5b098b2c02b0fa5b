"""Evaluation of checkpoints and of models during training (MMLU).

Public API (see :mod:`zerotrain.evaluation.mmlu` for the walk-through):

* ``load_mmlu(source, subjects=..., limit_per_subject=..., shots=5)`` -> ``MMLUData``
* ``prepare_mmlu(data, tokenizer, max_length=...)`` -> ``PreparedMMLU`` (optional cache)
* ``evaluate(model, tokenizer, data_or_prepared, batch_size=..., max_length=...,
  device=..., group=None)`` -> ``MMLUResult`` (call on every data-parallel rank)
* ``format_table(result)``, ``result.to_dict()``, ``result.to_log_dict()``

``tokenizer`` is a ``transformers`` tokenizer or a ``zerotrain.data.tokenizer.Tokenizer`` (the interface the data
pipeline uses too; ``TransformersTokenizer`` wraps a transformers one, e.g. to choose whether BOS is prepended).

Modules:

* :mod:`~zerotrain.evaluation.mmlu` — MMLU: subjects, data, prompts, scoring, report.
* :mod:`~zerotrain.evaluation.loglikelihood` — lm-evaluation-harness-style log-likelihood requests: encoding them,
  scoring them batched and data-parallel.
* :mod:`~zerotrain.evaluation.isolation` — evaluating inside training without changing it (modes, autograd, RNG).
* :mod:`~zerotrain.evaluation.model_loading` — the model a standalone evaluation scores: a Hugging Face export, or a
  training run directory exported once.
* :mod:`~zerotrain.evaluation.errors` — the exception types.
"""

from zerotrain.evaluation.errors import (
    EvaluationError,
    MalformedRowError,
    MissingSplitError,
    MMLUDataError,
    NotAnHFExportError,
    PromptTooLongError,
    UnknownSubjectError,
)
from zerotrain.evaluation.isolation import isolated_evaluation
from zerotrain.evaluation.mmlu import (
    CATEGORIES,
    SUBJECT_CATEGORIES,
    SUBJECTS,
    Accuracy,
    MMLUData,
    MMLUResult,
    PreparedMMLU,
    Question,
    QuestionResult,
    build_prompt,
    evaluate,
    format_table,
    load_mmlu,
    prepare_mmlu,
)
from zerotrain.evaluation.model_loading import load_hf_export, model_max_length, resolve_checkpoint

__all__ = [
    "Accuracy",
    "CATEGORIES",
    "EvaluationError",
    "MMLUData",
    "MMLUDataError",
    "MMLUResult",
    "MalformedRowError",
    "MissingSplitError",
    "NotAnHFExportError",
    "PreparedMMLU",
    "PromptTooLongError",
    "Question",
    "QuestionResult",
    "SUBJECTS",
    "SUBJECT_CATEGORIES",
    "UnknownSubjectError",
    "build_prompt",
    "evaluate",
    "format_table",
    "isolated_evaluation",
    "load_hf_export",
    "load_mmlu",
    "model_max_length",
    "prepare_mmlu",
    "resolve_checkpoint",
]
