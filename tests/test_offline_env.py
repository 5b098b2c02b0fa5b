"""The offline install on a node that brings its own torch (docs/offline_install.md), as documented, on the CPU.

Cached in .cache/offline_env (each part rebuilt when requirements*.txt or the tool making it changes): the wheelhouse
for this Python (``tools/wheelhouse.py``, what ``make wheelhouse PY=3.11`` runs; needs PyPI the first time), a
"node" interpreter whose site holds only torch, its own requirements, numpy and pip (a venv with them linked from the
project's), and tools/node_env.sh's environment over it. There: a 4-rank tiny training and the GPU check's dry run
through benchmarks/gpu_check.sh, the command a GPU node runs.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from tools.launcher import REPO, run

pytestmark = pytest.mark.launch
TAG = f"py{sys.version_info.major}{sys.version_info.minor}"
WHEELHOUSE_SOURCES = ("requirements.txt", "requirements-node.txt", "tools/wheelhouse.py")


def _key(*sources: str) -> str:
    h = hashlib.sha256(sys.version.encode())
    for name in sources:
        h.update((REPO / name).read_bytes())
    return h.hexdigest()[:12]


def _closure(name: str, seen: set[str]) -> set[str]:
    """``name`` and what it requires (extras left out), as installed here."""
    if name in seen:
        return seen
    seen.add(name)
    for req in md.requires(name) or []:
        dep = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0]
        if "extra ==" not in req and _installed(dep):
            _closure(dep, seen)
    return seen


def _installed(name: str) -> bool:
    try:
        md.distribution(name)
        return True
    except md.PackageNotFoundError:
        return False


def torch_only_python(base: Path) -> Path:
    """A venv (no system site) holding torch, its requirements, numpy and pip, linked from the running environment;
    torch's metadata copied with its version's local label dropped (``2.13.0+cpu`` -> ``2.13.0``), as on the H200
    node: ``torch.__version__`` says 2.11.0+cu130 while its installed metadata says 2.11.0."""
    if (base / "ok").exists():
        return base / "bin" / "python"
    shutil.rmtree(base, ignore_errors=True)
    run([sys._base_executable, "-m", "venv", "--without-pip", str(base)], timeout=120)
    purelib = next((base / "lib").glob("python3*/site-packages"))
    for name in sorted(_closure("torch", set()) | {"numpy", "pip"}):
        dist = md.distribution(name)
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            source = Path(dist.locate_file(top))
            if name == "torch" and top.endswith(".dist-info"):
                unlabelled = re.sub(r"\+[^-]+(?=\.dist-info$)", "", top)  # pip reads the version from the name
                shutil.copytree(source, purelib / unlabelled)
                metadata = purelib / unlabelled / "METADATA"
                metadata.write_text(re.sub(r"(?m)^Version: ([^+\n]+)\+\S+$", r"Version: \1", metadata.read_text(),
                                           count=1))
            elif source.exists() and not (purelib / top).exists():
                (purelib / top).symlink_to(source)
    (base / "ok").write_text("")
    return base / "bin" / "python"


@pytest.fixture(scope="module")
def offline_env():
    root = REPO / ".cache" / "offline_env"
    wheelhouse = root / f"wheelhouse-{_key(*WHEELHOUSE_SOURCES)}" / TAG
    if not (wheelhouse / "manifest.json").exists():
        proc = run([sys.executable, "tools/wheelhouse.py", "--python", f"{sys.version_info.major}."
                    f"{sys.version_info.minor}", "--out", str(wheelhouse)], timeout=1500, check=False)
        if proc.returncode != 0 and "cannot download" in proc.stderr + proc.stdout:
            pytest.skip(f"the wheelhouse needs PyPI the first time: {proc.stderr[-500:]}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
    node_python = torch_only_python(root / "node_python-unlabelled2")
    venv = root / f"venv-{_key(*WHEELHOUSE_SOURCES, 'tools/node_env.sh', 'tools/node_install.py')}"
    return {"wheelhouse": wheelhouse, "node_python": node_python, "venv": venv,
            # Its own JIT cache: DeepSpeed's CPU comm op built from this venv's sources has another build command
            # than the project venv's, and two environments sharing one cache rebuild it in turn.
            "env": {"ZT_WHEELHOUSE": str(wheelhouse), "ZT_PYTHON": str(node_python), "ZT_NODE_VENV": str(venv),
                    "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(venv / "torch_extensions")}}


def test_wheelhouse_is_one_version_of_each_within_40_mib_without_torch(offline_env):
    manifest = json.loads((offline_env["wheelhouse"] / "manifest.json").read_text())
    names = [w["name"] for w in manifest["wheels"]]
    assert len(names) == len(set(names))
    assert {"deepspeed", "transformers", "omegaconf", "antlr4-python3-runtime", "hjson", "pydantic",
            "pydantic-core"} <= set(names)
    assert not {"torch", "triton", "numpy"} & set(names)
    assert manifest["total_bytes"] == sum(w["size"] for w in manifest["wheels"]) <= 40 * 2**20
    files = {p.name for p in offline_env["wheelhouse"].glob("*.whl")}
    assert files == {w["file"] for w in manifest["wheels"]}
    ds = next(w for w in manifest["wheels"] if w["name"] == "deepspeed")
    assert ds["file"].endswith("-py3-none-any.whl") and ds["version"] == "0.19.8"


def test_the_first_node_install_fails_on_the_node_where_the_walk_chooses_the_wheels(offline_env, tmp_path):
    """The negative control of node_env.sh's install. Its first version ran pip's resolver with the constraint
    ``torch==<torch.__version__>``; on the H200 node (torch 2.11.0+cu130, metadata 2.11.0) that matches no candidate,
    so pip gave up (``ResolutionImpossible`` for ``deepspeed==0.19.8``). tools/node_install.py plans the install
    from the installed metadata instead."""
    wheelhouse, node_python = offline_env["wheelhouse"], offline_env["node_python"]
    version = run([node_python, "-c", "import torch; print(torch.__version__)"]).stdout.strip()
    assert "+" in version and md.version("torch") == version  # here both carry the label; the node's metadata not
    constraints = tmp_path / "c.txt"
    constraints.write_text(f"torch=={version}\n")
    pip = run([node_python, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", str(wheelhouse),
               "-c", str(constraints), "-r", "requirements-node.txt"], check=False, timeout=300,
              # this machine's pip config adds a find-links holding a torch wheel; a GPU node has none
              env={"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(wheelhouse)})
    said = pip.stdout + pip.stderr
    assert pip.returncode != 0 and "ResolutionImpossible" in said, said
    plan = run([node_python, "tools/node_install.py", str(wheelhouse), "requirements-node.txt", "plan"], timeout=120)
    files = {Path(x).name for x in plan.stdout.split()}
    assert {"deepspeed-0.19.8-py3-none-any.whl", "transformers-5.24.0-py3-none-any.whl"} <= files
    assert not any(f.startswith(("torch-", "numpy-")) for f in files)
    assert f"torch {version.split('+')[0]}" in plan.stderr  # kept from the node


def test_offline_env_trains_on_4_ranks_and_runs_the_dry_run_keeping_the_nodes_torch(offline_env, shakespeare,
                                                                                     tmp_path):
    env = offline_env["env"]
    # The control: the "node" interpreter really has torch and none of what the wheelhouse brings.
    bare = run([offline_env["node_python"], "-c", "import torch, importlib.util as u; print(torch.__version__, "
                "[m for m in ('deepspeed', 'transformers', 'omegaconf', 'pydantic') if u.find_spec(m)])"], env=env)
    assert bare.stdout.split(" ", 1)[1].strip() == "[]", bare.stdout
    out = tmp_path / "check"
    # The command a GPU node runs (it builds the environment the first time, with no index), dry: on the CPU.
    check = run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--out", str(out)], env=env, timeout=1500,
                check=False)
    assert check.returncode == 0, check.stdout[-4000:] + check.stderr[-4000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["dry_run"] and summary["ok"], summary["rows"]
    assert set(summary["sections"]) == {"race", "record_stream", "stall", "train"}
    for section in summary["sections"]:
        assert (out / f"{section}.json").exists() and (out / f"{section}.md").exists()
    python = offline_env["venv"] / "bin" / "python"
    probe = run([python, "-c", "import torch, deepspeed, transformers, omegaconf, sys; "
                 "print(torch.__file__, deepspeed.__file__, transformers.__version__, sys.prefix)"], env=env)
    torch_file, ds_file, transformers_version, prefix = probe.stdout.split()
    assert not os.path.realpath(torch_file).startswith(os.path.realpath(prefix))  # the node's torch, not a copy
    assert ds_file.startswith(prefix) and transformers_version == "5.24.0"
    train = run([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "train.py",
                 "recipe=tiny_llama", "train.steps=3", "train.log_interval=1", "train.eval_interval=0",
                 "wandb.enabled=false", "checkpoint.interval=0", f"data.train.0.path={shakespeare}",
                 f"run.output_dir={tmp_path / 'runs'}", "run.name=offline"], env=env, timeout=900)
    metrics = [json.loads(x) for x in (tmp_path / "runs" / "offline" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses), train.stdout[-3000:]
