"""Shared test set-up: the CPU environment every DeepSpeed process needs, and a launcher for multi-process runs.

Every test that trains launches real processes (torchrun, gloo, ``DS_ACCELERATOR=cpu``). Traps measured on 2-core
machines, handled here once: DeepSpeed JIT-builds a shared-memory comm op at ``init_distributed`` (~60-90 s), cached
in ``.cache/torch_extensions`` so it is built once per machine; the launcher leaves ``OMP_NUM_THREADS`` unset, which
oversubscribes the cores several times over (6x slower), so it is 1 here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

CPU_ENV = {
    "DS_ACCELERATOR": "cpu",
    "OMP_NUM_THREADS": "1",
    "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions"),
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    # Nothing in the tests may reach the Hugging Face hub.
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
os.environ.update(CPU_ENV)


def run_command(args: list[str], timeout: float = 600, cwd: Path = REPO, env: dict | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
    """Run a command with the CPU environment; on failure show the tail of its output in the assertion."""
    full_env = {**os.environ, **CPU_ENV, **(env or {})}
    proc = subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {proc.returncode}\n--- output tail ---\n"
                             f"{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def torchrun(nproc: int, script: str | Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node N script args...`` from the repository root."""
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script), *args]
    return run_command(cmd, **kwargs)


def prepare_shipped_corpus(out_dir: Path, vocab_size: int = 2048) -> Path:
    """The shipped corpus through the real prepare command (the same one `make data` runs)."""
    if not (out_dir / "manifest.json").is_file():
        run_command([PYTHON, "data/prepare.py", "input=data/corpus/shakespeare_milton.txt", f"output={out_dir}",
                     f"tokenizer.train_vocab_size={vocab_size}", "valid_fraction=0.02", "progress=false"], timeout=600)
    return out_dir
