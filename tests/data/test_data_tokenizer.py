"""Tokenizers: exact round trips, special ids, loading from directories, and Hugging Face export."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from zerotrain.data.tokenizer import TransformersTokenizer, as_tokenizer, load_tokenizer, train_sentencepiece
from zerotrain.errors import DataError

# Text that exercises what a tokenizer can get wrong: unicode outside the training text, runs of whitespace, tabs,
# newlines, digits, leading/trailing spaces, and strings that look like special tokens.
TRICKY_TEXTS = [
    "Hello, world!",
    "  two leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nthree",
    "digits 0123456789 3.14159 1,000,000",
    "naïve café, Ærøskøbing, 日本語のテキスト, Ελληνικά, русский, emoji 🤖🚀👩‍👩‍👧",
    "</s> <s> <|endoftext|> >>ABSTRACT<< [INST] are just text here",
    "\r\nwindows line\r\n",
    "",
]


@pytest.fixture(params=["trained", "llama2_like", "falcon_like"])
def any_tokenizer(request, tmp_path, corpus_slice):
    if request.param == "trained":
        return train_sentencepiece([corpus_slice[:50_000]], tmp_path / "tokenizer.model", vocab_size=400)
    return load_tokenizer(request.getfixturevalue(request.param))


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_decode_inverts_encode_exactly(any_tokenizer, text):
    ids = any_tokenizer.encode(text)
    assert all(0 <= i < any_tokenizer.vocab_size for i in ids)
    assert any_tokenizer.decode(ids) == text


def test_encode_never_adds_bos_or_eos_and_treats_special_strings_as_text(any_tokenizer):
    ids = any_tokenizer.encode("</s> <s> <|endoftext|>")
    assert any_tokenizer.eos_id not in ids
    assert any_tokenizer.bos_id is None or any_tokenizer.bos_id not in ids


def test_encode_batch_matches_encode(any_tokenizer):
    texts = [t for t in TRICKY_TEXTS if t] * 3
    assert any_tokenizer.encode_batch(texts, num_threads=2) == [any_tokenizer.encode(t) for t in texts]


def test_llama2_like_special_ids_match_llama2(llama2_like):
    tok = load_tokenizer(llama2_like)
    assert (tok.kind, tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == ("sentencepiece", 1, 2, None, 1000)
    assert [tok.token_text(i) for i in (0, 1, 2)] == ["<unk>", "<s>", "</s>"]
    # Llama-2 splits digits and spells unseen characters as bytes.
    assert [tok.decode([i]) for i in tok.encode("2024")][-4:] == ["2", "0", "2", "4"]
    assert "<0xF0>" in [tok.token_text(i) for i in tok.encode("🤖")]


def test_falcon_like_special_ids_match_falcon(falcon_like):
    tok = load_tokenizer(falcon_like)
    assert (tok.kind, tok.eos_id, tok.bos_id, tok.token_text(11)) == ("tokenizer_json", 11, None, "<|endoftext|>")
    assert tok.token_text(1) == ">>ABSTRACT<<"


def test_tokenizer_json_without_config_finds_eos_by_name(falcon_like, tmp_path):
    shutil.copy(falcon_like, tmp_path / "tokenizer.json")
    assert load_tokenizer(tmp_path).eos_id == 11


def test_tokenizer_trained_twice_is_byte_identical(tmp_path, corpus_slice):
    a = train_sentencepiece([corpus_slice], tmp_path / "a" / "tokenizer.model", vocab_size=800)
    b = train_sentencepiece([corpus_slice], tmp_path / "b" / "tokenizer.model", vocab_size=800)
    assert a.path.read_bytes() == b.path.read_bytes()


def test_directory_prefers_sentencepiece_model(llama2_like, falcon_like, tmp_path):
    shutil.copy(llama2_like, tmp_path / "tokenizer.model")
    shutil.copy(falcon_like, tmp_path / "tokenizer.json")
    assert load_tokenizer(tmp_path).kind == "sentencepiece"


def test_missing_tokenizer_names_the_path(tmp_path):
    with pytest.raises(DataError, match=str(tmp_path / "nope.model")):
        load_tokenizer(tmp_path / "nope.model")
    with pytest.raises(DataError, match="no tokenizer.model or tokenizer.json"):
        load_tokenizer(tmp_path)


def test_too_large_vocab_for_the_text_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="Vocabulary size too high.*lower tokenizer.train_vocab_size"):
        train_sentencepiece(["tiny text"], tmp_path / "t.model", vocab_size=5000)


def test_save_pretrained_loads_in_transformers_with_the_same_ids(llama2_like, falcon_like, tmp_path):
    from transformers import AutoTokenizer

    # HF's converted Llama tokenizer differs from sentencepiece on text that *starts* with whitespace (a known
    # conversion difference, not ours), so compare on text that does not.
    texts = [t for t in TRICKY_TEXTS if t and not t[0].isspace()]
    for name, source in (("llama", llama2_like), ("falcon", falcon_like)):
        ours = load_tokenizer(source)
        ours.save_pretrained(tmp_path / name)
        theirs = AutoTokenizer.from_pretrained(str(tmp_path / name))
        assert theirs.eos_token_id == ours.eos_id
        assert theirs.bos_token_id == ours.bos_id
        for text in texts:
            if "</s>" not in text:  # HF reads special-token strings in text as special tokens; we never do
                assert theirs.encode(text, add_special_tokens=False) == ours.encode(text), (name, text)
            assert theirs.decode(ours.encode(text)) == text
        if name == "llama":
            assert theirs("Hello")["input_ids"][0] == 1  # Llama-2 prepends BOS at inference


def test_transformers_tokenizer_of_our_export_is_the_same_tokenizer(llama2_like, falcon_like, tmp_path):
    """The evaluator scores a Hugging Face checkpoint through TransformersTokenizer, the trainer through our loader:
    on our export the two agree on special ids, vocabulary, ids and offsets."""
    from transformers import AutoTokenizer

    # Special-token strings in text are special for transformers, text for us (see the module docstring).
    texts = [t for t in TRICKY_TEXTS if t and not t[0].isspace() and "</s>" not in t]
    for name, source in (("llama", llama2_like), ("falcon", falcon_like)):
        ours = load_tokenizer(source)
        ours.save_pretrained(tmp_path / name)
        theirs = as_tokenizer(AutoTokenizer.from_pretrained(str(tmp_path / name)))
        assert isinstance(theirs, TransformersTokenizer) and as_tokenizer(ours) is ours
        assert (theirs.bos_id, theirs.eos_id, theirs.pad_id, theirs.vocab_size) == \
            (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size), name
        for text in texts:
            assert theirs.encode_with_offsets(text) == ours.encode_with_offsets(text), (name, text)
            assert theirs.decode(theirs.encode(text)) == text
        assert theirs.encode_batch(texts) == ours.encode_batch(texts)


@pytest.mark.skipif(not os.environ.get("ZEROTRAIN_REAL_LLAMA2_TOKENIZER"), reason="real Llama-2 file not given")
def test_real_llama2_tokenizer_round_trips():
    tok = load_tokenizer(Path(os.environ["ZEROTRAIN_REAL_LLAMA2_TOKENIZER"]))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (32000, 1, 2)
    for text in TRICKY_TEXTS:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.skipif(not os.environ.get("ZEROTRAIN_REAL_FALCON_TOKENIZER"), reason="real Falcon file not given")
def test_real_falcon_tokenizer_round_trips():
    tok = load_tokenizer(Path(os.environ["ZEROTRAIN_REAL_FALCON_TOKENIZER"]))
    assert (tok.vocab_size, tok.eos_id) == (65024, 11)
    for text in TRICKY_TEXTS:
        assert tok.decode(tok.encode(text)) == text
