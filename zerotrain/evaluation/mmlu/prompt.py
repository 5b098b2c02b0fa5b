"""MMLU prompts (Hendrycks et al. / lm-evaluation-harness format) and fitting them
into the model's context.

A prompt is::

    The following are multiple choice questions (with answers) about <subject>.\\n\\n
    <few-shot question>\\nA. <c0>\\nB. <c1>\\nC. <c2>\\nD. <c3>\\nAnswer: <letter>\\n\\n
    ... (k few-shot examples)
    <question>\\nA. <c0>\\nB. <c1>\\nC. <c2>\\nD. <c3>\\nAnswer:

and the four continuations scored are " A", " B", " C", " D". Questions are
``.strip()``-ed as in lm-evaluation-harness' ``doc_to_text``; choices are not.

When a prompt does not fit ``max_length`` tokens, few-shot examples are dropped
from the end until it does; the question itself is never truncated. A question
that does not fit even zero-shot is skipped (and counted) or raises
``PromptTooLongError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from zerotrain.data.tokenizer import Tokenizer
from zerotrain.evaluation.errors import PromptTooLongError
from zerotrain.evaluation.loglikelihood import encode_choices, encode_context
from zerotrain.evaluation.mmlu.data import LETTERS, Question
from zerotrain.evaluation.mmlu.subjects import subject_description

CONTINUATIONS: tuple[str, ...] = tuple(f" {letter}" for letter in LETTERS)

TooLongPolicy = Literal["skip", "error"]


def format_header(subject: str) -> str:
    """The task description line that starts every prompt of a subject."""
    return (
        "The following are multiple choice questions (with answers) about "
        f"{subject_description(subject)}.\n\n"
    )


def format_question(question: Question) -> str:
    """Question and lettered choices, ending in "Answer:" (no trailing space)."""
    lines = [question.question.strip()]
    lines += [f"{letter}. {choice}" for letter, choice in zip(LETTERS, question.choices)]
    lines.append("Answer:")
    return "\n".join(lines)


def format_example(example: Question) -> str:
    """A solved few-shot example, followed by the blank line that separates examples."""
    return f"{format_question(example)} {LETTERS[example.answer]}\n\n"


def build_prompt(question: Question, fewshot: Sequence[Question]) -> str:
    """The full context for ``question`` with the given few-shot examples."""
    examples = "".join(format_example(e) for e in fewshot)
    return format_header(question.subject) + examples + format_question(question)


@dataclass(frozen=True)
class EncodedQuestion:
    """Token ids of one question's context and its four continuations."""

    index: int  # position in MMLUData.questions
    context: list[int]
    continuations: tuple[list[int], ...]
    num_shots: int


@dataclass(frozen=True)
class SkippedQuestion:
    """A question that could not be scored, and why."""

    index: int
    subject: str
    source: str
    reason: str


def request_length(context: Sequence[int], continuations: Sequence[Sequence[int]]) -> int:
    """Tokens fed to the model for the longest continuation (its last token is not input)."""
    return len(context) + max(len(c) for c in continuations) - 1


def encode_question(
    index: int,
    question: Question,
    fewshot: Sequence[Question],
    tokenizer: Tokenizer,
    max_length: int,
    on_too_long: TooLongPolicy = "skip",
) -> EncodedQuestion | SkippedQuestion:
    """Encode with as many few-shot examples (from the front) as fit ``max_length``."""
    shortest = 0
    for num_shots in range(len(fewshot), -1, -1):
        prompt = build_prompt(question, fewshot[:num_shots])
        # Cheap test first: a context that alone exceeds max_length cannot fit with
        # any continuation, so skip encoding the four continuations.
        shortest = len(encode_context(tokenizer, prompt))
        if shortest > max_length:
            continue
        context, continuations = encode_choices(tokenizer, prompt, CONTINUATIONS)
        shortest = request_length(context, continuations)
        if shortest <= max_length:
            return EncodedQuestion(index, context, tuple(continuations), num_shots)
    reason = f"needs {shortest} tokens zero-shot, max_length is {max_length}"
    if on_too_long == "error":
        raise PromptTooLongError(
            f"{question.source} ({question.subject}): {reason}; raise max_length or "
            f"pass on_too_long='skip' to count it as skipped"
        )
    return SkippedQuestion(index, question.subject, question.source, reason)
