"""Prompt format, lm-eval-style pair tokenisation, few-shot dropping, too-long questions."""

from __future__ import annotations

import pytest
import torch
from mmlu_testlib import load_tiny

from zerotrain.data.tokenizer import Tokenizer, TransformersTokenizer, as_tokenizer
from zerotrain.evaluation import (
    MMLUData,
    PromptTooLongError,
    Question,
    build_prompt,
    evaluate,
    prepare_mmlu,
)
from zerotrain.evaluation.loglikelihood import encode_pair
from zerotrain.evaluation.mmlu.prompt import encode_question


def q(text: str, answer: int = 0, subject: str = "college_physics") -> Question:
    return Question(subject, text, ("one", "two", "three", "four"), answer, "mem:1")


class CharTokenizer(Tokenizer):
    """One token per character (its code point) and no BOS, so lengths are easy to reason about."""

    kind = "characters"
    vocab_size = 0x110000
    bos_id = eos_id = pad_id = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        return self.encode(text), list(range(len(text)))

    def decode(self, ids) -> str:
        return "".join(map(chr, ids))

    def token_text(self, token_id: int) -> str:
        return chr(token_id)

    def save_pretrained(self, out_dir):
        raise NotImplementedError("a test tokenizer without files")


def test_prompt_format_is_hendrycks_lm_eval():
    prompt = build_prompt(q("  What?  "), [q("Why?", answer=2)])
    assert prompt == (
        "The following are multiple choice questions (with answers) about college physics.\n\n"
        "Why?\nA. one\nB. two\nC. three\nD. four\nAnswer: C\n\n"
        "What?\nA. one\nB. two\nC. three\nD. four\nAnswer:"
    )


def test_encode_pair_splits_like_lm_eval():
    _, hf = load_tiny()
    tok = TransformersTokenizer(hf)
    assert tok.bos_id == hf.bos_token_id  # this tokenizer adds <s> by default, like Llama's
    ctx, cont = encode_pair(tok, "x\nAnswer:", " D")
    assert ctx == hf("x\nAnswer:")["input_ids"]
    assert hf.convert_ids_to_tokens(cont) == ["▁D"]  # the sentencepiece-style space token
    # A trailing space in the context moves to the continuation.
    assert encode_pair(tok, "x\nAnswer: ", "D") == (ctx, cont)
    assert TransformersTokenizer(hf, add_bos=False).bos_id is None


def test_tokenizer_protocol():
    custom = CharTokenizer()
    assert as_tokenizer(custom) is custom
    _, hf = load_tiny()
    assert isinstance(as_tokenizer(hf), TransformersTokenizer)
    with pytest.raises(TypeError, match="zerotrain.data.tokenizer.Tokenizer"):
        as_tokenizer(object())


def test_fewshot_examples_are_dropped_from_the_end_until_the_prompt_fits():
    question, shots = q("Q" * 50), [q(f"example {i}", answer=i % 4) for i in range(5)]
    lengths = [len(build_prompt(question, shots[:n])) + 1 for n in range(6)]  # +1: " A" is 2 chars
    tok = CharTokenizer()
    for n in range(6):
        encoded = encode_question(0, question, shots, tok, max_length=lengths[n])
        assert encoded.num_shots == n
        assert encoded.context == tok.encode(build_prompt(question, shots[:n]))  # nothing truncated
        too_tight = encode_question(0, question, shots, tok, max_length=lengths[n] - 1)
        assert getattr(too_tight, "num_shots", None) == (n - 1 if n else None)


def test_question_too_long_even_zero_shot_is_skipped_or_an_error():
    question = q("Q" * 50)
    skipped = encode_question(7, question, [], CharTokenizer(), max_length=20)
    assert skipped.index == 7 and "zero-shot" in skipped.reason and skipped.source == "mem:1"
    with pytest.raises(PromptTooLongError, match=r"mem:1 \(college_physics\): needs \d+ tokens zero-shot"):
        encode_question(7, question, [], CharTokenizer(), max_length=20, on_too_long="error")


def test_evaluate_counts_skipped_questions_and_can_raise():
    model, tokenizer = load_tiny()
    data = MMLUData(
        questions=[q("short?"), q("long " * 200, subject="anatomy")],
        fewshot={"college_physics": [q("ex?", 1)], "anatomy": []},
        shots=1, source="mem", eval_split="test", fewshot_policy="dev",
    )
    result = evaluate(model, tokenizer, data, batch_size=2, max_length=100, device="cpu")
    assert [s.index for s in result.skipped] == [1]
    assert result.micro.total == 1 and result.to_dict()["skipped"]["total"] == 1
    with pytest.raises(PromptTooLongError):
        evaluate(model, tokenizer, data, batch_size=2, max_length=100, device="cpu", on_too_long="error")
    prepared = prepare_mmlu(data, tokenizer, max_length=100)
    with pytest.raises(ValueError, match="prepared for max_length=100"):
        evaluate(model, tokenizer, prepared, batch_size=2, max_length=50, device=torch.device("cpu"))
