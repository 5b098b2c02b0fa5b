"""Shared fixtures for the data pipeline tests: tokenizers standing in for Llama-2's and Falcon's, small corpora.

The real Llama-2 ``tokenizer.model`` and Falcon ``tokenizer.json`` cannot be downloaded here, so the tests use
faithful stand-ins built on the spot:

* ``llama2_like``: a sentencepiece model trained with Llama-2's published trainer settings (BPE, byte fallback,
  split digits, identity normalisation, dummy prefix, ``<unk>``=0 ``<s>``=1 ``</s>``=2), smaller vocabulary.
* ``falcon_like``: a ``tokenizers`` byte-level BPE with Falcon's structure: its pre-tokenizer sequence
  (Punctuation, ByteLevel, Digits, 3-digit Split), ByteLevel decoder, the eleven ``>>TITLE<<``-style tokens at ids
  0-10, ``<|endoftext|>`` at id 11 as EOS, no BOS, and a tokenizer_config.json like Falcon's.

Set ``ZEROTRAIN_REAL_LLAMA2_TOKENIZER`` / ``ZEROTRAIN_REAL_FALCON_TOKENIZER`` to the real files to run the
tokenizer tests against them too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Nothing in these tests may reach the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from zerotrain.data.tokenizer import train_sentencepiece  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data" / "corpus" / "shakespeare_milton.txt"
FALCON_SPECIAL_TOKENS = [">>TITLE<<", ">>ABSTRACT<<", ">>INTRODUCTION<<", ">>SUMMARY<<", ">>COMMENT<<", ">>ANSWER<<",
                         ">>QUESTION<<", ">>DOMAIN<<", ">>PREFIX<<", ">>SUFFIX<<", ">>MIDDLE<<", "<|endoftext|>"]

@pytest.fixture(scope="session")
def corpus_slice() -> str:
    """About 200 KB of the shipped corpus (several plays' worth of paragraphs)."""
    return CORPUS.read_text(encoding="utf-8")[:200_000]


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory, corpus_slice) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "slice.txt"
    path.write_text(corpus_slice, encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def llama2_like(tmp_path_factory, corpus_slice) -> Path:
    """A tokenizer.model trained with Llama-2's settings (vocab 1000 instead of 32000, for speed)."""
    path = tmp_path_factory.mktemp("llama2_like") / "tokenizer.model"
    train_sentencepiece([corpus_slice], path, vocab_size=1000)
    return path


@pytest.fixture(scope="session")
def falcon_like(tmp_path_factory, corpus_slice) -> Path:
    """A tokenizer.json (+ tokenizer_config.json) with Falcon's structure and special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Punctuation(behavior="contiguous"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.Split(Regex("[0-9][0-9][0-9]"), behavior="isolated", invert=False),
    ])
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=FALCON_SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus_slice.split("\n\n"), trainer)
    directory = tmp_path_factory.mktemp("falcon_like")
    tokenizer.save(str(directory / "tokenizer.json"))
    # Falcon-7b's tokenizer_config.json names only the EOS token.
    config = {"add_prefix_space": False, "eos_token": "<|endoftext|>", "model_max_length": 2048,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"



# Llama-3's tokenizer.json, written out independently of zerotrain.data.tokenizer: its Split pattern, a regex-free
# ByteLevel pre-tokenizer, BPE with ignore_merges, and its 256 special tokens in their order.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_NAMED = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>", 7: "<|end_header_id|>",
                 9: "<|eot_id|>"}
LLAMA3_SPECIAL_TOKENS = [_LLAMA3_NAMED.get(i, "") for i in range(256)]
_reserved = iter(range(256))
LLAMA3_SPECIAL_TOKENS = [t or f"<|reserved_special_token_{next(_reserved)}|>" for t in LLAMA3_SPECIAL_TOKENS]


@pytest.fixture(scope="session")
def llama3_like(tmp_path_factory, corpus_slice) -> Path:
    """A tokenizer.json with the real Llama-3's id layout: BPE merges learnt from the corpus, the merged vocabulary
    filled up to 128,000 ids with tokens no text reaches, then the 256 special tokens (<|begin_of_text|> = 128000,
    <|end_of_text|> = 128001, <|eot_id|> = 128009): 128,256 ids, so shards need 32-bit ids. No tokenizer_config.json,
    like the real file's directory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=1500, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus_slice.split("\n\n"), trainer)
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    vocab.update({f"unreachable{i}": i for i in range(len(vocab), 128000)})
    data["model"]["ignore_merges"] = True
    data["added_tokens"] = [{"id": 128000 + i, "content": name, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}
                            for i, name in enumerate(LLAMA3_SPECIAL_TOKENS)]
    directory = tmp_path_factory.mktemp("llama3_like")
    (directory / "tokenizer.json").write_text(json.dumps(data))
    return directory / "tokenizer.json"
