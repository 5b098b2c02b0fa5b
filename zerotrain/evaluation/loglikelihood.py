"""Log-likelihood requests (lm-evaluation-harness' ``loglikelihood``): encoding them, and scoring them batched and
data-parallel.

A request is one context and several alternative continuations (token ids);
the result is, per request and continuation, the summed log-probability of the
continuation tokens given the context.

Encoding (``encode_pair``, ``encode_choices``) splits a (context, continuation)
text pair into token ids the way lm-evaluation-harness does: it encodes
``context`` and ``context + continuation`` and takes the extra tokens of the
latter as the continuation. Encoding the continuation alone would be wrong for
sentencepiece tokenizers, which treat a leading space specially ("Answer: A"
ends in "▁A", while " A" on its own encodes as "▁", "▁A" or similar). The
tokenizer's ``bos_id``, when not None, is put in front of every context.

Rows: when every continuation of a request is one token (MMLU's " A".." D" with
Llama/Falcon tokenizers) the request needs one row - the context - and the
four scores are read off the last position's log-softmax. Otherwise each
continuation gets its own row ``(context + continuation)[:-1]``. Both give the
same numbers; the first is 4x cheaper.

Distribution: rows are sorted longest first (large batches fail early, padding
is small) and cut into global batches of ``batch_size`` rows, identical on every
rank. Rank r runs global batches r, r+W, r+2W, ... and every rank runs the same
number of forward passes, ``ceil(batches / W)``: ranks short of a batch run a
1-token dummy batch whose output is discarded. That matters under ZeRO-3, where
each forward all-gathers parameters collectively and a rank that stops early
deadlocks the others. Because a batch is computed the same way whichever rank
runs it, results do not depend on the number of ranks. Scores are then summed
across ranks (each entry is written by exactly one rank), so every rank returns
the full table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

from zerotrain.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class Request:
    """A context and its alternative continuations, as token ids."""

    context: Sequence[int]
    continuations: Sequence[Sequence[int]]


def encode_context(tokenizer: Tokenizer, context: str) -> list[int]:
    """Context ids as ``encode_pair`` computes them (BOS, trailing spaces removed)."""
    prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    context = context.rstrip()
    if not context and not prefix:
        raise ValueError("empty context and no BOS token: nothing to condition on")
    return prefix + tokenizer.encode(context) if context else prefix


def encode_choices(
    tokenizer: Tokenizer, context: str, continuations: Sequence[str]
) -> tuple[list[int], list[list[int]]]:
    """(context ids, [continuation ids]) as lm-evaluation-harness computes each pair."""
    # Trailing spaces of the context belong to the continuation (lm-eval does the same:
    # "Answer: " + "A" is scored as "Answer:" + " A").
    stripped = context.rstrip()
    moved = context[len(stripped):]
    context_ids = encode_context(tokenizer, stripped)
    prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    out = []
    for continuation in continuations:
        whole = prefix + tokenizer.encode(stripped + moved + continuation)
        ids = whole[len(context_ids):]
        if not ids:
            raise ValueError(f"continuation {continuation!r} encodes to no tokens")
        out.append(ids)
    return context_ids, out


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of one pair, as lm-evaluation-harness computes them."""
    context_ids, (continuation_ids,) = encode_choices(tokenizer, context, [continuation])
    return context_ids, continuation_ids


@dataclass(frozen=True)
class _Target:
    """Which (request, continuation) a row scores, at which positions."""

    request: int
    choice: int
    start: int  # position whose logits predict the first continuation token
    tokens: Sequence[int]


@dataclass(frozen=True)
class _Row:
    tokens: Sequence[int]
    targets: tuple[_Target, ...]


def build_rows(requests: Sequence[Request]) -> list[_Row]:
    """One row per request when all continuations are single tokens, else one per choice."""
    rows = []
    for i, req in enumerate(requests):
        ctx = list(req.context)
        if all(len(c) == 1 for c in req.continuations):
            targets = tuple(_Target(i, j, len(ctx) - 1, c) for j, c in enumerate(req.continuations))
            rows.append(_Row(ctx, targets))
            continue
        for j, cont in enumerate(req.continuations):
            tokens = (ctx + list(cont))[:-1]
            rows.append(_Row(tokens, (_Target(i, j, len(ctx) - 1, cont),)))
    return rows


def make_batches(rows: list[_Row], batch_size: int) -> list[list[_Row]]:
    """Longest rows first, stable (ties keep request order) so all ranks agree."""
    order = sorted(range(len(rows)), key=lambda k: -len(rows[k].tokens))
    ordered = [rows[k] for k in order]
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def _collate(batch: list[_Row], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and attention mask."""
    width = max(len(r.tokens) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, row in enumerate(batch):
        ids[i, : len(row.tokens)] = torch.as_tensor(list(row.tokens), dtype=torch.long)
        mask[i, : len(row.tokens)] = 1
    return ids.to(device), mask.to(device)


def _forward_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
    # Hugging Face models would otherwise build a KV cache nobody reads.
    config = getattr(getattr(model, "module", model), "config", None)
    if config is not None and hasattr(config, "use_cache"):
        kwargs["use_cache"] = False
    out = model(**kwargs)
    return out.logits if hasattr(out, "logits") else out[0]


def _score_batch(logits: torch.Tensor, batch: list[_Row], scores: torch.Tensor, filled: torch.Tensor) -> None:
    """Sum continuation log-probs of every target in ``batch`` into ``scores``."""
    rows, positions, tokens, owners = [], [], [], []
    for b, row in enumerate(batch):
        for target in row.targets:
            for k, token in enumerate(target.tokens):
                rows.append(b)
                positions.append(target.start + k)
                tokens.append(token)
                owners.append((target, k))
    on = logits.device
    picked = logits[torch.tensor(rows, device=on), torch.tensor(positions, device=on)]
    # log_softmax in float32 even for bf16 models: bf16 keeps ~3 significant digits.
    logprobs = F.log_softmax(picked.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=on)[:, None])[:, 0].double().cpu()
    for (target, k), value in zip(owners, chosen.tolist()):
        scores[target.request, target.choice] += value
        if k == 0:
            filled[target.request, target.choice] += 1


def _collective_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    # NCCL reduces CUDA tensors only; gloo reduces CPU tensors.
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _check_same_requests(requests: Sequence[Request], group: dist.ProcessGroup | None, device: torch.device) -> None:
    """All ranks must score the same requests, or the batch plan (and result) differs."""
    total = sum(len(r.context) + sum(len(c) for c in r.continuations) for r in requests)
    stats = torch.tensor([len(requests), total], dtype=torch.float64, device=device)
    high, low = stats.clone(), -stats.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(high, -low):
        raise RuntimeError(
            "ranks were given different evaluation requests (counts/token totals differ: "
            f"max {high.tolist()}, min {(-low).tolist()}); every rank must load the same "
            "questions with the same tokenizer"
        )


def score_requests(
    model: torch.nn.Module,
    requests: Sequence[Request],
    *,
    batch_size: int,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
    pad_id: int = 0,
    progress: bool = False,
) -> torch.Tensor:
    """Summed log-likelihood of each continuation: float64 [len(requests), max choices].

    Call on every rank of ``group`` (if torch.distributed is initialised) with the
    same requests; every rank gets the full table. Missing choices are -inf. The
    caller is responsible for eval mode and no_grad (see ``isolated_evaluation``).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = torch.device(device)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1
    if distributed:
        _check_same_requests(requests, group, _collective_device(group, device))

    width = max((len(r.continuations) for r in requests), default=0)
    scores = torch.zeros((len(requests), width), dtype=torch.float64)
    filled = torch.zeros((len(requests), width), dtype=torch.float64)
    batches = make_batches(build_rows(requests), batch_size)
    mine = batches[rank::world]
    steps = math.ceil(len(batches) / world)
    dummy_ids = torch.full((1, 1), pad_id, dtype=torch.long, device=device)
    dummy_mask = torch.ones_like(dummy_ids)

    for step in tqdm(range(steps), desc="MMLU", disable=not progress or rank != 0):
        if step < len(mine):
            ids, mask = _collate(mine[step], pad_id, device)
            _score_batch(_forward_logits(model, ids, mask), mine[step], scores, filled)
        else:
            # Keep ZeRO-3's collective parameter gathers in step with the other ranks.
            _forward_logits(model, dummy_ids, dummy_mask)

    if distributed and world > 1:
        on = _collective_device(group, device)
        both = torch.stack([scores, filled]).to(on)
        dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        scores, filled = both.cpu()
    expected = torch.tensor(
        [[1.0 if j < len(r.continuations) else 0.0 for j in range(width)] for r in requests],
        dtype=torch.float64,
    ).reshape(len(requests), width)
    if not torch.equal(filled, expected):
        raise RuntimeError("internal error: some continuations were scored zero or twice")
    return scores.masked_fill(expected == 0, float("-inf"))
