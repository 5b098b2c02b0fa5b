"""Supervised fine-tuning examples: chat templates and loss masks.

An SFT record (a JSONL line, parquet row or dataset row) is either

* ``{"prompt": "...", "response": "..."}`` (field names configurable), or
* ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``.

It becomes token ids plus a loss mask that is 1 exactly on the assistant's tokens (its reply text and the EOS that
ends it) and 0 on everything else (BOS, system, user and template tokens), so the model learns to answer, not to
ask. Templates (``chat_template``):

``llama2`` — Meta's Llama-2-chat format, the one to use when fine-tuning a Llama-2 checkpoint::

    <s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {assistant} </s><s>[INST] {user} [/INST] {assistant} </s>

  (``<s>``/``</s>`` are the BOS/EOS *ids*, never the text). Turns must alternate user/assistant after an optional
  system message. The space after each answer is Meta's own (it is in their reference code and in HF's template).

``plain`` — a simple template for any tokenizer, e.g. Falcon or one trained here::

    {system}\\n\\nUser: {user}\\n\\nAssistant: {assistant}</s>User: {user}\\n\\nAssistant: {assistant}</s>

``completion`` — no chat markup at all: ``[BOS] {prompt}{response} EOS``, texts concatenated as they are (messages
in order; user and system text untrained). For prompts that carry their own format, e.g. MMLU's
``...\nAnswer:`` with the response `` B`` (zerotrain/data/mmlu_sft.py).

``tokenizer`` — the tokenizer's own Jinja chat template (``chat_template`` in its ``tokenizer_config.json``, or
``chat_template.jinja``; what transformers' ``apply_chat_template`` renders, through the same renderer), e.g. a
Llama-3-Instruct or Llama-2-chat tokenizer's. The trained part of each assistant turn is what the template adds
for it after the generation prompt: ``render(messages[:i+1])`` minus ``render(messages[:i],
add_generation_prompt=True)`` (Llama-3: ``{answer}<|eot_id|>``; Llama-2's template: `` {answer} </s>``, the
``llama2`` format's mask exactly). Special-token strings the template writes (``<|start_header_id|>``, ``<s>``)
become their ids; in message text they are refused, since the rendered text could not tell them apart. The template
decides BOS; ``add_bos=false`` drops a leading one.

Text between special tokens is tokenised in one piece (as a chat template would be), and a token belongs to the
part of the text where it starts: the leading space of " {assistant}" is part of the answer, so the answer's first
token ("▁Hello" / "ĠHello") is trained on, and the prompt tokens are exactly what an inference-time prompt encodes to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Union, cast

from zerotrain.data.sources import Record
from zerotrain.data.tokenizer import Tokenizer
from zerotrain.errors import DataError

TEMPLATES = ("llama2", "plain", "tokenizer", "completion")
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Text:
    text: str
    trainable: bool


@dataclass(frozen=True)
class Special:
    token_id: int
    trainable: bool


Part = Union[Text, Special]


@dataclass(frozen=True)
class SftFields:
    prompt: str = "prompt"
    response: str = "response"
    messages: str = "messages"


def messages_of(record: Record, fields: SftFields = SftFields()) -> list[dict[str, str]]:
    """The record as a validated list of ``{role, content}`` messages."""
    value = record.value
    if not isinstance(value, dict):
        raise DataError(f"{record.where}: SFT data must be JSONL/parquet records, not plain text")
    if fields.messages in value:
        messages = value[fields.messages]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{record.where}: '{fields.messages}' must be a non-empty list of {{role, content}}")
        for i, message in enumerate(messages):
            ok = isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)
            if not ok:
                raise DataError(f"{record.where}: message {i} must be {{\"role\": one of {', '.join(ROLES)}, "
                                f"\"content\": string}}, got {message!r:.120}")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{record.where}: no assistant message, so nothing to train on")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if fields.prompt in value and fields.response in value:
        prompt, response = value[fields.prompt], value[fields.response]
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise DataError(f"{record.where}: '{fields.prompt}' and '{fields.response}' must be strings")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    keys = ", ".join(sorted(value)) or "none"
    raise DataError(f"{record.where}: expected '{fields.prompt}'/'{fields.response}' or '{fields.messages}' "
                    f"fields (found: {keys}); set prompt_field=, response_field= or messages_field=")


def render(messages: list[dict[str, str]], template: str, tokenizer: Tokenizer, add_bos: bool,
           where: str) -> list[Part]:
    if template == "llama2":
        return _render_llama2(messages, tokenizer, add_bos, where)
    if template == "plain":
        return _render_plain(messages, tokenizer, add_bos)
    if template == "tokenizer":
        return _render_tokenizer_template(messages, tokenizer, add_bos, where)
    if template == "completion":
        return _render_completion(messages, tokenizer, add_bos)
    raise DataError(f"chat_template={template}: unknown; valid: {', '.join(TEMPLATES)}")


def _bos(tokenizer: Tokenizer, add_bos: bool) -> list[Part]:
    return [Special(tokenizer.bos_id, False)] if add_bos and tokenizer.bos_id is not None else []


def _eos(tokenizer: Tokenizer) -> int:
    if tokenizer.eos_id is None:
        raise DataError("SFT needs a tokenizer with an end-of-sequence token to end each answer; this one has none")
    return tokenizer.eos_id


def _render_llama2(messages: list[dict[str, str]], tokenizer: Tokenizer, add_bos: bool, where: str) -> list[Part]:
    system: Optional[str] = None
    if messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    roles = [m["role"] for m in messages]
    if roles[::2] != ["user"] * len(roles[::2]) or roles[1::2] != ["assistant"] * len(roles[1::2]):
        raise DataError(f"{where}: llama2 chat template needs user/assistant turns alternating, starting with user "
                        f"(after an optional system message); got {', '.join(roles)}")
    parts: list[Part] = []
    for turn in range(0, len(messages) - 1, 2):
        user, answer = messages[turn]["content"].strip(), messages[turn + 1]["content"].strip()
        if turn == 0 and system is not None:
            user = f"<<SYS>>\n{system.strip()}\n<</SYS>>\n\n{user}"
        parts += _bos(tokenizer, add_bos)
        parts += [Text(f"[INST] {user} [/INST]", False), Text(f" {answer} ", True), Special(_eos(tokenizer), True)]
    return parts


def _render_plain(messages: list[dict[str, str]], tokenizer: Tokenizer, add_bos: bool) -> list[Part]:
    parts: list[Part] = _bos(tokenizer, add_bos)
    for message in messages:
        content = message["content"]
        if message["role"] == "system":
            parts.append(Text(f"{content}\n\n", False))
        elif message["role"] == "user":
            parts.append(Text(f"User: {content}\n\nAssistant:", False))
        else:
            parts += [Text(f" {content}", True), Special(_eos(tokenizer), True)]
    return parts


def _render_completion(messages: list[dict[str, str]], tokenizer: Tokenizer, add_bos: bool) -> list[Part]:
    parts: list[Part] = _bos(tokenizer, add_bos)
    for message in messages:
        if message["role"] == "assistant":
            parts += [Text(message["content"], True), Special(_eos(tokenizer), True)]
        else:
            parts.append(Text(message["content"], False))
    return parts


def _apply_jinja(template: str, messages: list[dict[str, str]], tokenizer: Tokenizer, generation_prompt: bool,
                 where: str) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template  # apply_chat_template's renderer

    names: dict[str, Any] = {key: tokenizer.token_text(token_id) for key, token_id in
             (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id), ("pad_token", tokenizer.pad_id))
             if token_id is not None}
    try:
        # (rendered conversations, generation indices), although transformers annotates a str
        rendered, _ = cast(tuple[list[str], Any], render_jinja_template(
            [messages], chat_template=template, add_generation_prompt=generation_prompt, **names))
    except Exception as e:  # noqa: BLE001 -- jinja2's errors and the template's own raise_exception()
        raise DataError(f"{where}: the tokenizer's chat template refused this conversation: "
                        f"{' '.join(str(e).split())}") from None
    return rendered[0]


def _render_tokenizer_template(messages: list[dict[str, str]], tokenizer: Tokenizer, add_bos: bool,
                               where: str) -> list[Part]:
    template = tokenizer.chat_template
    if template is None:
        raise DataError(f"chat_template=tokenizer: the tokenizer has no chat template (no \"chat_template\" in the "
                        f"tokenizer_config.json beside it, no chat_template.jinja). Use the tokenizer of a chat model "
                        f"(e.g. an -Instruct or -chat checkpoint directory), or chat_template=llama2 | plain")
    special = tokenizer.special_tokens()
    for i, message in enumerate(messages):
        found = [text for text in special if text in message["content"]]
        if found:
            raise DataError(f"{where}: message {i} ({message['role']}) contains {found[0]!r}, a special token of the "
                            f"tokenizer; in a rendered chat template it would become that control token. Remove it, "
                            f"or use chat_template=llama2 | plain, which keep such strings as text")
    full = _apply_jinja(template, messages, tokenizer, False, where)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _apply_jinja(template, messages[:i], tokenizer, True, where)
        upto = _apply_jinja(template, messages[: i + 1], tokenizer, False, where)
        if not (upto.startswith(prompt) and full.startswith(upto)):
            raise DataError(f"{where}: the tokenizer's chat template renders a conversation's beginning differently "
                            f"from the whole conversation (at message {i}), so the assistant's tokens cannot be told "
                            f"apart; use chat_template=llama2 | plain")
        spans.append((len(prompt), len(upto)))
    cuts = sorted({0, len(full), *(p for span in spans for p in span)})
    marker = re.compile("|".join(re.escape(t) for t in sorted(special, key=len, reverse=True))) if special else None
    parts: list[Part] = []
    for start, end in zip(cuts[:-1], cuts[1:]):
        trainable = any(a <= start < b for a, b in spans)
        segment, position = full[start:end], 0
        for match in marker.finditer(segment) if marker else ():
            if match.start() > position:
                parts.append(Text(segment[position:match.start()], trainable))
            parts.append(Special(special[match.group()], trainable))
            position = match.end()
        if position < len(segment):
            parts.append(Text(segment[position:], trainable))
    if not add_bos and parts and tokenizer.bos_id is not None and parts[0] == Special(tokenizer.bos_id, False):
        parts = parts[1:]
    return parts


def _encode_text_run(tokenizer: Tokenizer, run: list[Text]) -> tuple[list[int], list[int]]:
    """Tokenise adjacent text parts as one string; each token takes the trainability of the part it starts in."""
    text = "".join(p.text for p in run)
    ids, starts = tokenizer.encode_with_offsets(text)
    boundaries, position = [], 0
    for part in run:
        position += len(part.text)
        boundaries.append(position)
    mask, part_index = [], 0
    for start in starts:
        while part_index < len(run) - 1 and start >= boundaries[part_index]:
            part_index += 1
        mask.append(int(run[part_index].trainable))
    return ids, mask


def encode_parts(parts: list[Part], tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    mask: list[int] = []
    run: list[Text] = []
    for part in [*parts, None]:  # None flushes the last run of text
        if isinstance(part, Text):
            run.append(part)
            continue
        if run:
            run_ids, run_mask = _encode_text_run(tokenizer, run)
            ids += run_ids
            mask += run_mask
            run = []
        if isinstance(part, Special):
            ids.append(part.token_id)
            mask.append(int(part.trainable))
    return ids, mask


def format_example(
    record: Record,
    tokenizer: Tokenizer,
    template: str = "llama2",
    add_bos: bool = True,
    fields: SftFields = SftFields(),
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 = train on this token) of one SFT record."""
    messages = messages_of(record, fields)
    return encode_parts(render(messages, template, tokenizer, add_bos, record.where), tokenizer)

