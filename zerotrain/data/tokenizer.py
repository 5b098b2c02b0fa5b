"""Tokenizers: the one interface the data pipeline, the trainer and the evaluator use, and its implementations.

Whatever is behind it, a tokenizer looks the same::

    tok = load_tokenizer("path/to/tokenizer.model")   # or tokenizer.json, a HF model dir, a prepared data dir
    ids = tok.encode("Hello world")                     # list[int]; never adds BOS/EOS
    text = tok.decode(ids)                              # exact inverse for plain text (byte fallback / byte-level)
    tok.bos_id, tok.eos_id, tok.pad_id                  # int, or None where the tokenizer has no such token
    tok.vocab_size, tok.kind                            # kind: "sentencepiece" | "tokenizer_json" | "transformers"
    tok.save_pretrained(out_dir)                        # files transformers.AutoTokenizer.from_pretrained loads

``bos_id`` is the token put in front of every document (data preparation) and every evaluation context (the MMLU
evaluator), or None where the tokenizer puts none there.

Implementations:

* ``sentencepiece``: a sentencepiece model file (Llama-2's ``tokenizer.model``, or one trained here by
  :func:`train_sentencepiece` with Llama-2's published trainer settings: BPE, byte fallback, split digits, identity
  normalisation, ``<unk>``=0 ``<s>``=1 ``</s>``=2). ``save_pretrained`` writes the model verbatim and a
  ``tokenizer.json`` that encodes exactly as the model does (:meth:`SentencePieceTokenizer.fast_tokenizer`), which
  ``AutoTokenizer`` loads as a fast tokenizer adding BOS like Llama-2's, with neither ``sentencepiece`` nor
  ``protobuf`` installed. (Left to convert ``tokenizer.model`` itself, transformers drops the dummy-prefix piece of
  text that starts with whitespace: ``" Hello"`` -> ``[15043]`` instead of Llama-2's ``[29871, 15043]``.)
* ``tokenizer_json``: a Hugging Face ``tokenizers`` file (Falcon's and Llama-3's byte-level BPE). The file has no
  notion of BOS/EOS, so they come from a ``tokenizer_config.json``/``special_tokens_map.json`` next to it, else from
  well-known special tokens (``<|endoftext|>`` for Falcon; ``<|begin_of_text|>``/``<|end_of_text|>`` for Llama-3).
  :func:`train_llama3_bpe` trains one of Llama-3's kind (its pre-tokenizer, byte-level BPE, its 256 special tokens
  after the merged ones) for CPU-sized models.
* ``transformers``: :class:`TransformersTokenizer` wraps a ``transformers`` tokenizer, e.g. the one of a Hugging Face
  checkpoint being evaluated (:func:`as_tokenizer` wraps one and passes a :class:`Tokenizer` through).

Text is encoded literally by the two file tokenizers: a string such as ``</s>`` inside a document is text, not the
EOS token, so data cannot inject control tokens (a ``transformers`` tokenizer, our exports' included, reads such
strings as special tokens, as transformers and lm-evaluation-harness do; on all other text the exports give the
training ids). ``load_tokenizer`` on a directory prefers ``tokenizer.model`` over
``tokenizer.json`` (a Llama-2 HF directory has both; the sentencepiece model is the original).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

from zerotrain.errors import DataError

SENTENCEPIECE = "sentencepiece"
TOKENIZER_JSON = "tokenizer_json"
TRANSFORMERS = "transformers"
KINDS = (SENTENCEPIECE, TOKENIZER_JSON, TRANSFORMERS)

# Where a prepared data set keeps its copy of the tokenizer (see zerotrain.data.prepare).
DATASET_TOKENIZER_DIR = "tokenizer"

# Llama-2's sentencepiece trainer settings, as recorded in the trainer_spec of its tokenizer.model. Threads are 1
# (Llama-2 used 80) and the input is not shuffled so that training is deterministic: same text, same bytes.
LLAMA2_TRAINER_SPEC = dict(
    model_type="bpe",
    character_coverage=0.99995,
    byte_fallback=True,
    split_digits=True,
    split_by_unicode_script=True,
    split_by_whitespace=True,
    split_by_number=True,
    allow_whitespace_only_pieces=True,
    max_sentencepiece_length=16,
    max_sentence_length=4192,
    normalization_rule_name="identity",
    add_dummy_prefix=True,
    remove_extra_whitespaces=False,
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=-1,
    num_threads=1,
    shuffle_input_sentence=False,
    hard_vocab_limit=True,
    vocabulary_output_piece_score=True,
    minloglevel=2,  # errors only: sentencepiece otherwise logs every one of the 256 byte pieces
)

# Llama-3's pre-tokenizer split (tokenizer.json's Split pattern, from tiktoken's cl100k): contractions, letter runs
# with one leading non-letter, 1-3 digit groups, punctuation runs, newlines, other whitespace.
LLAMA3_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                        r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_BOS, LLAMA3_EOS, LLAMA3_EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
LLAMA3_NUM_SPECIAL = 256


def llama3_special_tokens() -> list[str]:
    """Llama-3's 256 special tokens in id order (128000 + i in the real vocabulary)."""
    named = {0: LLAMA3_BOS, 1: LLAMA3_EOS, 6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: LLAMA3_EOT}
    tokens, reserved = [], 0
    for i in range(LLAMA3_NUM_SPECIAL):
        if i in named:
            tokens.append(named[i])
        else:
            tokens.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return tokens


# Names tried, in order, when a tokenizer.json comes without a config naming its special tokens.
KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
KNOWN_BOS = ("<s>", "<|begin_of_text|>", "<bos>")
KNOWN_PAD = ("<pad>", "[PAD]")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    # Sorted keys and a trailing newline: two preparations of the same input write the same bytes.
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


class Tokenizer(ABC):
    """Text <-> token ids, as the data pipeline, the trainer and the evaluator use them (see the module docstring)."""

    kind: str

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def bos_id(self) -> int | None:
        """The token put in front of every document / evaluation context, or None."""

    @property
    @abstractmethod
    def eos_id(self) -> int | None: ...

    @property
    @abstractmethod
    def pad_id(self) -> int | None: ...

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without BOS/EOS."""

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """``[encode(t) for t in texts]``, possibly in parallel; the result never depends on ``num_threads``."""
        return [self.encode(text) for text in texts]

    @abstractmethod
    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids and, for each, the character offset in ``text`` where the token starts (for SFT loss masks)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def token_text(self, token_id: int) -> str:
        """The text of one (special) token, e.g. ``</s>``."""

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own Jinja chat template (``tokenizer_config.json``'s ``chat_template``), or None."""
        return None

    def special_tokens(self) -> dict[str, int]:
        """Text -> id of every special (control) token: what a rendered chat template's markers become."""
        return {}

    def describe(self) -> dict:
        """What a manifest records about the tokenizer."""
        return {"kind": self.kind, "vocab_size": self.vocab_size, "bos_id": self.bos_id, "eos_id": self.eos_id,
                "pad_id": self.pad_id}

    @abstractmethod
    def save_pretrained(self, out_dir: str | Path) -> list[Path]:
        """Write the files ``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads; returns their paths."""


class FileTokenizer(Tokenizer):
    """A tokenizer defined by one file (``tokenizer.model`` or ``tokenizer.json``), which ``save_pretrained`` copies."""

    filename: str  # the name transformers (and load_tokenizer) look for in a directory
    path: Path  # the file that defines the tokenizer

    @property
    def sha256(self) -> str:
        return file_sha256(self.path)

    @property
    def chat_template(self) -> str | None:
        return _chat_template_next_to(self.path)

    def describe(self) -> dict:
        return {**super().describe(), "file": self.filename, "sha256": self.sha256}

    def save_pretrained(self, out_dir: str | Path) -> list[Path]:
        """Write the tokenizer file verbatim plus the config files ``AutoTokenizer.from_pretrained`` needs."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        target = out / self.filename
        if not target.exists() or not target.samefile(self.path):
            shutil.copyfile(self.path, target)
        special = {
            key: self.token_text(token_id)
            for key, token_id in (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("pad_token", self.pad_id))
            if token_id is not None
        }
        config = {**self._hf_config(), **special}
        template = self.chat_template  # read before the config file below may replace the one it came from
        if template is not None:
            config["chat_template"] = template
        _write_json(out / "tokenizer_config.json", config)
        _write_json(out / "special_tokens_map.json", special)
        return [target, out / "tokenizer_config.json", out / "special_tokens_map.json"]

    @abstractmethod
    def _hf_config(self) -> dict: ...


class SentencePieceTokenizer(FileTokenizer):
    """A sentencepiece model: Llama-2's ``tokenizer.model`` or one trained by :func:`train_sentencepiece`."""

    kind = SENTENCEPIECE
    filename = "tokenizer.model"

    def __init__(self, path: Path):
        import sentencepiece as spm

        self.path = Path(path)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (OSError, RuntimeError) as e:
            raise DataError(f"{self.path}: not a readable sentencepiece model ({e}). Pass a Llama-2 tokenizer.model, "
                            f"a tokenizer.json, or leave tokenizer unset to train one") from None

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def _optional(self, token_id: int) -> int | None:
        return None if token_id < 0 else token_id

    @property
    def bos_id(self) -> int | None:
        return self._optional(self._sp.bos_id())

    @property
    def eos_id(self) -> int | None:
        return self._optional(self._sp.eos_id())

    @property
    def pad_id(self) -> int | None:
        return self._optional(self._sp.pad_id())

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        return self._sp.encode(list(texts), num_threads=num_threads)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        mapping = self._sp.encode_as_offset_mapping(text)
        return list(mapping["ids"]), [start for start, _ in mapping["offsets"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def token_text(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)

    def special_tokens(self) -> dict[str, int]:
        return {self.token_text(i): i for i in range(self.vocab_size) if self._sp.is_control(i)}

    def save_pretrained(self, out_dir: str | Path) -> list[Path]:
        """The model verbatim (for sentencepiece users such as a slow tokenizer), its exact ``tokenizer.json`` (what
        ``AutoTokenizer`` loads) and the config files."""
        written = super().save_pretrained(out_dir)
        fast = Path(out_dir) / "tokenizer.json"
        self.fast_tokenizer().save(str(fast), pretty=True)
        return [*written, fast]

    def fast_tokenizer(self) -> Any:
        """This model as a ``tokenizers.Tokenizer`` that gives the ids :meth:`encode` gives, BOS prepended by its
        post-processor (``add_special_tokens=True``), as Llama-2's ``tokenizer.json`` does.

        Built by transformers' own converter from the model's pieces, scores and normaliser settings, with
        ``legacy=True``: sentencepiece puts its dummy prefix ``▁`` in front of every text, also one that already
        starts with a space (``" Hello"`` -> ``"▁▁Hello"`` -> ``[▁, ▁Hello]``); the non-legacy conversion, like
        transformers' ``LlamaTokenizer``, leaves it out there. Reading the model file needs ``protobuf``, loading the
        result does not.
        """
        from tokenizers import AddedToken, processors
        from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

        extractor = SentencePieceExtractor(str(self.path))
        # None: BPE or Unigram, as the model file says. transformers annotates a tuple; this extractor returns a dict.
        vocab = cast(dict, extractor.extract(None))["vocab"]
        tokenizer = SpmConverter.build_tokenizer_from_spm_proto(extractor.proto, vocab, legacy=True)
        special = [i for i in range(self.vocab_size) if self._sp.is_control(i) or self._sp.is_unknown(i)]
        tokenizer.add_special_tokens([AddedToken(self.token_text(i), special=True, normalized=False)
                                      for i in special])
        if self.bos_id is not None:
            bos = self.token_text(self.bos_id)
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, self.bos_id)])
        return tokenizer

    def _hf_config(self) -> dict:
        # PreTrainedTokenizerFast: transformers then loads tokenizer.json as it is. Naming LlamaTokenizer would make
        # it rebuild the pipeline from the vocabulary alone and lose the leading-whitespace behaviour again. legacy
        # keeps sentencepiece's own dummy prefix for whoever loads tokenizer.model with a slow LlamaTokenizer.
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": self.token_text(self._sp.unk_id()),
            "add_bos_token": self.bos_id is not None,
            "add_eos_token": False,
            "legacy": True,
            "clean_up_tokenization_spaces": False,
        }


class TokenizerJson(FileTokenizer):
    """A Hugging Face ``tokenizers`` file such as Falcon's ``tokenizer.json`` (byte-level BPE)."""

    kind = TOKENIZER_JSON
    filename = "tokenizer.json"

    def __init__(self, path: Path):
        import tokenizers

        self.path = Path(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception for unparsable files
            raise DataError(f"{self.path}: not a readable tokenizers file ({e})") from None
        # Otherwise "<|endoftext|>" written in a document would become the EOS token: data must stay data.
        self._tok.encode_special_tokens = True
        special = _special_tokens_next_to(self.path)
        self._bos = self._find(special.get("bos_token"), KNOWN_BOS if "eos_token" not in special else ())
        self._eos = self._find(special.get("eos_token"), KNOWN_EOS)
        self._pad = self._find(special.get("pad_token"), KNOWN_PAD if "eos_token" not in special else ())
        if self._eos is None:
            raise DataError(
                f"{self.path}: cannot tell which token ends a document. Put a tokenizer_config.json with "
                f"\"eos_token\" next to it (tried {', '.join(KNOWN_EOS)})"
            )

    def _find(self, configured: str | None, fallbacks: Sequence[str]) -> int | None:
        if configured is not None:
            token_id = self._tok.token_to_id(configured)
            if token_id is None:
                raise DataError(f"{self.path}: special token {configured!r} named in its config is not in the vocab")
            return token_id
        # Only special (added) tokens qualify: in a byte-level vocabulary "</s>" may well be an ordinary merged token.
        special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        for name in fallbacks:
            if name in special:
                return special[name]
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def pad_id(self) -> int | None:
        return self._pad

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        # tokenizers parallelises internally (its own thread pool); results are order-preserving.
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, [start for start, _ in encoding.offsets]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        text = self._tok.id_to_token(token_id)
        if text is None:
            raise ValueError(f"token id {token_id} is not in the tokenizer's vocabulary (size {self.vocab_size})")
        return text

    def special_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def _hf_config(self) -> dict:
        return {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}


class TransformersTokenizer(Tokenizer):
    """A ``transformers`` tokenizer (e.g. a Hugging Face checkpoint's) behind the same interface.

    ``add_bos=None`` follows the tokenizer's own default (what lm-evaluation-harness does since it stopped forcing
    ``add_bos_token=False``): Llama's tokenizer adds ``<s>``, Falcon's adds nothing. Pass True/False to override.
    """

    kind = TRANSFORMERS

    def __init__(self, tokenizer: Any, add_bos: bool | None = None) -> None:
        self.tokenizer = tokenizer
        if add_bos is None:
            add_bos = _adds_bos_by_default(tokenizer)
        bos = getattr(tokenizer, "bos_token_id", None)
        if add_bos and bos is None:
            raise ValueError("add_bos=True but the tokenizer has no bos_token_id")
        self._bos: int | None = bos if add_bos else None

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)  # with added tokens, like TokenizerJson's

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def pad_id(self) -> int | None:
        return self.tokenizer.pad_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoding["input_ids"]), [start for start, _ in encoding["offset_mapping"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.convert_ids_to_tokens(token_id)

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
        return template if isinstance(template, str) else None

    def special_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special}

    def describe(self) -> dict:
        return {**super().describe(), "class": type(self.tokenizer).__name__,
                "name_or_path": str(getattr(self.tokenizer, "name_or_path", ""))}

    def save_pretrained(self, out_dir: str | Path) -> list[Path]:
        return [Path(p) for p in self.tokenizer.save_pretrained(str(out_dir))]

    def __repr__(self) -> str:
        return f"TransformersTokenizer({type(self.tokenizer).__name__}, bos_id={self.bos_id})"


def _adds_bos_by_default(tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > len(without) and with_special[0] == bos


def as_tokenizer(tokenizer: Any) -> Tokenizer:
    """A :class:`Tokenizer` for ``tokenizer``: a ``transformers`` one wrapped, one of ours passed through."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    from transformers import PreTrainedTokenizerBase  # here, not at the top: encoding never needs transformers

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return TransformersTokenizer(tokenizer)
    raise TypeError(
        f"{type(tokenizer).__name__} is neither a transformers tokenizer nor a zerotrain.data.tokenizer.Tokenizer "
        f"(encode(text) -> list[int], bos_id, ...)"
    )


def _special_tokens_next_to(path: Path) -> dict[str, str]:
    """bos/eos/pad token strings from the HF config files beside a tokenizer.json, where there are any."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        config_path = path.parent / name
        if not config_path.is_file():
            continue
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{config_path}: not valid JSON ({e})") from None
        for key in ("bos_token", "eos_token", "pad_token"):
            value = config.get(key)
            if isinstance(value, dict):  # AddedToken serialisation: {"content": "<|endoftext|>", ...}
                value = value.get("content")
            if isinstance(value, str):
                found[key] = value
    return found


def _chat_template_next_to(path: Path) -> str | None:
    """The Jinja chat template saved beside a tokenizer file: ``chat_template.jinja`` (transformers' own file, which
    it prefers), else ``tokenizer_config.json``'s ``chat_template`` (a string, or named templates: "default")."""
    jinja = path.parent / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config_path = path.parent / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    try:
        template = json.loads(config_path.read_text()).get("chat_template")
    except json.JSONDecodeError as e:
        raise DataError(f"{config_path}: not valid JSON ({e})") from None
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    return template if isinstance(template, str) else None


def find_tokenizer_file(path_or_dir: str | Path) -> Path:
    """The tokenizer file a path names: the file itself, the one in a model or prepared-data directory, or the one
    of a Hugging Face Hub id ``org/name[@revision]`` (from the Hub cache, see zerotrain.hub)."""
    from zerotrain import hub

    path = Path(path_or_dir)
    if path.is_file():
        return path
    if hub.parse(path_or_dir) is not None:
        path = hub.resolve(str(path_or_dir), "tokenizer", tokenizer_only=True)
    if not path.is_dir():
        raise DataError(f"{path}: no such tokenizer file or directory. Pass a tokenizer.model (Llama-2), "
                        f"a tokenizer.json (Falcon, Llama-3), a directory holding one, a prepared data directory or "
                        f"a Hugging Face Hub id org/name[@revision]")
    if (path / "manifest.json").is_file() and (path / DATASET_TOKENIZER_DIR).is_dir():
        path = path / DATASET_TOKENIZER_DIR
    for name in ("tokenizer.model", "tokenizer.json"):
        if (path / name).is_file():
            return path / name
    raise DataError(f"{path}: directory has no tokenizer.model or tokenizer.json")


def load_tokenizer(path_or_dir: str | Path) -> Tokenizer:
    """Load a tokenizer from a file, a Hugging Face model directory, or a prepared data directory."""
    path = find_tokenizer_file(path_or_dir)
    if path.suffix == ".json":
        return TokenizerJson(path)
    return SentencePieceTokenizer(path)


def _lines(texts: Iterable[str]) -> Iterator[str]:
    # sentencepiece trains on "sentences"; lines are the natural unit. Newlines themselves are never pieces (they
    # are byte-fallback tokens, as in Llama-2), so nothing is lost.
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                yield line


class _Feed:
    """The sentences handed to sentencepiece, remembering what the iterator raised: sentencepiece turns an exception
    from its ``sentence_iterator`` into its own ``RuntimeError("INTERNAL: ...")``, which would report a SIGTERM
    during training (data/prepare.py's :class:`~zerotrain.data.prepare.Interrupted`) or an unreadable input as a
    failed tokenizer training."""

    def __init__(self, lines: Iterator[str]):
        self.lines = lines
        self.raised: BaseException | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self.lines
        except BaseException as e:  # noqa: BLE001 -- recorded and raised again as itself by train_sentencepiece
            self.raised = e
            raise


def train_sentencepiece(
    texts: Iterable[str],
    out_path: str | Path,
    vocab_size: int,
    seed: int = 1234,
    max_sentences: int = 0,
) -> SentencePieceTokenizer:
    """Train a Llama-2-style BPE sentencepiece model on ``texts`` and write it to ``out_path``.

    Deterministic: the same texts and arguments give a byte-identical model (one thread, fixed seed, no shuffling).
    ``max_sentences`` > 0 trains on the first that many lines only (a large corpus needs no more than a few million).
    """
    import sentencepiece as spm

    out_path = Path(out_path)
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    options: dict[str, Any] = dict(LLAMA2_TRAINER_SPEC, vocab_size=vocab_size, input_sentence_size=max_sentences)
    feed = _Feed(_lines(texts))
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(feed), model_writer=model, **options)
    except RuntimeError as e:
        if feed.raised is not None:  # our text iterator's own error (a bad input, a SIGTERM), not sentencepiece's
            raise feed.raised from None
        raise DataError(
            f"training a {vocab_size}-token sentencepiece tokenizer on this text failed: {e}. With little text or "
            f"few distinct characters, lower tokenizer.train_vocab_size (it must exceed 259 + the number of distinct "
            f"characters)"
        ) from None
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(model.getvalue())
    return SentencePieceTokenizer(out_path)


def train_llama3_bpe(texts: Iterable[str], out_dir: str | Path, vocab_size: int) -> TokenizerJson:
    """Train a byte-level BPE tokenizer of Llama-3's kind on ``texts``; writes ``out_dir/tokenizer.json`` and a
    ``tokenizer_config.json`` naming ``<|begin_of_text|>``/``<|end_of_text|>`` as BOS/EOS.

    Llama-3's pipeline: no normaliser, :data:`LLAMA3_SPLIT_PATTERN` then a regex-free ByteLevel pre-tokenizer,
    BPE with ``ignore_merges`` (a whole pre-token found in the vocabulary is one token), ByteLevel decoder, a
    post-processor adding ``<|begin_of_text|>`` (Llama-3.1's; so an export adds BOS as training did), and its
    256 special tokens after the ``vocab_size - 256`` merged ones (as ids 128000-128255 follow the 128000 merged
    tokens of the real one). Deterministic: the same texts give the same file.
    """
    from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as HfTokenizer

    merged = vocab_size - LLAMA3_NUM_SPECIAL
    if merged < 256:
        raise DataError(f"tokenizer.train_vocab_size={vocab_size} is too small for a Llama-3 tokenizer: it needs the "
                        f"256 byte tokens plus the {LLAMA3_NUM_SPECIAL} special tokens (at least 512)")
    tokenizer = HfTokenizer(models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    # Takes no settings (it ignores any given); serialised with add_prefix_space, trim_offsets and use_regex true.
    tokenizer.decoder = decoders.ByteLevel()
    # Llama-3.1's tokenizer.json: with add_special_tokens, transformers puts <|begin_of_text|> in front, as our
    # documents have it (the first Llama-3 release added nothing there). encode() never adds it.
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(single=f"{LLAMA3_BOS}:0 $A:0", pair=f"{LLAMA3_BOS}:0 $A:0 {LLAMA3_BOS}:1 $B:1",
                                      special_tokens=[(LLAMA3_BOS, vocab_size - LLAMA3_NUM_SPECIAL)]),
    ])
    trainer = trainers.BpeTrainer(vocab_size=merged, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.model.ignore_merges = True  # training replaces the model; Llama-3's sets this
    if tokenizer.get_vocab_size() != merged:
        raise DataError(f"the text has too little variety for a {vocab_size}-token Llama-3 tokenizer "
                        f"({tokenizer.get_vocab_size()} merged tokens, {merged} wanted); lower "
                        f"tokenizer.train_vocab_size")
    tokenizer.add_special_tokens(llama3_special_tokens())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {"bos_token": LLAMA3_BOS, "eos_token": LLAMA3_EOS})
    return TokenizerJson(out / "tokenizer.json")
