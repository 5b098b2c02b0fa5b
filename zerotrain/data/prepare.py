"""Prepare a data set: read sources, tokenise, split train/valid, write shards + manifest (atomically).

``prepare(PrepareConfig(...))`` is what ``data/prepare.py`` runs. Steps:

1. Records come from local files (:mod:`zerotrain.data.sources`) or a Hugging Face dataset.
2. The tokenizer is loaded (``tokenizer=`` a tokenizer.model, tokenizer.json, model dir, prepared data dir or Hub
   id ``org/name[@revision]``), or trained on the train split's text when ``tokenizer.path`` is unset
   (``tokenizer.train_kind``: sentencepiece with Llama-2's settings, or Llama-3's byte-level BPE;
   ``tokenizer.train_vocab_size``).
3. Each record goes to ``valid`` when a keyed hash of its content falls below ``valid_fraction`` (deterministic,
   independent of order, and duplicates always land on the same side), else to ``train``.
4. Pretraining documents are framed as ``[BOS] text EOS`` (BOS only when ``add_bos`` and the tokenizer has a BOS
   distinct from EOS, as Llama-2 does; Falcon has none); SFT records via :mod:`zerotrain.data.sft`.
5. Everything is written to ``.<output>.tmp-<pid>`` and renamed to ``output`` at the very end, so an interrupted run
   never leaves a directory with a manifest: readers only ever see complete data sets.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import glob
import hashlib
import itertools
import os
import shutil
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, cast

from tqdm import tqdm

from zerotrain.data import sft
from zerotrain.data.shards import FORMAT_NAME, FORMAT_VERSION, SplitWriter, token_dtype, write_manifest
from zerotrain.data.sources import (
    TXT_SPLITS,
    Record,
    describe_files,
    describe_hf,
    expand_inputs,
    iter_file_records,
    iter_hf_records,
    text_of,
)
from zerotrain.data.tokenizer import (
    DATASET_TOKENIZER_DIR,
    Tokenizer,
    load_tokenizer,
    train_llama3_bpe,
    train_sentencepiece,
)
from zerotrain.errors import DataError

KINDS = ("pretrain", "sft")
TRAIN_KINDS = ("sentencepiece", "llama3")


@dataclass
class TokenizerArgs:
    # A tokenizer.model (Llama-2) / tokenizer.json (Falcon, Llama-3) / HF model dir / prepared data dir / Hub id
    # org/name[@revision]; None trains one.
    path: Optional[str] = None
    train_kind: str = "sentencepiece"  # a trained tokenizer: sentencepiece (Llama-2's kind) | llama3 (byte-level BPE)
    train_vocab_size: int = 32000  # size of a trained tokenizer (llama3: with its 256 special tokens)
    train_sentences: int = 5_000_000  # lines of text to train it on (the first ones)


@dataclass
class PrepareConfig:
    output: str = "???"  # the prepared data directory to create
    # Input: local files (comma-separated files, directories, globs: .txt, .jsonl, .parquet) or a HF dataset.
    input: Optional[str] = None
    hf_dataset: Optional[str] = None  # a hub name, or a local dataset directory
    hf_config: Optional[str] = None
    hf_split: str = "train"
    hf_streaming: bool = False
    hf_cache_dir: Optional[str] = None
    kind: str = "pretrain"  # pretrain | sft
    text_field: str = "text"  # pretraining JSONL/parquet/dataset field
    prompt_field: str = "prompt"  # SFT fields
    response_field: str = "response"
    messages_field: str = "messages"
    chat_template: str = "llama2"  # llama2 | plain | tokenizer (its own Jinja template) | completion
    txt_split: str = "paragraphs"  # paragraphs | file (see zerotrain/data/sources.py)
    txt_doc_chars: int = 4000  # paragraphs mode: join paragraphs into documents of at least this many characters
    max_documents: int = 0  # > 0: use only the first N records (a quick slice)
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)
    add_bos: bool = True
    valid_fraction: float = 0.01
    seed: int = 1234  # for the train/valid split and tokenizer training
    shard_tokens: int = 100_000_000  # start a new shard after this many tokens (200 MB of uint16)
    num_threads: int = 0  # tokenisation threads; 0 = all cores. Output never depends on it
    batch_documents: int = 256  # documents tokenised per call
    overwrite: bool = False
    progress: bool = True


def validate(cfg: PrepareConfig) -> None:
    if (cfg.input is None) == (cfg.hf_dataset is None):
        raise DataError("give exactly one of input=<files> or hf_dataset=<name or local dataset directory>")
    choices = {"kind": (cfg.kind, KINDS), "txt_split": (cfg.txt_split, TXT_SPLITS),
               "chat_template": (cfg.chat_template, sft.TEMPLATES),
               "tokenizer.train_kind": (cfg.tokenizer.train_kind, TRAIN_KINDS)}
    for key, (value, options) in choices.items():
        if value not in options:
            close = difflib.get_close_matches(value, options, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise DataError(f"{key}={value} is not valid.{hint} Choose one of {', '.join(options)}")
    if not 0.0 <= cfg.valid_fraction < 1.0:
        raise DataError(f"valid_fraction={cfg.valid_fraction} must be in [0, 1)")
    if cfg.shard_tokens <= 0 or cfg.batch_documents <= 0:
        raise DataError("shard_tokens and batch_documents must be positive")
    if cfg.tokenizer.path is None and cfg.tokenizer.train_kind == "sentencepiece" and \
            cfg.tokenizer.train_vocab_size < 260:
        raise DataError(f"tokenizer.train_vocab_size={cfg.tokenizer.train_vocab_size} is too small: a byte-fallback "
                        f"tokenizer needs 259 + the number of distinct characters")


# --------------------------------------------------------------------------------------------------------------
# Records and the train/valid split
# --------------------------------------------------------------------------------------------------------------


def record_stream(cfg: PrepareConfig) -> tuple[Callable[[], Iterator[Record]], dict]:
    """A function that (re)opens the record stream, and the manifest's description of the source."""
    if cfg.hf_dataset is not None:
        dataset = cfg.hf_dataset
        source = describe_hf(dataset, cfg.hf_config, cfg.hf_split, cfg.hf_streaming)

        def records() -> Iterator[Record]:
            return iter_hf_records(dataset, cfg.hf_config, cfg.hf_split, cfg.hf_streaming, cfg.hf_cache_dir)
    else:
        assert cfg.input is not None  # exactly one of input / hf_dataset (checked above)
        files = expand_inputs(cfg.input)
        source = describe_files(files)

        def records() -> Iterator[Record]:
            return iter_file_records(files, cfg.txt_split, cfg.txt_doc_chars)

    if cfg.max_documents > 0:
        source["max_documents"] = cfg.max_documents
        opened = records

        def records() -> Iterator[Record]:  # noqa: F811 - the slice wraps whichever reader was chosen
            for i, record in enumerate(opened()):
                if i >= cfg.max_documents:
                    return
                yield record

    return records, source


def split_key(record: Record, cfg: PrepareConfig) -> str:
    """What decides a record's split: its text (pretraining) or its messages (SFT)."""
    if cfg.kind == "pretrain":
        return text_of(record, cfg.text_field)
    return repr(sft.messages_of(record, _fields(cfg)))


def is_valid(key: str, seed: int, fraction: float) -> bool:
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8, key=str(seed).encode())
    return int.from_bytes(digest.digest(), "little") / 2**64 < fraction


def _fields(cfg: PrepareConfig) -> sft.SftFields:
    return sft.SftFields(cfg.prompt_field, cfg.response_field, cfg.messages_field)


# --------------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------------


def _training_text(records: Iterator[Record], cfg: PrepareConfig) -> Iterator[str]:
    """Train-split text only: the tokenizer never sees the validation documents."""
    for record in records:
        if is_valid(split_key(record, cfg), cfg.seed, cfg.valid_fraction):
            continue
        if cfg.kind == "pretrain":
            yield text_of(record, cfg.text_field)
        else:
            yield "\n".join(m["content"] for m in sft.messages_of(record, _fields(cfg)))


def get_tokenizer(cfg: PrepareConfig, records: Callable[[], Iterator[Record]], out_dir: Path) -> tuple[Tokenizer, str]:
    """The tokenizer to use (a trained one is written to ``out_dir``) and the manifest's note of its origin."""
    if cfg.tokenizer.path is not None:
        return load_tokenizer(cfg.tokenizer.path), cfg.tokenizer.path
    # sentencepiece given no text fails with an internal assertion ('!sentences_.empty()'): say what is missing.
    texts = _training_text(records(), cfg)
    first = next((text for text in texts if text.strip()), None)
    if first is None:
        raise DataError(
            f"no text to train the tokenizer on in {cfg.input or cfg.hf_dataset}: it has no document, or every "
            f"document is blank{' or in the valid split' if cfg.valid_fraction else ''}. Give input with text (for "
            f"JSONL: a '{cfg.text_field}' field, text_field=<name> for another), or tokenizer.path=<a tokenizer>")
    texts = itertools.chain([first], texts)
    tokenizer: Tokenizer
    if cfg.tokenizer.train_kind == "llama3":
        tokenizer = train_llama3_bpe(texts, out_dir, cfg.tokenizer.train_vocab_size)
        return tokenizer, f"trained: Llama-3 byte-level BPE, vocab_size={cfg.tokenizer.train_vocab_size}"
    tokenizer = train_sentencepiece(
        texts,
        out_dir / "tokenizer.model",
        vocab_size=cfg.tokenizer.train_vocab_size,
        seed=cfg.seed,
        max_sentences=cfg.tokenizer.train_sentences,
    )
    return tokenizer, f"trained: sentencepiece BPE, Llama-2 settings, vocab_size={cfg.tokenizer.train_vocab_size}"


# --------------------------------------------------------------------------------------------------------------
# Tokenise and write
# --------------------------------------------------------------------------------------------------------------


def _batches(records: Iterator[Record], size: int) -> Iterator[list[Record]]:
    batch: list[Record] = []
    for record in records:
        batch.append(record)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _pretrain_documents(batch: list[Record], tokenizer: Tokenizer, cfg: PrepareConfig, threads: int):
    texts = [text_of(r, cfg.text_field) for r in batch]
    bos = [tokenizer.bos_id] if cfg.add_bos and tokenizer.bos_id not in (None, tokenizer.eos_id) else []
    for text, ids in zip(texts, tokenizer.encode_batch(texts, threads)):
        if text.strip():  # an empty document would be a lone EOS
            yield text, bos + ids + [tokenizer.eos_id], None


def _sft_documents(batch: list[Record], tokenizer: Tokenizer, cfg: PrepareConfig):
    for record in batch:
        ids, mask = sft.format_example(record, tokenizer, cfg.chat_template, cfg.add_bos, _fields(cfg))
        yield repr(sft.messages_of(record, _fields(cfg))), ids, mask


def write_splits(cfg: PrepareConfig, records: Iterator[Record], tokenizer: Tokenizer, out: Path) -> dict:
    dtype = token_dtype(tokenizer.vocab_size)
    with_mask = cfg.kind == "sft"
    writers = {split: SplitWriter(out, split, dtype, cfg.shard_tokens, with_mask) for split in ("train", "valid")}
    threads = cfg.num_threads or os.cpu_count() or 1
    bar = tqdm(desc=f"prepare {Path(cfg.output).name}", unit=" docs", disable=not cfg.progress, mininterval=1.0)
    tokens = 0
    for batch in _batches(records, cfg.batch_documents):
        if cfg.kind == "pretrain":
            documents = _pretrain_documents(batch, tokenizer, cfg, threads)
        else:
            documents = _sft_documents(batch, tokenizer, cfg)
        for key, ids, mask in documents:
            split = "valid" if is_valid(key, cfg.seed, cfg.valid_fraction) else "train"
            writers[split].add(ids, mask)
            tokens += len(ids)
        bar.update(len(batch))
        bar.set_postfix(tokens=f"{tokens:,}", refresh=False)
    bar.close()
    splits = {split: writer.finish() for split, writer in writers.items()}
    if splits["train"]["num_tokens"] == 0:
        raise DataError(f"no training documents in {cfg.input or cfg.hf_dataset} (all empty, or all in valid)")
    return splits


def build_manifest(cfg: PrepareConfig, tokenizer: Tokenizer, tokenizer_source: str, source: dict, splits: dict) -> dict:
    arguments = asdict(cfg)
    for key in ("output", "progress", "overwrite", "num_threads", "hf_cache_dir"):  # where/how, not what
        arguments.pop(key)
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "kind": cfg.kind,
        "dtype": token_dtype(tokenizer.vocab_size).str,
        "tokenizer": {**tokenizer.describe(), "dir": DATASET_TOKENIZER_DIR, "source": tokenizer_source},
        "document": {
            "bos": bool(cfg.add_bos and tokenizer.bos_id not in (None, tokenizer.eos_id)),
            "eos": True,
            "chat_template": cfg.chat_template if cfg.kind == "sft" else None,
            **({"chat_template_sha256": hashlib.sha256(cast(str, tokenizer.chat_template).encode()).hexdigest()}
               if cfg.kind == "sft" and cfg.chat_template == "tokenizer" else {}),
        },
        "splits": splits,
        "source": source,
        "arguments": arguments,
    }


def _publish(tmp: Path, out: Path) -> None:
    """Make the finished temp dir the output, replacing an old one only now that the new one is complete.

    Termination signals wait until both renames are done: between them there is no output directory at all."""
    blocked = {signal.SIGTERM, signal.SIGHUP, signal.SIGINT}
    if threading.current_thread() is threading.main_thread():
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            _swap_in(tmp, out)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    else:
        _swap_in(tmp, out)


def _swap_in(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old)


@dataclass
class Prepared:
    path: Path
    manifest: dict  # as written to <path>/manifest.json
    seconds_tokenizing: float  # reading + tokenising + writing, without tokenizer training

    @property
    def tokens_per_second(self) -> float:
        total = sum(split["num_tokens"] for split in self.manifest["splits"].values())
        return total / max(self.seconds_tokenizing, 1e-9)


class Interrupted(BaseException):
    """A termination signal arrived while preparing; the partial output has been removed.

    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def _signals_raise(signals=(signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """SIGTERM/SIGHUP (scancel, a closed terminal) raise :class:`Interrupted` instead of killing the process on the
    spot, so the cleanup below runs. SIGINT already raises KeyboardInterrupt. Only the main thread may install.

    The handler's exception can land anywhere, in code that turns it into its own: a C extension being imported
    reports ``ImportError: initialization failed`` (sentencepiece's did, on CI), sentencepiece's trainer a
    ``RuntimeError``; a library may even swallow it. So the signal is also remembered, and whatever leaves the block
    after one arrived, an exception or nothing, leaves it as :class:`Interrupted` (chained to what the signal became)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def _raise(signum, frame):
        received.append(signum)
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, _raise) for sig in signals}
    try:
        yield
    except Interrupted:
        raise
    except BaseException as e:
        if received:
            raise Interrupted(received[0]) from e
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        raise Interrupted(received[0])


def _temp_name(out: Path) -> Path:
    # Host and pid: on a shared file system another node's preparation of the same output is not ours to remove.
    return out.with_name(f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def _remove_stale_temps(out: Path) -> None:
    """Remove the temporary directories of earlier preparations of ``out`` on this host whose process is gone
    (killed with SIGKILL, or the machine went down): nothing else would ever delete them."""
    prefix = f".{out.name}.tmp-{socket.gethostname()}-"
    for tmp in out.parent.glob(f"{glob.escape(prefix)}*"):
        pid = tmp.name[len(prefix):]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _make_temp_dir(out: Path) -> Path:
    """Create the working directory beside the output, with errors that say what to fix."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"output={out}: cannot create its parent directory {out.parent} ({e.strerror}); "
                        f"choose an output under a writable directory") from None
    _remove_stale_temps(out)
    tmp = _temp_name(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as e:
        where = "read-only file system" if e.errno == errno.EROFS else e.strerror
        raise DataError(f"output={out}: cannot write in {out.parent} ({where}); choose a writable location") from None
    return tmp


def prepare(cfg: PrepareConfig) -> Prepared:
    """Run the whole preparation; the manifest is also written to ``<output>/manifest.json``.

    Nothing but the finished directory is left behind: on an error, Ctrl-C, SIGTERM or SIGHUP the working
    directory is removed (and one left by a SIGKILL is removed by the next run for the same output)."""
    validate(cfg)
    out = Path(cfg.output)
    if out.is_file():
        raise DataError(f"output={out} is an existing file, not a directory; choose a directory path")
    if out.exists() and not cfg.overwrite:
        raise DataError(f"{out} already exists; pass overwrite=true to replace it, or choose another output")
    tmp = _make_temp_dir(out)
    try:
        with _signals_raise():
            records, source = record_stream(cfg)
            tokenizer, tokenizer_source = get_tokenizer(cfg, records, tmp / DATASET_TOKENIZER_DIR)
            tokenizer.save_pretrained(tmp / DATASET_TOKENIZER_DIR)
            started = time.perf_counter()
            splits = write_splits(cfg, records(), tokenizer, tmp)
            elapsed = time.perf_counter() - started
            manifest = build_manifest(cfg, tokenizer, tokenizer_source, source, splits)
            write_manifest(tmp, manifest)  # last file written: its presence marks a complete data set
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # Timing is reported, never stored: the manifest must not differ between two identical preparations.
    return Prepared(out, manifest, elapsed)
