"""Hugging Face Hub ids (org/name[@revision]) as model and tokenizer sources, from a fake Hub cache built here (the
cache's own layout: models--org--name/snapshots/<sha>/..., refs/main), offline: nothing reaches the network."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest
import torch

from tools.launcher import PYTHON, run
from zerotrain import hub, run_config
from zerotrain.data.prepare import PrepareConfig, TokenizerArgs, prepare
from zerotrain.data.tokenizer import load_tokenizer, train_llama3_bpe
from zerotrain.models import build_model

SHA = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "zerotrain-test/tiny-llama3"
CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus" / "shakespeare_milton.txt"


@pytest.fixture(scope="module")
def fake_cache(tmp_path_factory) -> Path:
    """A Hub cache holding REPO_ID at commit SHA (refs/main points at it): a tiny Llama-3-shaped checkpoint and a
    Llama-3-style tokenizer, as `hf download` leaves them."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / SHA
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    cfg = run_config.compose("tiny_llama3")
    model = build_model(cfg.model, "fp32")
    model.save_pretrained(snapshot, safe_serialization=True)
    train_llama3_bpe([CORPUS.read_text(encoding="utf-8")[:100_000]], snapshot, vocab_size=1024)
    return cache


@pytest.fixture
def offline(monkeypatch, fake_cache):
    monkeypatch.setenv("HF_HUB_CACHE", str(fake_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return fake_cache


def test_hub_ids_and_local_paths_are_told_apart(tmp_path, monkeypatch):
    assert hub.parse("meta-llama/Llama-3.1-8B") == ("meta-llama/Llama-3.1-8B", None)
    assert hub.parse("meta-llama/Llama-3.1-8B@v1.0") == ("meta-llama/Llama-3.1-8B", "v1.0")
    assert hub.parse(f"org/name@{SHA}") == ("org/name", SHA)
    for local in ("models/hf/Llama-2-13b-hf", "./org/name", "/abs/name", "name", "org/name/"):
        assert hub.parse(local) is None, local
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.parse("org/name") is None  # an existing local directory always wins


def test_model_and_tokenizer_resolve_offline_from_the_cache(offline):
    snapshot = offline / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / SHA
    for spec in (REPO_ID, f"{REPO_ID}@main", f"{REPO_ID}@{SHA}"):
        assert hub.resolve(spec) == snapshot
    tok = load_tokenizer(REPO_ID)
    assert tok.path == snapshot / "tokenizer.json" and (tok.bos_id, tok.eos_id) == (768, 769)
    assert tok.encode("To be, or not to be") == load_tokenizer(snapshot).encode("To be, or not to be")


def test_pretrained_path_hub_id_loads_the_cached_weights(offline):
    cfg = run_config.compose("tiny_llama3", [f"model.pretrained_path={REPO_ID}@{SHA}"])
    from safetensors.torch import load_file

    model = build_model(cfg.model, "fp32")
    saved = load_file(str(hub.resolve(REPO_ID) / "model.safetensors"))
    state = model.state_dict()
    assert saved and all(torch.equal(state[name], tensor) for name, tensor in saved.items())


def test_prepare_with_a_hub_tokenizer_records_the_id(offline, tmp_path):
    source = tmp_path / "text.txt"
    source.write_text(CORPUS.read_text(encoding="utf-8")[:20_000])
    result = prepare(PrepareConfig(input=str(source), output=str(tmp_path / "out"), progress=False,
                                   tokenizer=TokenizerArgs(path=REPO_ID), valid_fraction=0.0))
    assert result.manifest["tokenizer"]["source"] == REPO_ID and result.manifest["tokenizer"]["bos_id"] == 768


def test_missing_cache_entry_names_the_id_the_cache_and_the_command(offline):
    with pytest.raises(hub.HubError) as error:
        hub.resolve("meta-llama/Llama-3.1-8B@main")
    message = str(error.value)
    assert error.value.exit_code == 2
    for needed in ("model.pretrained_path=meta-llama/Llama-3.1-8B@main", str(offline),
                   "python -m zerotrain.fetch meta-llama/Llama-3.1-8B@main", "hf download meta-llama/Llama-3.1-8B",
                   "HF_HUB_OFFLINE=1"):
        assert needed in message, needed
    with pytest.raises(hub.HubError, match="tokenizer=org/absent.*--tokenizer-only"):
        load_tokenizer("org/absent")
    # An entry whose snapshot lacks config.json (an interrupted download) is named as such.
    with pytest.raises(hub.HubError, match="has no config.json"):
        incomplete = offline / "models--org--partial"
        (incomplete / "snapshots" / SHA).mkdir(parents=True)
        (incomplete / "refs").mkdir()
        (incomplete / "refs" / "main").write_text(SHA)
        hub.resolve("org/partial")


def test_train_start_up_check_refuses_an_uncached_model_before_any_process_group(offline):
    import train

    cfg = run_config.compose("tiny_llama3", ["model.pretrained_path=meta-llama/Llama-3.1-8B"])
    cfg.data.train = []
    with pytest.raises(hub.HubError, match="not in the Hugging Face cache"):
        train.check_inputs(cfg)
    cfg.model.pretrained_path = REPO_ID
    train.check_inputs(cfg)


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers every request as the Hub answers for a gated repository (X-Error-Code: GatedRepo) or an unknown one."""

    def do_GET(self):  # noqa: N802 - http.server's name
        gated = "/gated" in self.path
        self.send_response(401 if not gated else 403)
        self.send_header("X-Error-Code", "GatedRepo" if gated else "RepoNotFound")
        self.send_header("X-Error-Message", "Access to model org/gated is restricted." if gated else "not found")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps({"error": "restricted" if gated else "Repository not found"}).encode())

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def test_fetch_fills_from_the_cache_offline_and_names_hf_token_for_a_gated_model(fake_cache, tmp_path):
    """python -m zerotrain.fetch: the cached snapshot's path offline; online (a local server standing in for the
    Hub) a gated model names HF_TOKEN and an unknown one says so; never a traceback, exit 2."""
    cached = {"HF_HUB_CACHE": str(fake_cache), "HF_HUB_OFFLINE": "1"}
    found = run([PYTHON, "-m", "zerotrain.fetch", REPO_ID], env=cached, timeout=120)
    assert found.stdout.strip().endswith(f"snapshots/{SHA}")
    missing = run([PYTHON, "-m", "zerotrain.fetch", "org/absent"], env=cached, check=False, timeout=120)
    assert missing.returncode == 2 and "python -m zerotrain.fetch org/absent" in missing.stderr
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        online = {"HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "0", "HF_HUB_ETAG_TIMEOUT": "5",
                  "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "HF_HUB_DISABLE_TELEMETRY": "1"}
        gated = run([PYTHON, "-m", "zerotrain.fetch", "org/gated"], env=online, check=False, timeout=120)
        unknown = run([PYTHON, "-m", "zerotrain.fetch", "org/unknown"], env=online, check=False, timeout=120)
    finally:
        server.shutdown()
    assert gated.returncode == 2 and "gated model" in gated.stderr and "HF_TOKEN" in gated.stderr, gated.stderr
    assert unknown.returncode == 2 and "no model org/unknown on the Hub" in unknown.stderr, unknown.stderr
    assert all("Traceback" not in p.stderr for p in (missing, gated, unknown))
