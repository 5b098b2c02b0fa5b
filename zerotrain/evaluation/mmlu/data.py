"""Loading MMLU questions and choosing the few-shot examples.

Sources (``load_mmlu(source, ...)``):

* ``"cais/mmlu"`` (or another hub id): ``datasets.load_dataset(source, "all")``,
  the path most users take. Needs network access the first time.
* A directory written by ``datasets.DatasetDict.save_to_disk`` (or
  ``Dataset.save_to_disk``) of data in the ``cais/mmlu`` schema.
* The original Hendrycks CSV layout: a directory with ``dev/``, ``val/``,
  ``test/`` holding ``<subject>_<split>.csv`` files, rows ``question, A, B, C,
  D, answer-letter`` without a header.
* A ``.jsonl`` or ``.parquet`` file in the ``cais/mmlu`` schema (``question``,
  ``subject``, ``choices`` [4 strings], ``answer`` 0-3); the file is the
  evaluation split. A directory of such files named ``<split>.jsonl``,
  ``<split>.parquet`` or ``<split>-*.parquet`` (the hub's ``all/`` folder) is
  read split by split.

Few-shot examples come from the ``dev`` split: the first ``shots`` questions of
each subject, in file order (lm-evaluation-harness' ``first_n`` sampler).

No-dev-split policy (``no_dev_split="holdout"``, the default): when the source
has no dev split (for instance ``data/mmlu/test.jsonl``), the first ``shots``
questions of each subject in the evaluation split become that subject's few-shot
examples and are NOT scored, so no question is ever answered with itself in
context. The number held out per subject is logged (WARNING) and kept in
``MMLUData.held_out`` and in the report. Numbers are then over slightly fewer
questions than the official test set (57 * 5 = 285 fewer with 5 shots), and the
few-shot examples differ from the official dev ones, so they are close to, not
identical with, published numbers. ``no_dev_split="error"`` raises
``MissingSplitError`` instead.
"""

from __future__ import annotations

import csv
import functools
import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from zerotrain.evaluation.errors import (
    MalformedRowError,
    MissingSplitError,
    MMLUDataError,
    UnknownSubjectError,
)
from zerotrain.evaluation.mmlu.subjects import SUBJECTS, check_subject, close_matches

logger = logging.getLogger(__name__)

LETTERS: tuple[str, ...] = ("A", "B", "C", "D")
SCHEMA_KEYS: tuple[str, ...] = ("question", "subject", "choices", "answer")
HUB_CONFIG = "all"
# Hendrycks' directory names for the splits; cais/mmlu calls "val" "validation".
CSV_SPLIT_DIRS: dict[str, str] = {"dev": "dev", "validation": "val", "test": "test"}

NoDevSplitPolicy = Literal["holdout", "error"]


@dataclass(frozen=True)
class Question:
    """One multiple-choice question; ``source`` says where it came from (file:line)."""

    subject: str
    question: str
    choices: tuple[str, str, str, str]
    answer: int
    source: str


@dataclass
class MMLUData:
    """Questions to score plus the few-shot examples of each subject."""

    questions: list[Question]
    fewshot: dict[str, list[Question]]
    shots: int
    source: str
    eval_split: str
    # "dev": from the dev split; "holdout": the no-dev-split fallback for every subject;
    # "dev+holdout": the fallback for the subjects the dev split lacks; "zero-shot".
    fewshot_policy: str
    held_out: dict[str, int] = field(default_factory=dict)

    @property
    def subjects(self) -> list[str]:
        """Subjects with at least one question to score, sorted."""
        return sorted({q.subject for q in self.questions})


# --------------------------------------------------------------------------- rows


def _bad_row(where: str, problem: str) -> MalformedRowError:
    return MalformedRowError(
        f"{where}: {problem}. Expected the cais/mmlu schema: question (str), subject "
        f"(one of the 57 MMLU subjects), choices (list of 4 str), answer (int 0-3 or "
        f"letter A-D)"
    )


def parse_answer(value: Any, where: str) -> int:
    """An answer as int 0-3; accepts 0-3 or the letters A-D, anything else is an error."""
    if isinstance(value, bool):  # bool is an int subclass; True is not an answer
        raise _bad_row(where, f"answer {value!r} is not 0-3 or A-D")
    if isinstance(value, int) and 0 <= value < len(LETTERS):
        return value
    if isinstance(value, str) and value.strip().upper() in LETTERS:
        return LETTERS.index(value.strip().upper())
    raise _bad_row(where, f"answer {value!r} is not 0-3 or A-D")


def parse_record(record: Any, where: str, *, subject: str | None = None) -> Question:
    """Validate one cais/mmlu-schema record; ``subject`` overrides a missing column."""
    if not isinstance(record, Mapping):
        raise _bad_row(where, f"row is a {type(record).__name__}, not an object")
    record = dict(record)
    if subject is not None and not record.get("subject"):
        record["subject"] = subject
    missing = [k for k in SCHEMA_KEYS if k not in record]
    if missing:
        raise _bad_row(where, f"missing key(s) {', '.join(map(repr, missing))}")
    question, choices = record["question"], record["choices"]
    if not isinstance(question, str) or not question.strip():
        raise _bad_row(where, f"question must be a non-empty string, got {question!r}")
    if not isinstance(record["subject"], str):
        raise _bad_row(where, f"subject must be a string, got {record['subject']!r}")
    if not isinstance(choices, Sequence) or isinstance(choices, str) or len(choices) != 4:
        raise _bad_row(where, f"choices must be a list of 4 strings, got {choices!r}")
    if not all(isinstance(c, str) for c in choices):
        raise _bad_row(where, f"choices must be strings, got {list(choices)!r}")
    return Question(
        subject=check_subject(record["subject"], where=where),
        question=question,
        choices=tuple(choices),
        answer=parse_answer(record["answer"], where),
        source=where,
    )


# ------------------------------------------------------------------------ readers


def read_jsonl(path: Path) -> list[Question]:
    """cais/mmlu-schema rows, one JSON object per line (blank lines skipped)."""
    questions = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise _bad_row(where, f"invalid JSON ({e.msg} at column {e.colno})") from e
            questions.append(parse_record(record, where))
    return questions


def read_parquet(path: Path) -> list[Question]:
    """cais/mmlu-schema rows from a parquet file (row numbers in messages are 0-based)."""
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise MMLUDataError(f"{path}: cannot read parquet file: {e}") from e
    return [parse_record(r, f"{path}:row {i}") for i, r in enumerate(rows)]


def read_hendrycks_csv(path: Path, subject: str) -> list[Question]:
    """One ``<subject>_<split>.csv`` of the original release: question, A, B, C, D, letter."""
    questions = []
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        start_line = 1
        for row in reader:
            # Quoted fields may span lines; name the line where the record starts.
            where = f"{path}:{start_line}"
            start_line = reader.line_num + 1
            if not row:
                continue
            if len(row) != 6:
                raise _bad_row(
                    where, f"{len(row)} CSV columns, expected 6 (question, A, B, C, D, answer)"
                )
            record = {"question": row[0], "choices": row[1:5], "answer": row[5]}
            questions.append(parse_record(record, where, subject=subject))
    return questions


def read_csv_split_dir(directory: Path, split: str) -> list[Question]:
    """All ``<subject>_<split>.csv`` files of one split directory, subjects sorted."""
    suffix = f"_{directory.name}.csv"
    files = sorted(directory.glob(f"*{suffix}"))
    if not files:
        raise MMLUDataError(f"{directory}: no *{suffix} files for split {split!r}")
    questions = []
    for path in files:
        subject = path.name[: -len(suffix)]
        check_subject(subject, where=str(path))
        questions.extend(read_hendrycks_csv(path, subject))
    return questions


def read_hf_dataset(dataset: Any, name: str) -> list[Question]:
    """Rows of a ``datasets.Dataset`` in the cais/mmlu schema."""
    missing = [k for k in SCHEMA_KEYS if k not in dataset.column_names]
    if missing:
        raise MMLUDataError(
            f"{name}: columns {dataset.column_names}, missing {missing}; "
            f"expected the cais/mmlu schema {list(SCHEMA_KEYS)}"
        )
    return [parse_record(r, f"{name}#row {i}") for i, r in enumerate(dataset)]


# ------------------------------------------------------------------------ sources


@dataclass
class _Source:
    """Where each split of a data source is; loaders are lazy (splits can be large)."""

    description: str
    splits: dict[str, Callable[[], list[Question]]]
    # A single file is "the evaluation split", whatever the split is called.
    single_split: bool = False

    def read_eval(self, split: str) -> list[Question] | None:
        """The questions to score: the named split, or the whole single file."""
        return self.splits["file"]() if self.single_split else self.read(split)

    def read(self, split: str) -> list[Question] | None:
        """A named split, None when the source has none (a single file has no dev split)."""
        loader = None if self.single_split else self.splits.get(split)
        return loader() if loader is not None else None


_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _open_source(source: str | Path) -> _Source:
    path = Path(source)
    if path.is_file():
        return _open_file(path)
    if path.is_dir():
        return _open_directory(path)
    if isinstance(source, str) and _HUB_ID.match(source):
        return _open_hub(source)
    raise MMLUDataError(
        f"MMLU data {str(source)!r} not found: not an existing file or directory, and not "
        f"a hub id like 'cais/mmlu'"
    )


def _open_file(path: Path) -> _Source:
    readers = {".jsonl": read_jsonl, ".json": read_jsonl, ".parquet": read_parquet}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise MMLUDataError(
            f"{path}: unknown file type {path.suffix!r}; expected .jsonl or .parquet in the "
            f"cais/mmlu schema, a directory (Hendrycks CSV layout or datasets.save_to_disk), "
            f"or 'cais/mmlu'"
        )
    return _Source(str(path), {"file": lambda: reader(path)}, single_split=True)


def _open_directory(path: Path) -> _Source:
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return _open_saved_dataset(path)
    csv_dirs = {s: path / d for s, d in CSV_SPLIT_DIRS.items() if (path / d).is_dir()}
    if any(any(d.glob("*.csv")) for d in csv_dirs.values()):
        return _Source(
            f"{path} (Hendrycks CSV layout)",
            {s: functools.partial(read_csv_split_dir, d, s) for s, d in csv_dirs.items()},
        )
    split_files = _split_files(path)
    if split_files:
        return _Source(str(path), split_files)
    raise MMLUDataError(
        f"{path}: no MMLU data found. Expected one of: dev/ val/ test/ folders with "
        f"<subject>_<split>.csv files (Hendrycks layout); <split>.jsonl or "
        f"<split>[-*].parquet files (cais/mmlu schema); a datasets.save_to_disk folder"
    )


def _split_files(path: Path) -> dict[str, Callable[[], list[Question]]]:
    """``test.jsonl`` / ``test.parquet`` / ``test-00000-of-00001.parquet`` -> split "test"."""
    groups: dict[str, list[Path]] = {}
    for file in sorted(path.iterdir()):
        match = re.match(r"^([A-Za-z_]+?)(-.*)?\.(jsonl|parquet)$", file.name)
        if match and file.is_file():
            groups.setdefault(match.group(1), []).append(file)

    def loader(files: list[Path]) -> Callable[[], list[Question]]:
        def load() -> list[Question]:
            out: list[Question] = []
            for f in files:
                out.extend(read_jsonl(f) if f.suffix == ".jsonl" else read_parquet(f))
            return out

        return load

    return {split: loader(files) for split, files in groups.items()}


def _open_saved_dataset(path: Path) -> _Source:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        return _Source(
            str(path),
            {s: functools.partial(read_hf_dataset, loaded[s], f"{path}[{s}]") for s in loaded},
        )
    return _Source(str(path), {"file": lambda: read_hf_dataset(loaded, str(path))}, True)


def _open_hub(name: str) -> _Source:
    # The path real users take; it cannot run in the tests (no network there), which
    # exercise the same read_hf_dataset code on a datasets.save_to_disk copy instead.
    import datasets

    logger.info("loading %s (config %r) with datasets.load_dataset", name, HUB_CONFIG)
    loaded = datasets.load_dataset(name, HUB_CONFIG)
    return _Source(
        f"{name} ({HUB_CONFIG})",
        {s: functools.partial(read_hf_dataset, loaded[s], f"{name}[{s}]") for s in loaded},
    )


# ------------------------------------------------------------------- selection


def _by_subject(questions: Iterable[Question]) -> dict[str, list[Question]]:
    grouped: dict[str, list[Question]] = {}
    for q in questions:
        grouped.setdefault(q.subject, []).append(q)
    return grouped


def select_subjects(requested: Sequence[str] | None, available: Iterable[str], source: str) -> list[str]:
    """Canonical, sorted subject names; errors name the bad one and close matches."""
    available = sorted(set(available))
    if requested is None:
        return available
    chosen = []
    for name in requested:
        subject = check_subject(name)
        if subject not in available:
            hint = close_matches(subject, available)
            raise UnknownSubjectError(
                f"subject {subject!r} is not in {source}"
                + (f" (close: {', '.join(hint)})" if hint else "")
                + f"; subjects there: {', '.join(available)}"
            )
        chosen.append(subject)
    return sorted(set(chosen))


def load_mmlu(
    source: str | Path = "cais/mmlu",
    *,
    subjects: Sequence[str] | None = None,
    limit_per_subject: int | None = None,
    shots: int = 5,
    eval_split: str = "test",
    fewshot_split: str = "dev",
    no_dev_split: NoDevSplitPolicy = "holdout",
) -> MMLUData:
    """Load MMLU questions to score and the few-shot examples for each subject.

    ``subjects``: names to keep (default all present); ``limit_per_subject``: score
    only the first N questions of each subject (quick in-training evaluation);
    ``no_dev_split``: what to do when the source has no dev split (see module doc).
    """
    if shots < 0:
        raise ValueError(f"shots must be >= 0, got {shots}")
    if limit_per_subject is not None and limit_per_subject < 1:
        raise ValueError(f"limit_per_subject must be >= 1 or None, got {limit_per_subject}")
    if no_dev_split not in ("holdout", "error"):
        raise ValueError(f"no_dev_split must be 'holdout' or 'error', got {no_dev_split!r}")

    src = _open_source(source)
    eval_questions = src.read_eval(eval_split)
    if eval_questions is None:
        raise MissingSplitError(
            f"{src.description} has no split {eval_split!r}; splits: {', '.join(src.splits)}"
        )
    if src.single_split:
        logger.info("%s: using the whole file as the evaluation split", src.description)
    grouped = _by_subject(eval_questions)
    chosen = select_subjects(subjects, grouped, src.description)

    fewshot, policy, held_out = _choose_fewshot(
        src, grouped, chosen, shots, eval_split, fewshot_split, no_dev_split
    )
    questions: list[Question] = []
    for subject in chosen:
        remaining = grouped[subject][held_out.get(subject, 0):]
        if not remaining:
            logger.warning("MMLU subject %s: no question left to score after holdout", subject)
        questions.extend(remaining[:limit_per_subject])
    return MMLUData(
        questions=questions,
        fewshot=fewshot,
        shots=shots,
        source=src.description,
        eval_split=eval_split,
        fewshot_policy=policy,
        held_out=held_out,
    )


def _choose_fewshot(
    src: _Source,
    grouped: dict[str, list[Question]],
    chosen: list[str],
    shots: int,
    eval_split: str,
    fewshot_split: str,
    no_dev_split: NoDevSplitPolicy,
) -> tuple[dict[str, list[Question]], str, dict[str, int]]:
    """Few-shot examples per subject, the policy used, and how many were held out."""
    if shots == 0:
        return {s: [] for s in chosen}, "zero-shot", {}
    dev = None if fewshot_split == eval_split else src.read(fewshot_split)
    dev_grouped = _by_subject(dev or [])
    no_dev = [s for s in chosen if not dev_grouped.get(s)]
    if no_dev and no_dev_split == "error":
        raise MissingSplitError(
            f"{src.description} has no {fewshot_split!r} examples for "
            f"{', '.join(no_dev)}, needed for {shots}-shot prompts; use a source with a dev "
            f"split (e.g. cais/mmlu), shots=0, or no_dev_split='holdout'"
        )
    fewshot, held_out = {}, {}
    for subject in chosen:
        if subject in no_dev:
            # The documented fallback: the first `shots` questions of the evaluation
            # split become the examples and are excluded from scoring.
            fewshot[subject] = grouped[subject][:shots]
            held_out[subject] = len(fewshot[subject])
            continue
        fewshot[subject] = dev_grouped[subject][:shots]
        if len(fewshot[subject]) < shots:
            logger.warning(
                "MMLU subject %s: only %d %s examples for %d shots",
                subject, len(fewshot[subject]), fewshot_split, shots,
            )
    if held_out:
        logger.warning(
            "MMLU: no %r split in %s for %d subject(s); holding out the first %d "
            "question(s) of each of them from %r as few-shot examples (%d questions "
            "not scored)",
            fewshot_split, src.description, len(held_out), shots, eval_split,
            sum(held_out.values()),
        )
    if not held_out:
        policy = fewshot_split
    elif len(held_out) == len(chosen):
        policy = "holdout"
    else:
        policy = f"{fewshot_split}+holdout"
    return fewshot, policy, held_out


__all__ = [
    "LETTERS",
    "MMLUData",
    "Question",
    "SUBJECTS",
    "load_mmlu",
    "parse_answer",
    "parse_record",
    "read_hendrycks_csv",
    "read_jsonl",
    "read_parquet",
    "select_subjects",
]
