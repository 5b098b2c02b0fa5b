"""The data pipeline: raw text -> tokenised, packed, memory-mapped shards -> deterministic training batches.

Modules, one job each:

* :mod:`~zerotrain.data.tokenizer` — the tokenizer interface (also the evaluator's): load a Llama-2 ``tokenizer.model``
  / Falcon ``tokenizer.json``, train one, or wrap a ``transformers`` tokenizer.
* :mod:`~zerotrain.data.sources` — read .txt / .jsonl / .parquet files or a Hugging Face dataset as records.
* :mod:`~zerotrain.data.sft` — chat templates and loss masks for supervised fine-tuning.
* :mod:`~zerotrain.data.shards` — the on-disk format: shard writer, manifest, memory-mapped reader.
* :mod:`~zerotrain.data.prepare` — the preparation run behind ``data/prepare.py``.
* :mod:`~zerotrain.data.loader` — training/validation batches: data-parallel, resumable, blended.

Every user-fixable problem raises :class:`~zerotrain.errors.DataError` with a message naming the file and the
remedy. The run config's ``data`` section is :class:`~zerotrain.data.loader.DataConfig`.
"""

from zerotrain.errors import DataError

__all__ = ["DataError"]
