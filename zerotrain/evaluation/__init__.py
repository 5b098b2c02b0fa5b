"""Evaluation of checkpoints and of models during training (MMLU).

Public API (see ``zerotrain.evaluation.mmlu`` for the walk-through):

* ``load_mmlu(source, subjects=..., limit_per_subject=..., shots=5)`` -> ``MMLUData``
* ``prepare_mmlu(data, tokenizer, max_length=...)`` -> ``PreparedMMLU`` (optional cache)
* ``evaluate(model, tokenizer, data_or_prepared, batch_size=..., max_length=...,
  device=..., group=None)`` -> ``MMLUResult`` (call on every data-parallel rank)
* ``format_table(result)``, ``result.to_dict()``, ``result.to_log_dict()``

``tokenizer`` is a ``transformers`` tokenizer or a ``zerotrain.data.tokenizer.Tokenizer`` (the interface the data
pipeline uses too; ``TransformersTokenizer`` wraps a transformers one, e.g. to choose whether BOS is prepended).
"""

from zerotrain.evaluation.checkpoint import load_hf_export, model_max_length, resolve_checkpoint
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
from zerotrain.evaluation.mmlu import PreparedMMLU, evaluate, prepare_mmlu
from zerotrain.evaluation.mmlu_data import MMLUData, Question, load_mmlu
from zerotrain.evaluation.mmlu_prompt import build_prompt
from zerotrain.evaluation.mmlu_report import Accuracy, MMLUResult, QuestionResult, format_table
from zerotrain.evaluation.mmlu_subjects import CATEGORIES, SUBJECT_CATEGORIES, SUBJECTS

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
