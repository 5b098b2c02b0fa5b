"""MMLU (Hendrycks et al., 2021) with the standard k-shot protocol, standalone or during training.

Typical use (standalone or from the trainer, on one or many ranks)::

    from zerotrain.evaluation import load_mmlu, prepare_mmlu, evaluate

    data = load_mmlu("cais/mmlu", limit_per_subject=20)          # once
    prepared = prepare_mmlu(data, tokenizer, max_length=4096)   # once (optional)
    result = evaluate(engine.module, tokenizer, prepared,
                      batch_size=8, max_length=4096, device=engine.device)
    log(result.to_log_dict())                                   # mmlu/acc, ...

Modules, one job each:

* :mod:`~zerotrain.evaluation.mmlu.subjects` — the 57 subjects and their categories.
* :mod:`~zerotrain.evaluation.mmlu.data` — loading the questions (hub, CSV, JSONL/parquet) and the few-shot examples.
* :mod:`~zerotrain.evaluation.mmlu.prompt` — the prompt format and fitting it into the model's context.
* :mod:`~zerotrain.evaluation.mmlu.scoring` — ``prepare_mmlu`` and ``evaluate``: tokenise, score, aggregate.
* :mod:`~zerotrain.evaluation.mmlu.report` — accuracies per subject, category and overall; JSON and a table.

The log-likelihood scoring itself (batched, data-parallel) is not MMLU's: see :mod:`zerotrain.evaluation.loglikelihood`.
"""

from zerotrain.evaluation.mmlu.data import MMLUData, Question, load_mmlu
from zerotrain.evaluation.mmlu.prompt import build_prompt
from zerotrain.evaluation.mmlu.report import Accuracy, MMLUResult, QuestionResult, format_table
from zerotrain.evaluation.mmlu.scoring import PreparedMMLU, evaluate, prepare_mmlu
from zerotrain.evaluation.mmlu.subjects import CATEGORIES, SUBJECT_CATEGORIES, SUBJECTS

__all__ = [
    "CATEGORIES",
    "SUBJECTS",
    "SUBJECT_CATEGORIES",
    "Accuracy",
    "MMLUData",
    "MMLUResult",
    "PreparedMMLU",
    "Question",
    "QuestionResult",
    "build_prompt",
    "evaluate",
    "format_table",
    "load_mmlu",
    "prepare_mmlu",
]
