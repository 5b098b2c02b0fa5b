"""Hugging Face Hub ids (``org/name[@revision]``) as model and tokenizer sources, resolved into the Hub's cache.

``model.pretrained_path`` and every tokenizer path (``data/prepare.py tokenizer=``) accept, besides a local
directory, a Hub id such as ``meta-llama/Llama-3.1-8B`` or ``meta-llama/Llama-3.1-8B@<branch, tag or commit>``. A
path that exists locally is always local; anything else of the form ``org/name[@revision]`` is an id.

:func:`resolve` returns the id's snapshot directory in the Hub cache (``HF_HUB_CACHE``, default
``~/.cache/huggingface/hub``; ``HF_HOME`` moves it): from the cache when it is there (no network), else
downloaded with ``huggingface_hub.snapshot_download`` (the weights as safetensors, config and tokenizer files only).
Compute nodes without internet run with ``HF_HUB_OFFLINE=1`` from a cache filled beforehand on a login node::

    python -m zerotrain.fetch meta-llama/Llama-3.1-8B          # or: hf download meta-llama/Llama-3.1-8B

Every failure is a :class:`HubError` (exit 2) that names the id, the cache and the command that fixes it: a
missing cache entry offline, a gated or private model (``HF_TOKEN``), an unknown id or revision, no network.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from zerotrain.errors import ConfigError

# org/name as the Hub spells them (letters, digits, '-', '_', '.'), then an optional @revision (branch, tag, commit).
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w.-][\w./-]*))?")

# What training, export and evaluation read from a model repository: not the .bin/.pth duplicates of the weights
# or Meta's original/ consolidated checkpoint, which would double or triple the download.
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]
TOKENIZER_FILES = ["tokenizer*", "special_tokens_map.json", "config.json", "*.jinja"]


class HubError(ConfigError):
    """A Hub id that cannot be resolved; the message says how to fix it."""


def parse(spec: str | os.PathLike) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``spec`` is a Hub id rather than a local path, else None."""
    text = str(spec)
    if Path(text).exists():
        return None
    match = _HUB_ID.fullmatch(text)
    if match is None:
        return None
    return match["repo"], match["revision"]


def cache_dir() -> Path:
    """The Hub cache huggingface_hub uses, read from the environment now (not when huggingface_hub was imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def fetch_command(repo_id: str, revision: str | None, tokenizer_only: bool = False) -> str:
    spec = repo_id if revision is None else f"{repo_id}@{revision}"
    return f"python -m zerotrain.fetch {spec}" + (" --tokenizer-only" if tokenizer_only else "")


def resolve(spec: str, what: str = "model.pretrained_path", tokenizer_only: bool = False) -> Path:
    """The local directory ``spec`` names: itself if it is not a Hub id, else the id's snapshot in the cache
    (downloaded unless ``HF_HUB_OFFLINE=1``). ``what`` names the setting in error messages."""
    parsed = parse(spec)
    if parsed is None:
        return Path(spec)
    repo_id, revision = parsed
    from huggingface_hub import errors as hub_errors

    cache = cache_dir()
    patterns = TOKENIZER_FILES if tokenizer_only else MODEL_FILES
    command = fetch_command(repo_id, revision, tokenizer_only)
    where = f"{what}={spec}"
    try:
        path = _snapshot(repo_id, revision, cache, patterns)
    except hub_errors.GatedRepoError:
        raise HubError(f"{where}: {repo_id} is a gated model. Accept its licence on https://huggingface.co/{repo_id} "
                       f"with your account, then set HF_TOKEN=<a read token of that account> (or run `hf auth "
                       f"login`) and run {command} on a machine with internet") from None
    except hub_errors.RevisionNotFoundError:
        raise HubError(f"{where}: {repo_id} has no revision {revision!r} (a branch, tag or commit of "
                       f"https://huggingface.co/{repo_id})") from None
    except hub_errors.RepositoryNotFoundError:
        raise HubError(f"{where}: no model {repo_id} on the Hub, or it is private: check the spelling, or set "
                       f"HF_TOKEN=<a token with access>. A local directory of that name does not exist "
                       f"either") from None
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled):
        raise HubError(f"{where}: {repo_id}" + (f" at revision {revision}" if revision else "") + f" is not in the "
                       f"Hugging Face cache {cache} and HF_HUB_OFFLINE=1 forbids downloading it. Fill the cache on a "
                       f"machine with internet (a login node) with: {command}   (or: hf download {repo_id}"
                       + (f" --revision {revision}" if revision else "") + f"), with the same HF_HUB_CACHE/HF_HOME "
                       f"as this run. (No local file or directory {spec} exists either.)") from None
    except (hub_errors.HfHubHTTPError, OSError) as e:
        detail = " ".join(str(e).split())[:300]
        raise HubError(f"{where}: could not download {repo_id} into {cache} ({type(e).__name__}: {detail}). "
                       f"Fill the cache where there is internet with: {command}, then run with "
                       f"HF_HUB_OFFLINE=1") from None
    needed = ("tokenizer.json", "tokenizer.model") if tokenizer_only else ("config.json",)
    if not any((path / name).is_file() for name in needed):
        raise HubError(f"{where}: the cached snapshot {path} has no {' or '.join(needed)} (an interrupted or "
                       f"partial download?). Complete it with: {command}")
    return path


def _snapshot(repo_id: str, revision: str | None, cache: Path, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hub_errors

    try:  # the cache first: no network, and no Hub API call per rank once it is filled
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns,
                                      local_files_only=True))
    except hub_errors.LocalEntryNotFoundError:
        if offline():
            raise
    return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns))
