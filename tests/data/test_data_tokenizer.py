"""Tokenizers: exact round trips, special ids, loading from directories, and Hugging Face export."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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


# Text on which a Hugging Face re-export of a tokenizer can differ from the original: text that starts with
# whitespace (sentencepiece's dummy prefix), runs of spaces, newlines and tabs, digits (split one by one), characters
# outside the vocabulary (byte fallback), and no text at all. HF reads special-token strings such as "</s>" in text
# as special tokens (we never do, see zerotrain.data.tokenizer), so they are left out here.
EXPORT_TEXTS = [
    " Hello world", "  two leading spaces", "   three", " ", "  ", "     ", "\n", "\nnewline first", "\ttab first",
    " \t \n mixed", "several     spaces   inside", "line one\nline two\n\n\nline five\n", "tabs\tand\t\ttabs",
    "digits 0123456789 3.14159 1,000,000", " 2024", "1999 and 2000", "\u00a0no-break space", " 🤖 space then bytes",
    "trailing   ", "\r\nwindows line\r\n", *[t for t in TRICKY_TEXTS if "</s>" not in t],
]


def _exported_tokenizer_dir(source: Path, out: Path, model_type: str) -> Path:
    """``save_pretrained`` into ``out`` next to a config.json naming the model type, as in a model export (which
    changes how AutoTokenizer picks the tokenizer class)."""
    load_tokenizer(source).save_pretrained(out)
    (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    return out


@pytest.fixture(params=["llama2_like", "falcon_like", "real_llama2", "real_falcon"])
def export_source(request) -> tuple[Path, str]:
    """(tokenizer file, model type): the stand-ins, and the real files where the environment names them."""
    if request.param.startswith("real_"):
        variable = f"ZEROTRAIN_REAL_{request.param[5:].upper()}_TOKENIZER"
        if not os.environ.get(variable):
            pytest.skip(f"{variable} not set")
        source = Path(os.environ[variable])
    else:
        source = request.getfixturevalue(request.param)
    return source, "llama" if "llama" in request.param else "falcon"


def test_exported_tokenizer_gives_the_training_ids_in_transformers(export_source, tmp_path):
    """What AutoTokenizer loads from an export is the fast tokenizer, and it encodes exactly as the training data was
    encoded; with add_special_tokens it puts BOS in front where the model has one (Llama-2), nothing else."""
    from transformers import AutoTokenizer

    source, model_type = export_source
    ours = load_tokenizer(source)
    theirs = AutoTokenizer.from_pretrained(str(_exported_tokenizer_dir(source, tmp_path, model_type)))
    assert theirs.is_fast
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)
    assert (ours.bos_id is not None) == (model_type == "llama")
    bos = [] if ours.bos_id is None else [ours.bos_id]
    for text in EXPORT_TEXTS:
        ids = ours.encode(text)
        assert theirs.encode(text, add_special_tokens=False) == ids, repr(text)
        assert theirs.encode(text) == bos + ids, repr(text)
        assert theirs.decode(ids) == text, repr(text)


def test_exported_llama_tokenizer_keeps_the_leading_space_piece_that_a_conversion_loses(llama2_like, tmp_path):
    """Negative control for the test above: the export as it was before (tokenizer.model with a LlamaTokenizer config,
    converted by transformers at load time) drops sentencepiece's dummy-prefix piece when text starts with a space."""
    from transformers import AutoTokenizer

    ours = load_tokenizer(llama2_like)
    export = _exported_tokenizer_dir(llama2_like, tmp_path / "export", "llama")
    converted = tmp_path / "converted"
    converted.mkdir()
    shutil.copy(export / "tokenizer.model", converted)
    config = {**json.loads((export / "tokenizer_config.json").read_text()), "tokenizer_class": "LlamaTokenizer"}
    (converted / "tokenizer_config.json").write_text(json.dumps(config))
    text = " Hello world"
    assert ours.token_text(ours.encode(text)[0]) == "▁"  # the dummy prefix, alone before "▁Hello"
    assert AutoTokenizer.from_pretrained(str(converted)).encode(text, add_special_tokens=False) == ours.encode(text)[1:]
    assert AutoTokenizer.from_pretrained(str(export)).encode(text, add_special_tokens=False) == ours.encode(text)


# Loads a tokenizer directory with sentencepiece and protobuf made unimportable, as in an environment without them.
WITHOUT_SENTENCEPIECE_AND_PROTOBUF = """
import sys
sys.modules["sentencepiece"] = sys.modules["google.protobuf"] = None
from transformers import AutoTokenizer
print(AutoTokenizer.from_pretrained(sys.argv[1]).encode(sys.argv[2], add_special_tokens=False))
"""


def test_exported_tokenizer_loads_without_sentencepiece_or_protobuf(llama2_like, tmp_path):
    """lm-evaluation-harness and other users need neither package for our export; the old export (tokenizer.model
    and a LlamaTokenizer config, the negative control) could not be loaded without protobuf."""
    ours = load_tokenizer(llama2_like)
    export = _exported_tokenizer_dir(llama2_like, tmp_path / "export", "llama")
    text = " Hello world"
    run = [sys.executable, "-c", WITHOUT_SENTENCEPIECE_AND_PROTOBUF, str(export), text]
    loaded = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert json.loads(loaded.stdout.strip().splitlines()[-1]) == ours.encode(text)
    (export / "tokenizer.json").unlink()
    config = {**json.loads((export / "tokenizer_config.json").read_text()), "tokenizer_class": "LlamaTokenizer"}
    (export / "tokenizer_config.json").write_text(json.dumps(config))
    assert subprocess.run(run, capture_output=True, text=True, timeout=120).returncode != 0


def test_transformers_tokenizer_of_our_export_is_the_same_tokenizer(llama2_like, falcon_like, tmp_path):
    """The evaluator scores a Hugging Face checkpoint through TransformersTokenizer, the trainer through our loader:
    on our export the two agree on special ids, vocabulary, ids and offsets."""
    from transformers import AutoTokenizer

    # Special-token strings in text are special for transformers, text for us (see the module docstring).
    texts = [t for t in EXPORT_TEXTS if t]
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
