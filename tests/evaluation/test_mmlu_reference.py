"""The evaluator against an independent, deliberately plain computation.

The reference below reads data/mmlu/test.jsonl with json, builds prompts with
string formatting, tokenises context and context+continuation with the HF
tokenizer (its default BOS handling, like lm-evaluation-harness), and scores
each choice with its own unbatched forward pass. The evaluator (batched,
padded, one row per question) must agree on prompts, log-likelihoods,
predictions and accuracy.
"""

from __future__ import annotations

import torch
from mmlu_testlib import MAX_POSITIONS, MMLU_JSONL, load_tiny, read_rows

from zerotrain.evaluation import build_prompt, evaluate, load_mmlu, prepare_mmlu

SUBJECTS = ["abstract_algebra", "anatomy", "high_school_european_history", "moral_scenarios"]
SHOTS, LIMIT = 3, 5


def plain_prompt(row: dict, examples: list[dict]) -> str:
    def body(r: dict) -> str:
        a, b, c, d = r["choices"]
        return f"{r['question'].strip()}\nA. {a}\nB. {b}\nC. {c}\nD. {d}\nAnswer:"

    subject = " ".join(row["subject"].split("_"))
    text = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    for ex in examples:
        text += body(ex) + " " + "ABCD"[ex["answer"]] + "\n\n"
    return text + body(row)


def plain_reference(model, tokenizer, subjects: list[str], shots: int, limit: int, max_length: int):
    """[(row, prompt | None, num_shots, [ll_A..ll_D] | None)] in the evaluator's order."""
    rows = read_rows()
    out = []
    for subject in sorted(subjects):
        mine = [r for r in rows if r["subject"] == subject]
        # No dev split in test.jsonl: first `shots` questions are the examples.
        examples, scored = mine[:shots], mine[shots : shots + limit]
        for row in scored:
            for n in range(shots, -1, -1):
                prompt = plain_prompt(row, examples[:n])
                ctx = tokenizer(prompt)["input_ids"]
                conts = [tokenizer(prompt + " " + L)["input_ids"][len(ctx) :] for L in "ABCD"]
                if len(ctx) + max(map(len, conts)) - 1 <= max_length:
                    break
            else:
                out.append((row, None, None, None))
                continue
            lls = []
            for cont in conts:
                full = ctx + cont
                with torch.no_grad():
                    logits = model(torch.tensor([full[:-1]])).logits[0].double()
                logprobs = torch.log_softmax(logits, dim=-1)
                lls.append(sum(logprobs[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont)))
            out.append((row, prompt, n, lls))
    return out


def check_against_reference(char_level: bool, subjects, shots, limit, batch_size):
    model, tokenizer = load_tiny(char_level)
    data = load_mmlu(MMLU_JSONL, subjects=subjects, shots=shots, limit_per_subject=limit)
    result = evaluate(model, tokenizer, data, batch_size=batch_size, max_length=MAX_POSITIONS, device="cpu")
    reference = plain_reference(model, tokenizer, subjects, shots, limit, MAX_POSITIONS)

    assert len(data.questions) == len(reference)
    scored = {r.index: r for r in result.questions}
    skipped = {s.index for s in result.skipped}
    for index, (row, prompt, n_shots, lls) in enumerate(reference):
        question = data.questions[index]
        assert question.question == row["question"]
        if prompt is None:
            assert index in skipped
            continue
        got = scored[index]
        assert got.num_shots == n_shots
        assert build_prompt(question, data.fewshot[question.subject][:n_shots]) == prompt
        torch.testing.assert_close(torch.tensor(got.loglikelihoods), torch.tensor(lls), rtol=0, atol=1e-4)
        assert got.prediction == max(range(4), key=lambda j: lls[j])
    n_ok = [lls for _, p, _, lls in reference if p is not None]
    correct = sum(max(range(4), key=lambda j: lls[j]) == r["answer"] for r, p, _, lls in reference if p is not None)
    assert result.micro.total == len(n_ok)
    assert result.micro.correct == correct
    return result, reference


def test_matches_plain_reference_bpe_tokenizer():
    result, reference = check_against_reference(False, SUBJECTS, SHOTS, LIMIT, batch_size=4)
    # The set is meant to exercise shot dropping and skipping; make sure it does.
    assert result.skipped, "expected long history passages to be skipped at 512 tokens"
    assert result.fewer_shots > 0
    assert any(n == SHOTS for _, p, n, _ in reference if p is not None)
    # The reference margins are far above float noise, so argmax is well defined.
    margins = [sorted(lls)[-1] - sorted(lls)[-2] for _, p, _, lls in reference if p is not None]
    assert min(margins) > 1e-3


def test_matches_plain_reference_multi_token_continuations():
    # Character-level vocabulary: " A" is "▁", "A", so each choice gets its own row.
    model, tokenizer = load_tiny(char_level=True)
    prompt_ids = tokenizer("Answer:")["input_ids"]
    assert tokenizer("Answer: A")["input_ids"][len(prompt_ids) :] == tokenizer.convert_tokens_to_ids(["▁", "A"])
    check_against_reference(True, ["abstract_algebra", "marketing"], shots=1, limit=3, batch_size=3)


def test_batch_size_does_not_change_scores():
    model, tokenizer = load_tiny()
    data = load_mmlu(MMLU_JSONL, subjects=["anatomy", "marketing"], shots=2, limit_per_subject=4)
    prepared = prepare_mmlu(data, tokenizer, max_length=MAX_POSITIONS)
    one = evaluate(model, tokenizer, prepared, batch_size=1, max_length=MAX_POSITIONS, device="cpu")
    many = evaluate(model, tokenizer, prepared, batch_size=7, max_length=MAX_POSITIONS, device="cpu")
    for a, b in zip(one.questions, many.questions):
        assert a.prediction == b.prediction
        torch.testing.assert_close(torch.tensor(a.loglikelihoods), torch.tensor(b.loglikelihoods), rtol=0, atol=1e-5)


def test_report_aggregates():
    model, tokenizer = load_tiny()
    data = load_mmlu(MMLU_JSONL, subjects=["anatomy", "marketing", "sociology"], shots=1, limit_per_subject=4)
    result = evaluate(model, tokenizer, data, batch_size=8, max_length=MAX_POSITIONS, device="cpu")
    assert set(result.subjects) == {"anatomy", "marketing", "sociology"}
    assert set(result.categories) == {"stem", "other", "social_sciences"}
    assert result.micro.total == 12 == sum(a.total for a in result.categories.values())
    expected_macro = sum(a.correct / a.total for a in result.subjects.values()) / 3
    assert abs(result.macro - expected_macro) < 1e-12
    report = result.to_dict()
    assert report["held_out_for_fewshot"]["total"] == 3
    assert report["fewshot_policy"] == "holdout"
    assert len(report["questions"]) == 12
    assert set(result.to_log_dict()) == {
        "mmlu/acc", "mmlu/acc_macro", "mmlu/stem", "mmlu/other", "mmlu/social_sciences",
    }
