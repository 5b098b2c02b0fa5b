"""Supervised fine-tuning: templates, loss masks on exactly the prompt tokens, packed and padded batches."""

from __future__ import annotations

import json

import numpy as np
import pytest

from zerotrain.data.loader import IGNORE_INDEX, build_loader
from zerotrain.data.prepare import PrepareConfig, TokenizerArgs, prepare
from zerotrain.data.sft import format_example
from zerotrain.data.sources import Record
from zerotrain.data.tokenizer import load_tokenizer
from zerotrain.errors import DataError

QA = {"prompt": "What is the capital of France?", "response": "Paris, of course."}


def test_llama2_template_masks_exactly_the_prompt_tokens(llama2_like):
    tok = load_tokenizer(llama2_like)
    ids, mask = format_example(Record("qa", QA), tok, "llama2")
    prompt = [tok.bos_id] + tok.encode(f"[INST] {QA['prompt']} [/INST]")
    assert ids[: len(prompt)] == prompt  # the prompt encodes as it would at inference time
    assert mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    assert ids[-1] == tok.eos_id
    assert tok.decode(ids[1:-1]) == "[INST] What is the capital of France? [/INST] Paris, of course. "


def test_plain_template_with_falcon_tokenizer_masks_exactly_the_prompt_tokens(falcon_like):
    tok = load_tokenizer(falcon_like)
    ids, mask = format_example(Record("qa", QA), tok, "plain")
    prompt = tok.encode(f"User: {QA['prompt']}\n\nAssistant:")  # Falcon has no BOS
    assert ids[: len(prompt)] == prompt
    assert mask == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    assert tok.decode(ids[len(prompt) : -1]) == " Paris, of course." and ids[-1] == 11


@pytest.mark.parametrize("template", ["llama2", "plain"])
def test_multi_turn_chat_trains_only_on_assistant_turns(llama2_like, template):
    tok = load_tokenizer(llama2_like)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Count to 3"},
        {"role": "assistant", "content": "1 2 3"},
    ]
    ids, mask = format_example(Record("chat", {"messages": messages}), tok, template)
    ids, mask = np.array(ids), np.array(mask, bool)
    trained = tok.decode(ids[mask & (ids != tok.eos_id)].tolist())
    assert trained.split() == ["Hello!", "1", "2", "3"]
    assert list(ids[mask]).count(tok.eos_id) == 2 and list(ids).count(tok.eos_id) == 2
    untrained = tok.decode(ids[~mask & (ids != tok.bos_id)].tolist())
    for text in ("Be brief.", "Hi there", "Count to 3"):
        assert text in untrained
    if template == "llama2":
        assert list(ids).count(tok.bos_id) == 2 and "<<SYS>>\nBe brief.\n<</SYS>>\n\nHi there" in untrained


@pytest.mark.parametrize(
    "record, message",
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, "message 0 must be"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "alternating, starting with user"),
        ({"question": "x"}, "expected 'prompt'/'response' or 'messages' fields \\(found: question\\)"),
    ],
)
def test_bad_sft_records_name_the_line(llama2_like, record, message):
    with pytest.raises(DataError, match=f"chat.jsonl:4: .*{message}"):
        format_example(Record("chat.jsonl:4", record), load_tokenizer(llama2_like), "llama2")


@pytest.fixture(scope="module")
def sft_dataset(tmp_path_factory, llama2_like):
    root = tmp_path_factory.mktemp("sft")
    rows = [{"prompt": f"Question {i}: what is {i} plus {i}?", "response": f"It is {2 * i}." + " Indeed." * (i % 5)}
            for i in range(60)]
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare(PrepareConfig(output=str(root / "out"), input=str(root / "qa.jsonl"), kind="sft",
                          tokenizer=TokenizerArgs(str(llama2_like)), valid_fraction=0.0, progress=False))
    return root / "out"


def _check_labels(batch, tok):
    ids, labels = batch["input_ids"].numpy(), batch["labels"].numpy()
    trained = labels != IGNORE_INDEX
    assert (labels[trained] == ids[trained]).all()
    if "attention_mask" in batch:  # padded rows; packed rows mark documents with position_ids instead
        assert (batch["attention_mask"].numpy()[trained] == 1).all()
    for row_ids, row_trained in zip(ids, trained):
        # Every trained token is part of an answer or its EOS; no prompt text is ever trained on.
        assert "[INST]" not in tok.decode(row_ids[row_trained].tolist())
        assert "It is" in tok.decode(row_ids[row_trained].tolist())


def test_sft_padded_batches_hold_one_example_per_row(sft_dataset):
    tok = load_tokenizer(sft_dataset)
    loader = build_loader([(str(sft_dataset), 1.0)], "train", 64, 4, kind="sft", packing=False)
    batch = next(loader)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    _check_labels(batch, tok)
    ids, attention = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
    for row, mask in zip(ids, attention):
        length = mask.sum()
        assert (mask[:length] == 1).all() and (mask[length:] == 0).all()
        assert row[0] == tok.bos_id and row[length - 1] == tok.eos_id and list(row[:length]).count(tok.eos_id) == 1


def test_sft_packed_batches_hold_several_whole_examples(sft_dataset):
    tok = load_tokenizer(sft_dataset)
    loader = build_loader([(str(sft_dataset), 1.0)], "train", 128, 4, kind="sft", packing=True)
    batch = next(loader)
    _check_labels(batch, tok)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    for row, labels in zip(batch["input_ids"].numpy(), batch["labels"].numpy()):
        real = row[: np.flatnonzero(labels != IGNORE_INDEX)[-1] + 1]  # to the last example's (trained) EOS
        assert list(real).count(tok.eos_id) >= 2  # several examples in one sequence
        assert real[0] == tok.bos_id and real[-1] == tok.eos_id  # and only whole ones


def test_sft_data_in_a_pretraining_run_is_refused(sft_dataset):
    with pytest.raises(DataError, match="prepared with kind=sft, but this run has data.kind=pretrain"):
        build_loader([(str(sft_dataset), 1.0)], "train", 64, 2, kind="pretrain")
