"""MMLU during training: the ``mmlu`` section of the run config and the component the trainer runs.

Every ``mmlu.interval`` steps and after the last one, every rank scores its share of the questions (split across
data-parallel ranks with equal forward counts: ZeRO-3 gathers parameters collectively). The evaluator puts the model
in eval mode and back and restores the RNG states, so training continues exactly as without the hook.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from zerotrain.fields import bounded


@dataclass
class MMLUConfig:
    """The ``mmlu`` section: MMLU every ``interval`` steps and after the last step, when enabled."""

    enabled: bool = False
    """Run MMLU during training."""
    interval: int = bounded(0, ge=0)
    """Steps between evaluations; 0: only after the last step."""
    data: str = "data/mmlu/test.jsonl"
    """cais/mmlu (the hub), a local JSONL/parquet file in its schema, or a Hendrycks CSV directory."""
    subjects: list[str] = field(default_factory=list)
    """Subjects to score; empty: all 57."""
    limit_per_subject: int = bounded(0, ge=0)
    """Questions scored per subject; 0: all. A small cap keeps in-training evaluation quick."""
    shots: int = bounded(5, ge=0)
    """Few-shot examples before each question (from the dev split, or held out from the data when it has none)."""
    batch_size: int = bounded(8, ge=1)
    """Sequences per forward pass, per rank."""


class MMLUHook:
    """The questions, tokenised once, identically on every rank, and the schedule of evaluations.

    ``tokenizer_dir``: where the tokenizer the training data was made with lives (a prepared data directory); a
    Hugging Face re-export of it may split whitespace differently. ``max_length``: the model's context.
    """

    def __init__(self, section: MMLUConfig, tokenizer_dir: str, max_length: int, last_step: int):
        from zerotrain.data.tokenizer import load_tokenizer
        from zerotrain.evaluation import load_mmlu, prepare_mmlu

        self.section = section
        self.max_length = max_length
        self.last_step = last_step
        data = load_mmlu(section.data, subjects=list(section.subjects) or None,
                         limit_per_subject=section.limit_per_subject or None, shots=section.shots)
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.questions = prepare_mmlu(data, self.tokenizer, max_length=max_length)

    def due(self, step: int) -> bool:
        every = self.section.interval
        return (bool(every) and step % every == 0) or step == self.last_step

    def run(self, engine: Any, device: Any) -> tuple[dict[str, Any], str]:
        """Score on all ranks; returns the record to log (``mmlu/*``) and the console line."""
        from zerotrain.evaluation import evaluate

        started = time.perf_counter()
        result = evaluate(engine, self.tokenizer, self.questions, batch_size=self.section.batch_size,
                          max_length=self.max_length, device=device)
        record = result.to_log_dict()
        record["mmlu/questions"] = result.micro.total
        record["mmlu/seconds"] = time.perf_counter() - started
        text = (f"MMLU {100 * result.micro.accuracy:.2f}% micro, {100 * result.macro:.2f}% macro "
                f"({result.micro.total} questions, {record['mmlu/seconds']:.1f} s)")
        return record, text
