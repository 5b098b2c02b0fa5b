"""Loading MMLU from every supported layout, the no-dev-split fallback, bad input."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest
from mmlu_testlib import MMLU_JSONL, read_rows, write_jsonl

from zerotrain.evaluation import (
    MalformedRowError,
    MissingSplitError,
    MMLUDataError,
    UnknownSubjectError,
    load_mmlu,
)
from zerotrain.evaluation.mmlu import data as mmlu_data

SUBJECTS = ("anatomy", "marketing")


def rows_of(subjects=SUBJECTS, per_subject=8) -> list[dict]:
    rows, counts = [], {}
    for r in read_rows():
        if r["subject"] in subjects and counts.get(r["subject"], 0) < per_subject:
            counts[r["subject"]] = counts.get(r["subject"], 0) + 1
            rows.append(r)
    return rows


def dev_rows(subjects=SUBJECTS, n=5) -> list[dict]:
    """Stand-in dev rows: marked so tests can tell them from test rows."""
    return [
        {"question": f"dev {s} {i}?", "subject": s, "choices": ["w", "x", "y", "z"], "answer": i % 4}
        for s in subjects for i in range(n)
    ]


# ----------------------------------------------------------------- full local copy


def test_repo_copy_is_the_full_test_split_and_fallback_holds_out_first_k(caplog):
    with caplog.at_level(logging.WARNING, logger="zerotrain.evaluation.mmlu.data"):
        data = load_mmlu(MMLU_JSONL, shots=5)
    assert len(data.subjects) == 57
    assert data.fewshot_policy == "holdout"
    assert data.held_out == {s: 5 for s in data.subjects}
    assert len(data.questions) == 14042 - 57 * 5
    assert "holding out the first 5" in caplog.text and "285 questions not scored" in caplog.text
    rows = read_rows()
    anatomy = [r["question"] for r in rows if r["subject"] == "anatomy"]
    assert [q.question for q in data.fewshot["anatomy"]] == anatomy[:5]
    scored = [q.question for q in data.questions if q.subject == "anatomy"]
    assert scored == anatomy[5:]  # no question is scored with itself in context
    assert data.questions[0].source.endswith(f"test.jsonl:{_line_of(rows, data.questions[0])}")


def _line_of(rows, question) -> int:
    return next(i for i, r in enumerate(rows, 1) if r["question"] == question.question)


def test_zero_shot_needs_no_dev_split_and_holds_nothing_out():
    data = load_mmlu(MMLU_JSONL, shots=0, subjects=["anatomy"])
    assert data.held_out == {} and data.fewshot == {"anatomy": []}
    assert len(data.questions) == 135


def test_no_dev_split_error_policy(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", rows_of())
    with pytest.raises(MissingSplitError, match="no 'dev' examples for anatomy, marketing"):
        load_mmlu(path, no_dev_split="error")


def test_subject_selection_and_limit():
    data = load_mmlu(MMLU_JSONL, subjects=["Marketing", "high-school physics"], shots=2, limit_per_subject=3)
    assert data.subjects == ["high_school_physics", "marketing"]
    assert [q.subject for q in data.questions] == ["high_school_physics"] * 3 + ["marketing"] * 3


# ------------------------------------------------------------------------ layouts


def expect_same(data, rows, dev=None):
    """Data loaded from a layout equals the rows it was written from."""
    by_subject = {s: [r for r in rows if r["subject"] == s] for s in SUBJECTS}
    expected = [r for s in sorted(by_subject) for r in by_subject[s][(0 if dev else 2):]]
    assert [(q.subject, q.question, list(q.choices), q.answer) for q in data.questions] == [
        (r["subject"], r["question"], r["choices"], r["answer"]) for r in expected
    ]
    if dev:
        assert data.fewshot_policy == "dev" and data.held_out == {}
        for s in SUBJECTS:
            assert [q.question for q in data.fewshot[s]] == [r["question"] for r in dev if r["subject"] == s][:2]


def test_jsonl_file(tmp_path):
    rows = rows_of()
    data = load_mmlu(write_jsonl(tmp_path / "mmlu.jsonl", rows), shots=2)
    expect_same(data, rows)
    assert data.held_out == {"anatomy": 2, "marketing": 2}


def test_directory_of_split_files_uses_the_dev_split(tmp_path):
    rows, dev = rows_of(), dev_rows()
    write_jsonl(tmp_path / "test.jsonl", rows)
    write_jsonl(tmp_path / "dev.jsonl", dev)
    expect_same(load_mmlu(tmp_path, shots=2), rows, dev)


def test_parquet_file_and_hub_style_parquet_folder(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, dev = rows_of(), dev_rows()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mmlu.parquet")
    expect_same(load_mmlu(tmp_path / "mmlu.parquet", shots=2), rows)

    hub = tmp_path / "all"
    hub.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), hub / "test-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(dev), hub / "dev-00000-of-00001.parquet")
    expect_same(load_mmlu(hub, shots=2), rows, dev)


def write_hendrycks(root: Path, split_dir: str, rows: list[dict]) -> None:
    (root / split_dir).mkdir(parents=True, exist_ok=True)
    for s in {r["subject"] for r in rows}:
        with (root / split_dir / f"{s}_{split_dir}.csv").open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            for r in rows:
                if r["subject"] == s:
                    writer.writerow([r["question"], *r["choices"], "ABCD"[r["answer"]]])


def test_hendrycks_csv_layout(tmp_path):
    rows, dev = rows_of(), dev_rows()
    rows[0] = {**rows[0], "question": "A question\nspanning, \"quoted\" lines"}
    write_hendrycks(tmp_path, "test", rows)
    write_hendrycks(tmp_path, "dev", dev)
    write_hendrycks(tmp_path, "val", rows[:3])
    expect_same(load_mmlu(tmp_path, shots=2), rows, dev)
    val = load_mmlu(tmp_path, shots=0, eval_split="validation")
    assert len(val.questions) == 3


def hf_datasetdict(splits: dict[str, list[dict]]):
    """A DatasetDict with cais/mmlu's features (answer is a ClassLabel)."""
    import datasets

    features = datasets.Features({
        "question": datasets.Value("string"),
        "subject": datasets.Value("string"),
        "choices": datasets.Sequence(datasets.Value("string")),
        "answer": datasets.ClassLabel(names=["A", "B", "C", "D"]),
    })
    return datasets.DatasetDict(
        {name: datasets.Dataset.from_list(rows, features=features) for name, rows in splits.items()}
    )


def test_datasets_save_to_disk(tmp_path):
    rows, dev = rows_of(), dev_rows()
    hf_datasetdict({"test": rows, "dev": dev, "validation": rows[:2]}).save_to_disk(tmp_path / "saved")
    expect_same(load_mmlu(tmp_path / "saved", shots=2), rows, dev)


def test_hub_id_goes_through_load_dataset_all(monkeypatch):
    import datasets

    rows, dev = rows_of(), dev_rows()
    calls = []

    def fake_load_dataset(name, config):
        calls.append((name, config))
        return hf_datasetdict({"test": rows, "dev": dev})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    data = load_mmlu("cais/mmlu", shots=2)
    assert calls == [("cais/mmlu", "all")]
    expect_same(data, rows, dev)
    first = next(i for i, r in enumerate(rows) if r["question"] == data.questions[0].question)
    assert data.questions[0].source == f"cais/mmlu[test]#row {first}"


def test_partial_dev_split_falls_back_per_subject(tmp_path, caplog):
    rows = rows_of()
    write_jsonl(tmp_path / "test.jsonl", rows)
    write_jsonl(tmp_path / "dev.jsonl", dev_rows(subjects=("anatomy",)))
    with caplog.at_level(logging.WARNING):
        data = load_mmlu(tmp_path, shots=2)
    assert data.fewshot_policy == "dev+holdout"
    assert data.held_out == {"marketing": 2}
    assert data.fewshot["anatomy"][0].question.startswith("dev anatomy")
    assert "holding out" in caplog.text


# ---------------------------------------------------------------------- bad input


def test_unknown_subject_names_close_matches():
    with pytest.raises(UnknownSubjectError, match=r"'astronomi'.*Did you mean: astronomy"):
        load_mmlu(MMLU_JSONL, subjects=["astronomi"])


def test_subject_missing_from_data(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", rows_of())
    with pytest.raises(UnknownSubjectError, match=r"'virology' is not in .*subjects there: anatomy, marketing"):
        load_mmlu(path, subjects=["virology"])


GOOD = {"question": "q?", "subject": "anatomy", "choices": ["a", "b", "c", "d"], "answer": 1}


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"question": "q?", "subject": "anatomy"', r"bad\.jsonl:2: invalid JSON"),
        ({**GOOD, "answer": 4}, r"bad\.jsonl:2: answer 4 is not 0-3 or A-D"),
        ({**GOOD, "answer": "E"}, r"bad\.jsonl:2: answer 'E' is not 0-3 or A-D"),
        ({**GOOD, "answer": True}, r"answer True is not 0-3 or A-D"),
        ({k: v for k, v in GOOD.items() if k != "choices"}, r"bad\.jsonl:2: missing key\(s\) 'choices'"),
        ({**GOOD, "choices": ["a", "b", "c"]}, r"choices must be a list of 4 strings"),
        ({**GOOD, "question": ""}, r"question must be a non-empty string"),
        ('["not", "an", "object"]', r"bad\.jsonl:2: row is a list"),
    ],
)
def test_malformed_jsonl_rows(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, line])
    with pytest.raises(MalformedRowError, match=message):
        load_mmlu(path)


def test_unknown_subject_in_a_row_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, GOOD, {**GOOD, "subject": "anatommy"}])
    with pytest.raises(UnknownSubjectError, match=r"'anatommy' \(.*bad\.jsonl:3\).*Did you mean: anatomy"):
        load_mmlu(path)


def test_answer_letters_are_accepted():
    assert mmlu_data.parse_answer("c", "x") == 2 and mmlu_data.parse_answer(3, "x") == 3


def test_malformed_csv_rows_name_file_and_line(tmp_path):
    (tmp_path / "test").mkdir()
    path = tmp_path / "test" / "anatomy_test.csv"
    path.write_text('q1,a,b,c,d,A\n"multi\nline q",a,b,c,d,B\nq3,a,b,c,d\n', encoding="utf-8")
    with pytest.raises(MalformedRowError, match=r"anatomy_test\.csv:4: 5 CSV columns, expected 6"):
        load_mmlu(tmp_path, shots=0)
    path.write_text("q1,a,b,c,d,E\n", encoding="utf-8")
    with pytest.raises(MalformedRowError, match=r"anatomy_test\.csv:1: answer 'E'"):
        load_mmlu(tmp_path, shots=0)


def test_csv_file_with_unknown_subject_name(tmp_path):
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "anatomyy_test.csv").write_text("q,a,b,c,d,A\n", encoding="utf-8")
    with pytest.raises(UnknownSubjectError, match="anatomyy.*Did you mean: anatomy"):
        load_mmlu(tmp_path, shots=0)


def test_bad_sources(tmp_path):
    with pytest.raises(MMLUDataError, match="not found"):
        load_mmlu(tmp_path / "nope.jsonl")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(MMLUDataError, match=r"unknown file type '\.txt'"):
        load_mmlu(tmp_path / "x.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MMLUDataError, match="no MMLU data found"):
        load_mmlu(tmp_path / "empty")
    only_dev = tmp_path / "only_dev"
    only_dev.mkdir()
    write_jsonl(only_dev / "dev.jsonl", dev_rows())
    with pytest.raises(MissingSplitError, match="has no split 'test'; splits: dev"):
        load_mmlu(only_dev)
