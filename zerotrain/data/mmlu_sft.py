"""MMLU-style fine-tuning data: MMLU's auxiliary-train questions as prompt/response records in the MMLU prompt format.

The paper's fine-tuning runs and DeepSpeed #5030's reproduction train on multiple-choice questions in the format the
MMLU evaluation scores (``zerotrain/evaluation/mmlu/prompt.py``)::

    The following are multiple choice questions (with answers).\\n\\n      <- no subject: auxiliary questions have none
    <question>\\nA. <c0>\\nB. <c1>\\nC. <c2>\\nD. <c3>\\nAnswer:              <- prompt (no loss)
     <letter>                                                                <- response (" B"; the loss, with EOS)

Each becomes ``{"prompt": ..., "response": " B"}``, which ``data/prepare.py kind=sft chat_template=completion``
tokenises as ``[BOS] prompt response EOS`` with the loss on the response and EOS only.

Sources (a local copy; nothing is downloaded): MMLU's ``auxiliary_train`` split, 99,842 questions from ARC, MCTest,
OBQA, RACE and others, as

* JSONL or parquet rows of ``cais/mmlu``'s ``auxiliary_train`` config: ``question``, ``choices`` (4), ``answer``
  (0-3 or A-D), ``subject`` empty; rows nested under a ``train`` key, as that config stores them, are read too;
* the original release's ``auxiliary_train/*.csv`` (question, A, B, C, D, letter), a file or the directory.

Never the test split: rows that name one of the 57 MMLU subjects are refused (that is a test, validation or dev
split), and every question whose text is also a question of the MMLU test set given (``data/mmlu/test.jsonl`` by
default) is dropped and counted, so no test question reaches training.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotrain.errors import DataError
from zerotrain.evaluation.mmlu.data import LETTERS, Question, parse_answer
from zerotrain.evaluation.mmlu.prompt import format_question

HEADER = "The following are multiple choice questions (with answers).\n\n"


@dataclass
class Converted:
    written: int
    dropped_test_overlap: int
    sources: list[str]


def _question(row: Any, where: str) -> Question:
    if isinstance(row, dict) and set(row) == {"train"} and isinstance(row["train"], dict):
        row = row["train"]  # cais/mmlu auxiliary_train nests each row under "train"
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with question, choices, answer")
    subject = row.get("subject") or ""
    if subject:
        raise DataError(f"{where}: row of MMLU subject {subject!r}: this is a test/validation/dev split of the 57 "
                        f"subjects, which must never be trained on. Give the auxiliary_train split")
    question, choices = row.get("question"), row.get("choices")
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: 'question' must be a non-empty string, got {question!r:.80}")
    if not (isinstance(choices, (list, tuple)) and len(choices) == 4 and all(isinstance(c, str) for c in choices)):
        raise DataError(f"{where}: 'choices' must be a list of 4 strings, got {choices!r:.120}")
    try:
        answer = parse_answer(row.get("answer"), where)
    except Exception as e:  # noqa: BLE001 -- the evaluator's MalformedRowError, re-raised as a data error
        raise DataError(str(e)) from None
    return Question("", question, tuple(choices), answer, where)


def _rows(path: Path) -> Iterator[tuple[Any, str]]:
    if path.is_dir():
        files = sorted(path.glob("*.csv")) + sorted(path.glob("*.jsonl")) + sorted(path.glob("*.parquet"))
        if not files:
            raise DataError(f"{path}: no .csv, .jsonl or .parquet files (expected MMLU's auxiliary_train/)")
        for file in files:
            yield from _rows(file)
    elif path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        yield json.loads(line), f"{path}:{number}"
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{number}: invalid JSON ({e.msg})") from None
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield row, f"{path}:row {i}"
    elif path.suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.reader(f)
            for row in reader:
                where = f"{path}:{reader.line_num}"
                if len(row) != 6:
                    raise DataError(f"{where}: {len(row)} CSV columns, expected 6 (question, A, B, C, D, answer)")
                yield {"question": row[0], "choices": row[1:5], "answer": row[5]}, where
    elif not path.exists():
        raise DataError(f"{path}: no such file or directory (a local copy of MMLU's auxiliary_train split)")
    else:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; give .jsonl, .parquet or .csv")


def _key(text: str) -> str:
    return " ".join(text.split()).lower()


def test_questions(path: Path) -> set[str]:
    """The normalised question texts of an MMLU test set (cais/mmlu-schema JSONL)."""
    if not path.is_file():
        raise DataError(f"{path}: the MMLU test set to keep out of the training data is missing (test=<path>)")
    keys = set()
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                keys.add(_key(json.loads(line)["question"]))
    return keys


def record(question: Question) -> dict[str, str]:
    """The prompt/response record of one question: MMLU's prompt, the answer letter after a space."""
    return {"prompt": HEADER + format_question(question), "response": f" {LETTERS[question.answer]}"}


def convert(inputs: list[Path], output: Path, test_set: Path) -> Converted:
    """Write ``output`` (JSONL of prompt/response records) from auxiliary-train questions; see the module doc."""
    excluded = test_questions(test_set)
    written = dropped = 0
    tmp = output.with_name(f".{output.name}.tmp")
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tmp.open("w", encoding="utf-8") as out:
            for path in inputs:
                for row, where in _rows(path):
                    question = _question(row, where)
                    if _key(question.question) in excluded:
                        dropped += 1
                        continue
                    out.write(json.dumps(record(question), ensure_ascii=False) + "\n")
                    written += 1
        if written == 0:
            raise DataError(f"no questions left to write from {', '.join(map(str, inputs))}")
        tmp.replace(output)  # whole or nothing
    finally:
        tmp.unlink(missing_ok=True)
    return Converted(written, dropped, [str(p) for p in inputs])
