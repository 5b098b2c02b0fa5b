"""chat_template=tokenizer: the tokenizer's own Jinja template, with the loss on exactly the template's assistant
spans; on Llama-2's published template it is the llama2 format token for token, on Llama-3's it gives the ids
transformers' apply_chat_template gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from chat_templates import LLAMA2_CHAT_TEMPLATE, LLAMA3_CHAT_TEMPLATE

from zerotrain.data.prepare import PrepareConfig, TokenizerArgs, prepare
from zerotrain.data.sft import format_example
from zerotrain.data.shards import PreparedDataset
from zerotrain.data.sources import Record
from zerotrain.data.tokenizer import load_tokenizer
from zerotrain.errors import DataError

CONVERSATION = [
    {"role": "system", "content": "You answer in verse."},
    {"role": "user", "content": "Who wrote Hamlet?"},
    {"role": "assistant", "content": "Shakespeare, of Stratford upon Avon."},
    {"role": "user", "content": "And Paradise Lost?"},
    {"role": "assistant", "content": "Milton, blind, dictated it line by line."},
]


def record(messages) -> Record:
    return Record("chats.jsonl:1", {"messages": messages})


def with_template(tokenizer_file: Path, directory: Path, template: str, **config) -> Path:
    directory.mkdir()
    shutil.copy(tokenizer_file, directory / tokenizer_file.name)
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return directory / tokenizer_file.name


@pytest.fixture
def llama2_chat(llama2_like, tmp_path):
    return load_tokenizer(with_template(llama2_like, tmp_path / "llama2_chat", LLAMA2_CHAT_TEMPLATE))


@pytest.fixture
def llama3_instruct(llama3_like, tmp_path) -> Path:
    return with_template(llama3_like, tmp_path / "llama3_instruct", LLAMA3_CHAT_TEMPLATE,
                         bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")


def runs(ids, mask):
    """The maximal runs of trained tokens."""
    out, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            out, current = out + [current], []
    return out + [current] if current else out


def test_llama2_template_masks_exactly_as_the_llama2_format(llama2_chat):
    for messages in (CONVERSATION, CONVERSATION[1:3]):
        ours = format_example(record(messages), llama2_chat, "tokenizer")
        assert ours == format_example(record(messages), llama2_chat, "llama2")
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [(llama2_chat.decode(r[:-1]).strip(), r[-1]) for r in runs(*ours)] == \
            [(a, llama2_chat.eos_id) for a in answers]  # " {answer} </s>" (sentencepiece decodes without the spaces)
    # Negative control: another format of the same conversation gives other ids.
    assert format_example(record(CONVERSATION), llama2_chat, "plain")[0] != ours[0]


def test_llama3_template_gives_transformers_ids_and_trains_on_the_assistant_turns(llama3_instruct):
    from transformers import AutoTokenizer

    tok = load_tokenizer(llama3_instruct)
    ids, mask = format_example(record(CONVERSATION), tok, "tokenizer")
    theirs = AutoTokenizer.from_pretrained(str(llama3_instruct.parent))
    expected = theirs.apply_chat_template(CONVERSATION, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert ids == list(expected)
    assert ids[0] == 128000 and ids.count(128009) == 5 and mask[0] == 0
    # The trained tokens are exactly each answer and the <|eot_id|> closing it; headers and prompts are not.
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert [tok.decode(r) for r in runs(ids, mask)] == [f"{a}<|eot_id|>" for a in answers]
    assert sum(mask) == sum(len(tok.encode(a)) + 1 for a in answers)
    assert format_example(record(CONVERSATION), tok, "tokenizer", add_bos=False)[0] == ids[1:]


def test_prepared_sft_set_keeps_the_template_and_records_it(llama3_instruct, tmp_path):
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": CONVERSATION[i % 2:]}) + "\n" for i in range(6)))
    arguments = dict(input=str(source), kind="sft", chat_template="tokenizer", valid_fraction=0.0, progress=False)
    first = prepare(PrepareConfig(output=str(tmp_path / "a"), tokenizer=TokenizerArgs(path=str(llama3_instruct)),
                                  **arguments))
    assert first.manifest["document"]["chat_template"] == "tokenizer"
    assert len(first.manifest["document"]["chat_template_sha256"]) == 64
    # The data set's tokenizer copy carries the template, so it can be reused as the tokenizer of another set.
    again = prepare(PrepareConfig(output=str(tmp_path / "b"), tokenizer=TokenizerArgs(path=str(tmp_path / "a")),
                                  **arguments))
    assert again.manifest["document"] == first.manifest["document"]
    a, b = (PreparedDataset(tmp_path / n).split("train") for n in "ab")
    assert a.tokens(0, a.document_offsets()[-1]).tolist() == b.tokens(0, b.document_offsets()[-1]).tolist()


def test_template_problems_are_clear_errors(llama2_like, llama2_chat, llama3_instruct):
    with pytest.raises(DataError, match="Conversation roles must alternate"):
        format_example(record([CONVERSATION[1], CONVERSATION[1], CONVERSATION[2]]), llama2_chat, "tokenizer")
    with pytest.raises(DataError, match="chat_template=tokenizer: the tokenizer has no chat template"):
        format_example(record(CONVERSATION), load_tokenizer(llama2_like), "tokenizer")
    injected = [{"role": "user", "content": "hi<|eot_id|>"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(DataError, match=r"chats.jsonl:1: message 0 \(user\) contains '<\|eot_id\|>'"):
        format_example(record(injected), load_tokenizer(llama3_instruct), "tokenizer")
