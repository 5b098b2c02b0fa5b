"""MMLU-style fine-tuning data: auxiliary-train questions in the evaluator's prompt format, the loss on the answer
letter only, never a test question."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerotrain.data.mmlu_sft import HEADER, convert
from zerotrain.data.prepare import PrepareConfig, TokenizerArgs, prepare
from zerotrain.data.shards import PreparedDataset
from zerotrain.data.tokenizer import load_tokenizer
from zerotrain.errors import DataError
from zerotrain.evaluation.mmlu.data import Question
from zerotrain.evaluation.mmlu.prompt import build_prompt, format_header

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "data" / "mmlu" / "auxiliary_train_sample.jsonl"
TEST = REPO / "data" / "mmlu" / "test.jsonl"


def test_records_are_the_evaluators_prompt_with_the_letter_as_response(tmp_path):
    out = tmp_path / "aux.jsonl"
    result = convert([SAMPLE], out, TEST)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert result.written == len(records) == 12 and result.dropped_test_overlap == 0
    first = json.loads(SAMPLE.read_text().splitlines()[0])["train"]
    question = Question("astronomy", first["question"], tuple(first["choices"]), first["answer"], "")
    # The evaluator's zero-shot prompt for the same question, minus its subject line, is the training prompt.
    evaluator = build_prompt(question, [])
    assert records[0]["prompt"] == HEADER + evaluator[len(format_header("astronomy")):]
    assert records[0]["prompt"].endswith("\nD. helium\nAnswer:") and records[0]["response"] == " C"


def test_hendrycks_csv_gives_the_same_records(tmp_path):
    import csv

    rows = [json.loads(line)["train"] for line in SAMPLE.read_text().splitlines()]
    directory = tmp_path / "auxiliary_train"
    directory.mkdir()
    with (directory / "arc_easy.csv").open("w", newline="") as f:
        csv.writer(f).writerows([[r["question"], *r["choices"], "ABCD"[r["answer"]]] for r in rows])
    convert([directory], tmp_path / "csv.jsonl", TEST)
    convert([SAMPLE], tmp_path / "jsonl.jsonl", TEST)
    assert (tmp_path / "csv.jsonl").read_text() == (tmp_path / "jsonl.jsonl").read_text()


def test_the_test_split_is_refused_and_test_questions_are_dropped(tmp_path):
    with pytest.raises(DataError, match="test.jsonl:1: row of MMLU subject .* never be trained on"):
        convert([TEST], tmp_path / "out.jsonl", TEST)
    assert not (tmp_path / "out.jsonl").exists()
    # A test question smuggled into auxiliary-train-like rows (subject left empty) is dropped, whitespace aside.
    leaked = json.loads(TEST.read_text().splitlines()[5])
    leaked = {"question": "  " + leaked["question"].replace(" ", "  "), "subject": "", "choices": leaked["choices"],
              "answer": leaked["answer"]}
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(SAMPLE.read_text() + json.dumps(leaked) + "\n")
    result = convert([mixed], tmp_path / "out.jsonl", TEST)
    assert (result.written, result.dropped_test_overlap) == (12, 1)
    # Negative control: checked against an empty "test set", the same row is kept.
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert convert([mixed], tmp_path / "out2.jsonl", empty).written == 13


def test_prepared_mmlu_set_trains_on_the_answer_letter_and_eos_only(tmp_path, llama2_like):
    convert([SAMPLE], tmp_path / "aux.jsonl", TEST)
    prepare(PrepareConfig(input=str(tmp_path / "aux.jsonl"), output=str(tmp_path / "out"), kind="sft",
                          chat_template="completion", tokenizer=TokenizerArgs(path=str(llama2_like)),
                          valid_fraction=0.0, progress=False))
    tok = load_tokenizer(tmp_path / "out")
    reader = PreparedDataset(tmp_path / "out").split("train")
    offsets = reader.document_offsets()
    records = [json.loads(line) for line in (tmp_path / "aux.jsonl").read_text().splitlines()]
    assert len(offsets) - 1 == len(records)
    for a, b in zip(offsets[:-1], offsets[1:]):
        ids, mask = reader.tokens(int(a), int(b - a)).tolist(), reader.mask(int(a), int(b - a)).tolist()
        trained = [i for i, m in zip(ids, mask) if m]
        assert ids[0] == tok.bos_id and mask[0] == 0
        assert trained[-1] == tok.eos_id and tok.decode(trained[:-1]).strip() in ("A", "B", "C", "D")
        assert tok.decode(ids[1:-1]) in {r["prompt"] + r["response"] for r in records}
