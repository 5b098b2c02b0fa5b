"""Preparation: determinism, manifest, document framing, inputs of every kind, atomic output, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from zerotrain.data.prepare import PrepareConfig, TokenizerArgs, is_valid, prepare
from zerotrain.data.shards import PreparedDataset, token_dtype
from zerotrain.data.sources import iter_file_records
from zerotrain.data.tokenizer import file_sha256, load_tokenizer
from zerotrain.errors import DataError


def run(tmp_path: Path, name: str = "out", **arguments):
    arguments.setdefault("tokenizer", TokenizerArgs(train_vocab_size=500))
    return prepare(PrepareConfig(output=str(tmp_path / name), progress=False, **arguments))


def all_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def split_documents(dataset: PreparedDataset, split: str) -> list[np.ndarray]:
    reader = dataset.split(split)
    offsets = reader.document_offsets()
    return [reader.tokens(int(a), int(b - a)) for a, b in zip(offsets[:-1], offsets[1:])]


def test_two_preparations_of_the_same_input_are_byte_identical(tmp_path, corpus_file):
    arguments = dict(input=str(corpus_file), valid_fraction=0.1, shard_tokens=10_000)
    run(tmp_path, "a", **arguments)
    run(tmp_path, "b", **arguments)
    a, b = all_files(tmp_path / "a"), all_files(tmp_path / "b")
    assert len(a) > 8  # several shards per split, tokenizer files, manifest
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], name


def test_manifest_counts_and_checksums_describe_the_files(tmp_path, corpus_file):
    result = run(tmp_path, input=str(corpus_file), valid_fraction=0.1, shard_tokens=10_000)
    manifest = json.loads((result.path / "manifest.json").read_text())
    assert manifest == result.manifest
    assert manifest["dtype"] == "<u2" and manifest["tokenizer"]["vocab_size"] == 500
    documents = list(iter_file_records([corpus_file]))
    assert sum(s["num_documents"] for s in manifest["splits"].values()) == len(documents)
    for split in manifest["splits"].values():
        assert split["num_tokens"] == sum(s["num_tokens"] for s in split["shards"])
        assert split["num_documents"] == sum(s["num_documents"] for s in split["shards"])
        for shard in split["shards"]:
            tokens = result.path / shard["files"]["tokens"]["path"]
            docs = np.fromfile(result.path / shard["files"]["docs"]["path"], dtype="<i8")
            assert tokens.stat().st_size == 2 * shard["num_tokens"]
            assert len(docs) == shard["num_documents"] + 1 and docs[-1] == shard["num_tokens"]
            for entry in shard["files"].values():
                assert file_sha256(result.path / entry["path"]) == entry["sha256"]
    tokenizer = manifest["tokenizer"]
    assert file_sha256(result.path / "tokenizer" / tokenizer["file"]) == tokenizer["sha256"]
    assert manifest["source"]["files"][0]["sha256"] == file_sha256(corpus_file)
    assert manifest["arguments"]["valid_fraction"] == 0.1 and "output" not in manifest["arguments"]


def test_each_document_is_bos_text_eos_and_splits_are_by_document(tmp_path, corpus_file):
    result = run(tmp_path, input=str(corpus_file), valid_fraction=0.2, seed=7)
    dataset = PreparedDataset(result.path)
    tokenizer = load_tokenizer(result.path)
    texts = [r.value for r in iter_file_records([corpus_file])]
    expected = {"train": [t for t in texts if not is_valid(t, 7, 0.2)],
                "valid": [t for t in texts if is_valid(t, 7, 0.2)]}
    assert 0 < len(expected["valid"]) < len(expected["train"])
    for split, wanted in expected.items():
        documents = split_documents(dataset, split)
        assert [tokenizer.decode(d[1:-1]) for d in documents] == wanted
        assert all(d[0] == tokenizer.bos_id and d[-1] == tokenizer.eos_id for d in documents)
        assert all(tokenizer.eos_id not in d[:-1] for d in documents)


def test_text_files_become_paragraph_groups(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("one\nline two\n\n\n\nthree\n   \nfour\n")
    assert [r.value for r in iter_file_records([path], "paragraphs", 0)] == ["one\nline two", "three", "four"]
    assert [r.value for r in iter_file_records([path], "paragraphs", 12)] == ["one\nline two", "three\n\nfour"]
    assert [r.value for r in iter_file_records([path], "file")] == [path.read_text()]


def test_falcon_tokenizer_has_no_bos_and_is_copied_into_the_data_set(tmp_path, corpus_file, falcon_like):
    result = run(tmp_path, input=str(corpus_file), tokenizer=TokenizerArgs(str(falcon_like)), max_documents=5)
    assert result.manifest["document"]["bos"] is False
    assert result.manifest["tokenizer"]["eos_id"] == 11
    copy = result.path / "tokenizer" / "tokenizer.json"
    assert copy.read_bytes() == falcon_like.read_bytes()
    documents = split_documents(PreparedDataset(result.path), "train")
    assert all(d[-1] == 11 and 11 not in d[:-1] for d in documents)
    assert load_tokenizer(result.path).eos_id == 11  # the copy is self-describing, even away from the original


def test_token_dtype_widens_past_65536():
    assert token_dtype(32000) == np.dtype("<u2") and token_dtype(65536) == np.dtype("<u2")
    assert token_dtype(65537) == np.dtype("<u4")


def test_jsonl_parquet_and_a_local_hf_dataset_give_the_same_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"Document number {i}: lorem ipsum dolor sit amet, {i * 7} times." for i in range(40)]
    raw = tmp_path / "raw"
    raw.mkdir()
    with open(raw / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts))
    pq.write_table(pa.table({"body": texts}), tmp_path / "data.parquet")
    tokenizer = run(tmp_path, "first", input=str(raw / "train.jsonl"), text_field="body",
                    tokenizer=TokenizerArgs(train_vocab_size=300)).path
    common = dict(text_field="body", valid_fraction=0.0, tokenizer=TokenizerArgs(str(tokenizer)))
    outputs = [
        run(tmp_path, "jsonl", input=str(raw / "train.jsonl"), **common),
        run(tmp_path, "parquet", input=str(tmp_path / "data.parquet"), **common),
        # The real datasets.load_dataset path, on a local directory (the hub is unreachable in tests).
        run(tmp_path, "hf", hf_dataset=str(raw), hf_cache_dir=str(tmp_path / "cache"), **common),
        run(tmp_path, "hf_stream", hf_dataset=str(raw), hf_streaming=True, **common),
    ]
    contents = [(r.path / "train" / "000000.tokens.bin").read_bytes() for r in outputs]
    assert all(c == contents[0] for c in contents)
    assert outputs[0].manifest["splits"]["train"]["num_documents"] == 40
    assert outputs[2].manifest["source"]["type"] == "hf_dataset"


def test_interrupted_preparation_leaves_no_data_set(tmp_path, corpus_file, monkeypatch):
    import zerotrain.data.prepare as module

    real_write = module.write_splits

    def write_then_die(*args, **kwargs):
        real_write(*args, **kwargs)  # shards are on disk, but the manifest is not
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "write_splits", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, input=str(corpus_file), max_documents=3)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_kept_unless_overwrite(tmp_path, corpus_file):
    run(tmp_path, input=str(corpus_file), max_documents=3)
    with pytest.raises(DataError, match="already exists.*overwrite=true"):
        run(tmp_path, input=str(corpus_file), max_documents=3)
    result = run(tmp_path, input=str(corpus_file), max_documents=4, overwrite=True)
    splits = result.manifest["splits"]
    assert splits["train"]["num_documents"] + splits["valid"]["num_documents"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_malformed_jsonl_line_is_reported_with_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": "broken\n')
    with pytest.raises(DataError, match=rf"{path}:3: malformed JSON"):
        run(tmp_path, input=str(path), tokenizer=TokenizerArgs())


def test_missing_text_field_names_the_record_and_the_fields(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"content": "hello"}\n')
    with pytest.raises(DataError, match=rf"{path}:1: no 'text' field \(fields: content\); set text_field="):
        run(tmp_path, input=str(path))


def test_missing_input_file_is_named(tmp_path):
    with pytest.raises(DataError, match=rf"input file {tmp_path / 'nope.txt'} does not exist"):
        run(tmp_path, input=str(tmp_path / "nope.txt"))
