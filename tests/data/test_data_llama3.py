"""Llama-3 data: its byte-level BPE tokenizer.json read through our loader gives the tokenizer's own ids, documents
are framed <|begin_of_text|> ... <|end_of_text|>, 128,256 ids are stored as 32 bits, and a tokenizer of the same
kind can be trained for CPU-sized models.

``ZEROTRAIN_REAL_LLAMA3_TOKENIZER`` (e.g. ../shared/data/llama3_tokenizer/tokenizer.json) runs the checks against
Meta's file too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import LLAMA3_PATTERN, LLAMA3_SPECIAL_TOKENS
from test_data_tokenizer import EXPORT_TEXTS, TRICKY_TEXTS

from zerotrain.data.prepare import PrepareConfig, TokenizerArgs, prepare
from zerotrain.data.shards import PreparedDataset
from zerotrain.data.sources import iter_file_records, text_of
from zerotrain.data.tokenizer import load_tokenizer, train_llama3_bpe
from zerotrain.errors import DataError

REAL = os.environ.get("ZEROTRAIN_REAL_LLAMA3_TOKENIZER")
TEXTS = sorted(set(TRICKY_TEXTS + EXPORT_TEXTS) - {""})


@pytest.fixture(params=["llama3_like", "real_llama3"])
def llama3_file(request) -> Path:
    if request.param == "real_llama3":
        if not REAL:
            pytest.skip("ZEROTRAIN_REAL_LLAMA3_TOKENIZER not set")
        return Path(REAL)
    return request.getfixturevalue(request.param)


def test_llama3_tokenizer_gives_the_tokenizers_own_ids_and_llama3_special_ids(llama3_file):
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    ours = load_tokenizer(llama3_file)
    reference = tokenizers.Tokenizer.from_file(str(llama3_file))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(llama3_file))
    assert (ours.kind, ours.vocab_size, ours.bos_id, ours.eos_id) == ("tokenizer_json", 128256, 128000, 128001)
    assert [ours.token_text(128000 + i) for i in range(256)] == LLAMA3_SPECIAL_TOKENS
    for text in TEXTS:
        ids = ours.encode(text)
        if "<|" not in text:  # the reference reads special-token strings as control tokens, we never do
            assert ids == reference.encode(text, add_special_tokens=False).ids, repr(text)
            assert ids == fast.encode(text, add_special_tokens=False), repr(text)
        assert ours.decode(ids) == text, repr(text)
    assert ours.encode_batch(TEXTS, num_threads=2) == [ours.encode(t) for t in TEXTS]
    injected = ours.encode("<|begin_of_text|> <|end_of_text|> <|eot_id|>")
    assert not set(injected) & {128000, 128001, 128009} and ours.decode(injected).count("<|") == 3


@pytest.mark.skipif(not REAL, reason="ZEROTRAIN_REAL_LLAMA3_TOKENIZER not set")
def test_real_llama3_tokenizer_gives_the_published_ids():
    tok = load_tokenizer(Path(REAL))
    assert tok.encode("Hello, world!") == [9906, 11, 1917, 0]
    assert tok.token_text(128009) == "<|eot_id|>"


def test_llama3_documents_are_framed_by_its_bos_and_eos_in_32_bit_shards(llama3_file, tmp_path, corpus_file):
    result = prepare(PrepareConfig(input=str(corpus_file), output=str(tmp_path / "out"), progress=False,
                                   tokenizer=TokenizerArgs(path=str(llama3_file)), valid_fraction=0.0,
                                   txt_doc_chars=2000))
    assert result.manifest["dtype"] == "<u4"
    assert (result.manifest["tokenizer"]["bos_id"], result.manifest["tokenizer"]["eos_id"]) == (128000, 128001)
    shard = result.manifest["splits"]["train"]["shards"][0]
    assert (tmp_path / "out" / shard["files"]["tokens"]["path"]).stat().st_size == 4 * shard["num_tokens"]
    reader = PreparedDataset(tmp_path / "out").split("train")
    offsets = reader.document_offsets()
    tok = load_tokenizer(tmp_path / "out")
    records = [text_of(r, "text") for r in iter_file_records([corpus_file], "paragraphs", 2000)]
    for record, a, b in zip(records[:3], offsets[:3], offsets[1:4]):
        doc = reader.tokens(int(a), int(b - a))
        assert doc.dtype == np.dtype("<u4") and doc[0] == 128000 and doc[-1] == 128001
        assert doc[1:-1].tolist() == tok.encode(record) and tok.decode(doc[1:-1]) == record
    # Ids above 65535 (here: the special tokens) survive the round trip: a 16-bit store would wrap them.
    assert int(reader.tokens(0, 1)[0]) == 128000


def test_trained_llama3_tokenizer_has_llama3s_pipeline_and_special_tokens(tmp_path, corpus_slice, llama3_file):
    trained = train_llama3_bpe(corpus_slice.split("\n\n"), tmp_path / "a", vocab_size=1280)
    again = train_llama3_bpe(corpus_slice.split("\n\n"), tmp_path / "b", vocab_size=1280)
    assert trained.path.read_bytes() == again.path.read_bytes()
    ours, reference = (json.loads(Path(p).read_text()) for p in (trained.path, llama3_file))
    for key in ("normalizer", "pre_tokenizer", "decoder"):
        assert ours[key] == reference[key], key
    # Llama-3.1's post-processor: the ByteLevel one, then <|begin_of_text|> in front (with add_special_tokens only).
    assert ours["post_processor"]["processors"][0] == reference["post_processor"]
    from transformers import AutoTokenizer

    exported = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert exported.encode("To be") == [1024] + trained.encode("To be")
    assert ours["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] == LLAMA3_PATTERN
    assert ours["model"]["type"] == "BPE" and ours["model"]["ignore_merges"] is True
    assert (trained.vocab_size, trained.bos_id, trained.eos_id) == (1280, 1024, 1025)
    assert [trained.token_text(1024 + i) for i in range(256)] == LLAMA3_SPECIAL_TOKENS
    for text in TEXTS:
        assert trained.decode(trained.encode(text)) == text, repr(text)


def test_llama3_tokenizer_too_small_to_hold_bytes_and_special_tokens_is_refused(tmp_path):
    with pytest.raises(DataError, match="train_vocab_size=400 is too small for a Llama-3 tokenizer"):
        train_llama3_bpe(["some text"], tmp_path, vocab_size=400)


def test_unknown_train_kind_is_named_with_the_valid_ones(tmp_path, corpus_file):
    with pytest.raises(DataError, match="tokenizer.train_kind=lama3 is not valid. Did you mean 'llama3'"):
        prepare(PrepareConfig(input=str(corpus_file), output=str(tmp_path / "out"), progress=False,
                              tokenizer=TokenizerArgs(train_kind="lama3")))
    assert not (tmp_path / "out").exists()
