"""Shared helpers of the evaluation tests: a tiny Llama + locally trained tokenizer.

Nothing is downloaded: the tokenizer is a BPE (sentencepiece-style "▁" spaces,
BOS added like Llama's) trained here on a few KB of MMLU text, the model is a
random 2-layer Llama with a fixed seed, both saved as an HF export directory.
Built once per process (functools.cache) and removed at exit.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

from tools.launcher import REPO

MMLU_JSONL = REPO / "data" / "mmlu" / "test.jsonl"
MAX_POSITIONS = 512
SEED = 1234


import torch  # noqa: E402

# On a shared 2-core box, torch's second OpenMP thread spin-waits against other
# processes and makes these tiny forwards ~50x slower; one thread is fastest.
torch.set_num_threads(1)

# What mmlu_zero3_worker.py evaluates under ZeRO-3 and the test recomputes in-process.
ZERO3_CASES = {
    # 15 questions, 3 per batch -> 5 batches on 4 ranks: ranks 1-3 run a padding batch.
    "uneven": dict(subjects=["abstract_algebra", "anatomy", "marketing"], shots=2, limit=5, batch_size=3),
    # 2 questions -> 1 batch: three ranks only run padding batches.
    "tiny": dict(subjects=["sociology"], shots=1, limit=2, batch_size=4),
}


def read_rows(limit: int | None = None) -> list[dict]:
    rows = []
    with MMLU_JSONL.open(encoding="utf-8") as f:
        for line in f:
            rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def _training_text(n_rows: int = 120) -> list[str]:
    """A few KB of MMLU questions in prompt format, so ':' '\\n' 'Answer' are in vocab."""
    texts = []
    for r in read_rows(n_rows):
        body = r["question"] + "".join(f"\n{letter}. {c}" for letter, c in zip("ABCD", r["choices"]))
        texts.append(f"{body}\nAnswer: {'ABCD'[r['answer']]}\n\n")
    # Real Llama/Falcon vocabularies have single tokens for " A".." D"; make sure this
    # small one does too, so the one-row-per-question scoring path is the common one.
    texts += ["Answer: A Answer: B Answer: C Answer: D "] * 50
    return texts


def _tempdir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="zerotrain-eval-test-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def train_tokenizer(vocab_size: int = 800, char_level: bool = False):
    """A Llama-like (Metaspace, BOS-prepending) PreTrainedTokenizerFast trained locally.

    ``char_level``: no merges at all, so " A" encodes as two tokens "▁", "A" and
    the multi-token continuation path is exercised.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    text = _training_text()
    alphabet = sorted(set("".join(text)) | set("▁"))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    specials = ["<unk>", "<s>", "</s>"]
    size = len(specials) + len(alphabet) if char_level else vocab_size
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=specials, initial_alphabet=alphabet)
    tok.train_from_iterator(text, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def llama_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        # Wider than the default 0.02 so choices differ by more than float noise.
        initializer_range=0.2,
    )


def build_export(directory: Path, char_level: bool = False) -> Path:
    from transformers import LlamaForCausalLM

    tokenizer = train_tokenizer(char_level=char_level)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(llama_config(len(tokenizer)))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@functools.cache
def tiny_export() -> Path:
    """HF export dir (config.json + model.safetensors + tokenizer) of the tiny Llama."""
    return build_export(_tempdir() / "tiny-llama")


@functools.cache
def tiny_char_export() -> Path:
    """Same model shape with a character-level tokenizer (multi-token continuations)."""
    return build_export(_tempdir() / "tiny-llama-char", char_level=True)


@functools.cache
def load_tiny(char_level: bool = False):
    """(model, tokenizer) loaded back from the export, model in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_char_export() if char_level else tiny_export()
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def write_jsonl(path: Path, rows: list[dict] | list[str]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path
