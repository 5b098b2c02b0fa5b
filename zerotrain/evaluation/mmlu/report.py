"""MMLU results: per question, per subject, per category, overall; JSON and a table.

Category accuracies (and the micro average) are over questions, as in Hendrycks'
``evaluate.py`` and lm-evaluation-harness' size-weighted group aggregation; the
macro average is the mean of the subject accuracies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from zerotrain.evaluation.mmlu.prompt import SkippedQuestion
from zerotrain.evaluation.mmlu.subjects import CATEGORIES, subject_category


@dataclass(frozen=True)
class QuestionResult:
    """The scores of one question; ``prediction`` is the argmax (first on ties)."""

    index: int
    subject: str
    source: str
    answer: int
    prediction: int
    loglikelihoods: tuple[float, ...]
    num_shots: int

    @property
    def correct(self) -> bool:
        return self.prediction == self.answer


@dataclass(frozen=True)
class Accuracy:
    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {"accuracy": self.accuracy, "correct": self.correct, "total": self.total}


@dataclass
class MMLUResult:
    """Everything an MMLU evaluation produced; identical on every rank."""

    questions: list[QuestionResult]
    skipped: list[SkippedQuestion]
    subjects: dict[str, Accuracy]
    categories: dict[str, Accuracy]
    micro: Accuracy
    macro: float
    shots: int
    fewshot_policy: str
    held_out: dict[str, int] = field(default_factory=dict)
    source: str = ""

    @property
    def fewer_shots(self) -> int:
        """Questions that got fewer few-shot examples than requested (context too short)."""
        return sum(1 for q in self.questions if q.num_shots < self.shots)

    def to_log_dict(self, prefix: str = "mmlu") -> dict[str, float]:
        """Flat metrics for a training logger (TensorBoard/W&B)."""
        metrics = {f"{prefix}/acc": self.micro.accuracy, f"{prefix}/acc_macro": self.macro}
        for name, acc in self.categories.items():
            metrics[f"{prefix}/{name}"] = acc.accuracy
        return metrics

    def to_dict(self, per_question: bool = True) -> dict[str, Any]:
        """JSON-ready report."""
        report: dict[str, Any] = {
            "source": self.source,
            "shots": self.shots,
            "fewshot_policy": self.fewshot_policy,
            "held_out_for_fewshot": {"total": sum(self.held_out.values()), **self.held_out},
            "overall": {"micro": self.micro.to_dict(), "macro": self.macro},
            "categories": {k: v.to_dict() for k, v in self.categories.items()},
            "subjects": {k: v.to_dict() for k, v in self.subjects.items()},
            "questions_with_fewer_shots": self.fewer_shots,
            "skipped": {"total": len(self.skipped), "questions": [asdict(s) for s in self.skipped]},
        }
        if per_question:
            report["questions"] = [
                {**asdict(q), "loglikelihoods": list(q.loglikelihoods), "correct": q.correct}
                for q in self.questions
            ]
        return report


def aggregate(
    questions: list[QuestionResult],
    skipped: list[SkippedQuestion],
    *,
    shots: int,
    fewshot_policy: str,
    held_out: dict[str, int],
    source: str,
) -> MMLUResult:
    """Per-subject, per-category and overall accuracies of question results."""
    per_subject: dict[str, list[bool]] = {}
    for q in questions:
        per_subject.setdefault(q.subject, []).append(q.correct)
    subjects = {s: Accuracy(sum(v), len(v)) for s, v in sorted(per_subject.items())}
    categories = {}
    for category in CATEGORIES:
        members = [a for s, a in subjects.items() if subject_category(s) == category]
        if members:
            categories[category] = Accuracy(sum(a.correct for a in members), sum(a.total for a in members))
    micro = Accuracy(sum(a.correct for a in subjects.values()), sum(a.total for a in subjects.values()))
    macro = sum(a.accuracy for a in subjects.values()) / len(subjects) if subjects else math.nan
    return MMLUResult(
        questions=questions,
        skipped=skipped,
        subjects=subjects,
        categories=categories,
        micro=micro,
        macro=macro,
        shots=shots,
        fewshot_policy=fewshot_policy,
        held_out=held_out,
        source=source,
    )


def predict(loglikelihoods: Sequence[float]) -> int:
    """Index of the most likely choice; the first one on ties (like numpy.argmax)."""
    best = 0
    for i, value in enumerate(loglikelihoods):
        if value > loglikelihoods[best]:
            best = i
    return best


def format_table(result: MMLUResult) -> str:
    """Readable summary: overall, per category, per subject."""
    def line(name: str, acc: Accuracy) -> str:
        return f"{name:<40} {100 * acc.accuracy:6.2f}  {acc.correct:>6}/{acc.total:<6}"

    out = [f"MMLU {result.shots}-shot ({result.fewshot_policy} few-shot), source: {result.source}"]
    out.append(f"{'':<40} {'acc %':>6}  {'correct/total':>13}")
    out.append(line("overall (micro, over questions)", result.micro))
    out.append(f"{'overall (macro, over subjects)':<40} {100 * result.macro:6.2f}")
    out.append("")
    out += [line(name, acc) for name, acc in result.categories.items()]
    out.append("")
    out += [line(name, acc) for name, acc in result.subjects.items()]
    notes = []
    if result.held_out:
        notes.append(f"{sum(result.held_out.values())} question(s) held out as few-shot examples (no dev split)")
    if result.fewer_shots:
        notes.append(f"{result.fewer_shots} question(s) got fewer than {result.shots} shots (context limit)")
    if result.skipped:
        notes.append(f"{len(result.skipped)} question(s) skipped: too long even zero-shot")
    if notes:
        out.append("")
        out += [f"note: {n}" for n in notes]
    return "\n".join(out)


__all__ = ["Accuracy", "MMLUResult", "QuestionResult", "aggregate", "format_table", "predict"]
