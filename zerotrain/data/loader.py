"""Training and validation batches from prepared data sets: deterministic, data-parallel, resumable, blended.

The trainer calls::

    train = build_loader([(path, weight), ...], "train", seq_len, micro_batch_size, dp_rank, dp_size, seed,
                         kind="pretrain" | "sft", packing=True, vocab_size=model_vocab)
    batch = next(train)      # {"input_ids": [B, T] int64, "labels": [B, T] int64,
                             #  + "position_ids" [B, T] (packed) or "attention_mask" [B, T] (padded, packing=False)}
    state = train.state_dict()           # small JSON-serialisable dict: store it in the checkpoint
    train.load_state_dict(state)         # continue with exactly the batches that would have come next
    valid = build_valid_loader(path, seq_len, micro_batch_size, dp_rank, dp_size, num_batches=8)
    for batch in valid: ...              # the same fixed batches on every pass

Samples (each ``seq_len`` tokens):

* pretrain, packing=True: consecutive windows of the split's token stream (documents, each ending in EOS, back to
  back; a document may continue in the next window). ``labels`` = ``input_ids``: Hugging Face causal-LM models
  shift labels internally.
* sft, packing=True: whole examples packed greedily, in stored order, into sequences of at most ``seq_len`` tokens
  (an example longer than that is truncated and sits alone); the tail is padded. ``labels`` are -100 on prompt
  tokens and padding.
* Both packed kinds carry ``position_ids`` restarting at 0 at every document (:func:`document_position_ids`) and no
  ``attention_mask``: transformers then confines attention to each document (a token never sees the document
  packed before it) and counts RoPE positions from the document's start. The padded tail of an SFT pack is a
  "document" of its own.
* packing=False (either kind): one document/example per sequence, truncated to ``seq_len`` and padded.

Order: the global sample order depends only on ``seed`` and the data, never on ``dp_size``. Global micro-step ``m``
consists of global samples ``[m*B*dp, (m+1)*B*dp)`` and rank ``r`` takes the ``r``-th slice of ``B``, so 1 rank with
micro-batch ``4B`` sees, at each step, exactly the union of what 4 ranks with ``B`` see. Each source is an endless
sequence of its samples, reshuffled every epoch by a permutation seeded with (seed, source index, epoch). Blending
is Megatron's: global sample ``n`` comes from the source whose count so far lags its share ``weight * (n + 1)``
most, so any prefix of the stream follows the weights to within one sample per source.

Reads are memory-mapped (``np.memmap``); what is held in memory is per-source indices: one epoch's permutation
(8 bytes a sample) and, for document-based samples, the document offsets (8 bytes a document).

The ``data`` section of the run config (:class:`DataConfig`) is declared here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from zerotrain.data.shards import MANIFEST, PreparedDataset, SplitReader
from zerotrain.errors import DataError
from zerotrain.fields import bounded

IGNORE_INDEX = -100  # labels the loss skips (Hugging Face / PyTorch cross-entropy convention)
STATE_VERSION = 1


class DataKind(StrEnum):
    pretrain = "pretrain"  # documents back to back, the loss on every token
    sft = "sft"  # prompt/response examples, the loss on responses only


@dataclass
class DataSourceConfig:
    """One training source of a blend."""

    path: str = "???"
    """A directory written by data/prepare.py."""
    weight: float = bounded(1.0, gt=0)
    """Share of the blend, relative to the other sources' weights."""


@dataclass
class DataConfig:
    """The ``data`` section (``configs/data/*.yaml``): what the run trains and validates on."""

    kind: DataKind = DataKind.pretrain
    """pretrain | sft; must match how the directories were prepared."""
    train: list[DataSourceConfig] = bounded(
        factory=list, min_length=1, hint="name at least one prepared data directory (see data/prepare.py)")
    """The training sources, blended by weight."""
    valid: Optional[str] = None
    """A prepared validation directory; None uses the 'valid' split of the first train source if it has one."""
    packing: bool = True
    """sft: pack several examples into one sequence, or pad each to train.seq_len."""


# --------------------------------------------------------------------------------------------------------------
# Samples: one prepared split seen as a list of fixed-length samples
# --------------------------------------------------------------------------------------------------------------


class SampleSource(ABC):
    num_samples: int

    @abstractmethod
    def sample(self, index: int) -> dict[str, np.ndarray]:
        """Sample ``index`` as int64 arrays of length seq_len: input_ids, labels (and attention_mask if padded)."""


def document_position_ids(starts: np.ndarray, length: int) -> np.ndarray:
    """Position ids restarting at 0 at every document start (``starts``: sorted offsets in ``[0, length)``).

    transformers reads packed documents off these when no 2D ``attention_mask`` is passed: a new document begins
    wherever consecutive positions do not increase by one, and attention (sdpa, eager; flash-attention's varlen
    path at micro-batch 1) is then confined to each document, with RoPE positions counted from its own start.
    """
    positions = np.arange(length, dtype=np.int64)
    is_start = np.zeros(length, bool)
    is_start[0] = True
    is_start[np.asarray(starts, np.int64)] = True
    last_start = np.maximum.accumulate(np.where(is_start, positions, 0))
    return positions - last_start


class TokenWindows(SampleSource):
    """Pretraining with packing: non-overlapping ``seq_len`` windows of the token stream (the tail is dropped).

    A window's first (partial) document counts its positions from the window start, as Megatron's
    ``reset_position_ids`` does."""

    def __init__(self, split: SplitReader, seq_len: int):
        self.split, self.seq_len = split, seq_len
        self.num_samples = split.num_tokens // seq_len
        self.offsets = split.document_offsets()

    def sample(self, index: int) -> dict[str, np.ndarray]:
        start = index * self.seq_len
        ids = self.split.tokens(start, self.seq_len).astype(np.int64)
        first, last = np.searchsorted(self.offsets, [start, start + self.seq_len])
        starts = self.offsets[first:last] - start
        return {"input_ids": ids, "labels": ids.copy(), "position_ids": document_position_ids(starts, self.seq_len)}


class _DocumentSamples(SampleSource):
    """Samples that are one or more whole documents, padded to ``seq_len``."""

    def __init__(self, split: SplitReader, seq_len: int, pad_id: int, use_mask: bool):
        self.split, self.seq_len, self.pad_id, self.use_mask = split, seq_len, pad_id, use_mask
        self.offsets = split.document_offsets()

    def _padded(self, start: int, length: int) -> dict[str, np.ndarray]:
        length = min(length, self.seq_len)  # a document longer than a sequence is truncated
        ids = np.full(self.seq_len, self.pad_id, np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, np.int64)
        attention = np.zeros(self.seq_len, np.int64)
        ids[:length] = self.split.tokens(start, length)
        if self.use_mask:
            trained = self.split.mask(start, length).astype(bool)
            labels[:length] = np.where(trained, ids[:length], IGNORE_INDEX)
        else:
            labels[:length] = ids[:length]
        attention[:length] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": attention}


class PaddedDocuments(_DocumentSamples):
    """One document (pretraining) or example (SFT) per sequence."""

    def __init__(self, split: SplitReader, seq_len: int, pad_id: int, use_mask: bool):
        super().__init__(split, seq_len, pad_id, use_mask)
        self.num_samples = split.num_documents

    def sample(self, index: int) -> dict[str, np.ndarray]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self._padded(start, end - start)


def greedy_packs(offsets: np.ndarray, seq_len: int) -> np.ndarray:
    """Boundaries (document indices) of packs of consecutive documents, each pack at most ``seq_len`` tokens."""
    bounds = [0]
    pack_start = int(offsets[0])
    for doc in range(1, len(offsets) - 1):
        if int(offsets[doc + 1]) - pack_start > seq_len:  # adding this document would overflow: start a new pack
            bounds.append(doc)
            pack_start = int(offsets[doc])
    bounds.append(len(offsets) - 1)
    return np.asarray(bounds, np.int64)


class PackedExamples(_DocumentSamples):
    """SFT with packing: several whole examples per sequence (packs fixed once; their order reshuffled per epoch)."""

    def __init__(self, split: SplitReader, seq_len: int, pad_id: int):
        super().__init__(split, seq_len, pad_id, use_mask=True)
        self.bounds = greedy_packs(self.offsets, seq_len) if split.num_documents else np.zeros(1, np.int64)
        self.num_samples = len(self.bounds) - 1

    def sample(self, index: int) -> dict[str, np.ndarray]:
        first, last = int(self.bounds[index]), int(self.bounds[index + 1])
        start, end = int(self.offsets[first]), int(self.offsets[last])
        sample = self._padded(start, end - start)
        # No attention_mask: with one, transformers would let the pack's examples attend to each other. The padded
        # tail becomes a "document" of its own (never trained: its labels are -100).
        del sample["attention_mask"]
        starts = [int(o) - start for o in self.offsets[first:last]] + [min(end - start, self.seq_len)]
        sample["position_ids"] = document_position_ids(np.asarray([s for s in starts if s < self.seq_len]),
                                                       self.seq_len)
        return sample


# --------------------------------------------------------------------------------------------------------------
# Opening and checking data sets
# --------------------------------------------------------------------------------------------------------------


def open_dataset(path: str | Path, kind: str, vocab_size: Optional[int] = None,
                 verify: str = "checksums") -> PreparedDataset:
    """Open a prepared directory and check it suits this run (kind, and a tokenizer that fits the model)."""
    dataset = PreparedDataset(path, verify=verify)
    if dataset.kind != kind:
        raise DataError(f"{dataset.root}: prepared with kind={dataset.kind}, but this run has data.kind={kind}; "
                        f"prepare it with kind={kind} or change data.kind")
    if vocab_size is not None and dataset.vocab_size > vocab_size:
        raise DataError(
            f"{dataset.root / MANIFEST}: its tokenizer has {dataset.vocab_size} tokens but model.vocab_size="
            f"{vocab_size}, so token ids would index past the embedding. Set model.vocab_size>={dataset.vocab_size} "
            f"or prepare the data with a tokenizer of at most {vocab_size} tokens"
        )
    return dataset


def _check_same_tokenizer(datasets: Sequence[PreparedDataset]) -> None:
    first = datasets[0]
    for other in datasets[1:]:
        if other.tokenizer_info["sha256"] != first.tokenizer_info["sha256"]:
            raise DataError(f"{other.root} and {first.root} were prepared with different tokenizers; blended data "
                            f"must share one (prepare with tokenizer={first.root})")


def has_split(path: str | Path, split: str) -> bool:
    """Whether a prepared data set has a non-empty ``split`` (e.g. 'valid'); reads only the manifest."""
    return PreparedDataset(path, verify="sizes").has_split(split)


def _pad_id(dataset: PreparedDataset) -> int:
    # Padding is never attended to nor trained on, so any id works; EOS when the tokenizer has no pad token.
    info = dataset.tokenizer_info
    return info["pad_id"] if info["pad_id"] is not None else info["eos_id"]


def _samples(dataset: PreparedDataset, split: str, seq_len: int, kind: str, packing: bool) -> SampleSource:
    reader = dataset.split(split)
    if kind == "pretrain" and packing:
        source: SampleSource = TokenWindows(reader, seq_len)
    elif kind == "sft" and packing:
        source = PackedExamples(reader, seq_len, _pad_id(dataset))
    else:
        source = PaddedDocuments(reader, seq_len, _pad_id(dataset), use_mask=(kind == "sft"))
    if source.num_samples == 0:
        raise DataError(f"{dataset.root}: split '{split}' has {reader.num_tokens} tokens, not enough for one "
                        f"sample of seq_len={seq_len}; prepare more data or lower train.seq_len")
    return source


def _collate(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(np.stack([s[key] for s in samples])) for key in samples[0]}


def _check_parallel(micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
    if micro_batch_size <= 0 or dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need micro_batch_size > 0 and 0 <= dp_rank < dp_size; got {micro_batch_size}, "
                         f"{dp_rank}, {dp_size}")


# --------------------------------------------------------------------------------------------------------------
# Order, blending, the training iterator
# --------------------------------------------------------------------------------------------------------------


class EpochOrder:
    """Sample ``k`` of an endless pass over ``num_samples`` samples, reshuffled each epoch."""

    def __init__(self, num_samples: int, seed: int, source_index: int):
        self.num_samples, self.seed, self.source_index = num_samples, seed, source_index
        self._epoch, self._permutation = -1, np.zeros(0, np.int64)

    def __call__(self, k: int) -> int:
        epoch, offset = divmod(k, self.num_samples)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, self.source_index, epoch])
            self._epoch, self._permutation = epoch, rng.permutation(self.num_samples)
        return int(self._permutation[offset])


def blend_choice(weights: np.ndarray, counts: Sequence[int], n: int) -> int:
    """Megatron-style blending: the source furthest below its share ``weight * (n + 1)`` supplies sample ``n``."""
    return int(np.argmax(weights * (n + 1) - np.asarray(counts, np.float64)))


class TrainLoader:
    """An endless iterator of this rank's micro-batches; see the module docstring for the order."""

    def __init__(
        self,
        sources: list[SampleSource],
        weights: Sequence[float],
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ):
        _check_parallel(micro_batch_size, dp_rank, dp_size)
        w = np.asarray(weights, np.float64)
        if len(w) != len(sources) or not len(sources) or (w < 0).any() or w.sum() <= 0:
            raise DataError(f"data source weights {w.tolist()} must be non-negative with a positive sum")
        self.sources = sources
        self.weights = w / w.sum()
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.orders = [EpochOrder(s.num_samples, seed, i) for i, s in enumerate(sources)]
        self.samples_seen = 0  # global samples consumed, all ranks together
        self.source_samples = [0] * len(sources)

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens in one of this rank's micro-batches (padding included)."""
        return self.micro_batch_size * self.seq_len

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def _take_global_batch(self) -> list[tuple[int, int]]:
        """(source, source sample number) for each of the next B * dp global samples; advances the position."""
        picks = []
        for _ in range(self.micro_batch_size * self.dp_size):
            source = blend_choice(self.weights, self.source_samples, self.samples_seen) if len(self.sources) > 1 else 0
            picks.append((source, self.source_samples[source]))
            self.source_samples[source] += 1
            self.samples_seen += 1
        return picks

    def __next__(self) -> dict[str, torch.Tensor]:
        picks = self._take_global_batch()
        mine = picks[self.dp_rank * self.micro_batch_size : (self.dp_rank + 1) * self.micro_batch_size]
        return _collate([self.sources[s].sample(self.orders[s](k)) for s, k in mine])

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "samples_seen": self.samples_seen,
            "source_samples": list(self.source_samples),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION or len(state.get("source_samples", [])) != len(self.sources):
            raise DataError(f"data loader state {state} does not match this run's {len(self.sources)} data sources")
        if state["seed"] != self.seed:
            raise DataError(f"data loader state has seed {state['seed']} but this run uses {self.seed}; resuming "
                            f"would change the data order")
        self.samples_seen = int(state["samples_seen"])
        self.source_samples = [int(c) for c in state["source_samples"]]


def build_loader(
    sources: Sequence[tuple[str, float]],
    split: str,
    seq_len: int,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 1234,
    kind: str = "pretrain",
    packing: bool = True,
    vocab_size: Optional[int] = None,
    verify: str = "checksums",
) -> TrainLoader:
    """The training iterator over ``split`` of the prepared directories ``sources`` ((path, weight) pairs).

    ``vocab_size`` (the model's) is checked against each tokenizer. ``verify="checksums"`` hashes every shard
    once at start; ``"sizes"`` only checks file sizes (for very large data sets).
    """
    datasets = [open_dataset(path, kind, vocab_size, verify) for path, _ in sources]
    _check_same_tokenizer(datasets)
    samples = [_samples(d, split, seq_len, kind, packing) for d in datasets]
    return TrainLoader(samples, [w for _, w in sources], seq_len, micro_batch_size, dp_rank, dp_size, seed)


# --------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------


class ValidationBatches:
    """The first ``num_batches`` global micro-batches of a split in stored order (no shuffle), this rank's slice.

    Iterating again gives the same batches. A split with fewer samples than needed is cycled.
    """

    def __init__(self, source: SampleSource, num_batches: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        _check_parallel(micro_batch_size, dp_rank, dp_size)
        self.source, self.num_batches = source, num_batches
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        global_batch = self.micro_batch_size * self.dp_size
        for step in range(self.num_batches):
            first = step * global_batch + self.dp_rank * self.micro_batch_size
            indices = range(first, first + self.micro_batch_size)
            yield _collate([self.source.sample(i % self.source.num_samples) for i in indices])


def build_valid_loader(
    path: str | Path,
    seq_len: int,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    num_batches: int = 8,
    kind: str = "pretrain",
    packing: bool = True,
    split: Optional[str] = None,
    vocab_size: Optional[int] = None,
    verify: str = "checksums",
) -> ValidationBatches:
    """Fixed validation batches from ``path``: its ``valid`` split, or ``train`` when it has no validation split
    (a directory prepared as a validation set with valid_fraction=0). Pass ``split`` to choose explicitly."""
    dataset = open_dataset(path, kind, vocab_size, verify)
    if split is None:
        split = "valid" if dataset.has_split("valid") else "train"
    if not dataset.has_split(split):
        raise DataError(f"{dataset.root}: split '{split}' is empty; prepare with valid_fraction > 0 or set data.valid "
                        f"to a prepared validation directory")
    return ValidationBatches(_samples(dataset, split, seq_len, kind, packing), num_batches, micro_batch_size,
                             dp_rank, dp_size)
