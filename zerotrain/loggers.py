"""Where metrics go: a console line, a JSONL file per run (always), and Weights & Biases (rank 0 only).

The W&B run id is stored with every checkpoint and given back to ``wandb.init(id=..., resume="allow")`` on restart,
so a preempted and requeued job continues the same W&B run instead of starting a new one. A resumed run recomputes
the steps between its checkpoint and the last step the previous launch logged; those rows already are in the W&B run
(W&B cannot take rows back), so they go to metrics.jsonl only, and the W&B curve has each step once (see
:class:`MetricsLogger`). Without an API key
(``WANDB_API_KEY`` or a ``~/.netrc`` entry) W&B runs offline; ``wandb sync <run dir>/wandb/offline-run-*`` uploads
it later. The ``wandb`` section of the run config (:class:`WandbConfig`) is declared here.
"""

from __future__ import annotations

import json
import logging
import netrc
import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Optional, cast

from zerotrain import durable

log = logging.getLogger("zerotrain")

# The x axis of every W&B chart: our optimizer step, logged with each row (W&B's own ``_step`` counts rows, and a
# resumed run re-logs steps). tools/compare.py reads it back from W&B's history.
WANDB_STEP_KEY = "train/step"


class WandbMode(StrEnum):
    auto = "auto"  # online with an API key (WANDB_API_KEY or ~/.netrc), offline without
    online = "online"
    offline = "offline"  # written under <run dir>/wandb; `wandb sync` uploads it later
    disabled = "disabled"


@dataclass
class WandbConfig:
    """The ``wandb`` section: where rank 0 logs in Weights & Biases (metrics.jsonl is written either way)."""

    enabled: bool = True
    """Log to W&B at all."""
    project: str = "zerotrain"
    """W&B project."""
    entity: Optional[str] = None
    """W&B user or team; None: the API key's default."""
    group: Optional[str] = None
    """W&B group, e.g. the variants of one sweep."""
    name: Optional[str] = None
    """The run's display name; None: run.name."""
    tags: list[str] = field(default_factory=list)
    """W&B tags."""
    mode: WandbMode = WandbMode.auto
    """auto | online | offline | disabled."""


def setup_console(rank: int) -> None:
    """Rank 0 prints info; other ranks only warnings, so N processes do not print N copies of everything."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def format_line(step: int, total: int, m: dict[str, Any]) -> str:
    parts = [f"step {step:>6}/{total}", f"loss {m['loss']:.4f}"]
    if "lr" in m:
        parts.append(f"lr {m['lr']:.2e}")
    if "grad_norm" in m:
        parts.append(f"gnorm {m['grad_norm']:.3f}")
    if "step_time_s" in m:
        parts.append(f"{m['step_time_s']:.3f} s/step")
    if "tokens_per_s" in m:
        parts.append(f"{m['tokens_per_s']:,.0f} tok/s ({m['tokens_per_s_per_device']:,.0f}/dev)")
    if "tflops_per_device" in m:
        parts.append(f"{m['tflops_per_device']:.3g} TFLOP/s/dev")
    if m.get("mfu") is not None:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if "time/forward_share" in m:  # zerotrain.step_timing: where the step's time went
        parts.append("fwd {:.0%} bwd {:.0%} opt {:.0%} comm {:.0%}".format(
            *(m[f"time/{p}_share"] for p in ("forward", "backward", "optimizer", "comm_wait"))))
    if "hpz/races" in m:  # hpz.emulate_async: racy shard accesses in the window, all ranks
        parts.append(f"races {m['hpz/races'] + m['hpz/freed_source_races']}")
    mem = m.get("mem/device_max_allocated_gib", m.get("mem/host_rss_gib"))
    if mem is not None:
        parts.append(f"mem {mem:.2f} GiB")
    return " | ".join(parts)


class JsonlMetrics:
    """``metrics.jsonl``: one object per logged step. On resume, lines past the checkpoint's step are dropped so the
    file holds one continuous curve (those steps are about to be recomputed, identically); ``last_logged_step`` is
    the last step the file held before that."""

    def __init__(self, path: Path, resume_step: Optional[int]):
        self.path = path
        self.last_logged_step: Optional[int] = None
        if resume_step is not None and path.exists():
            lines = [line for line in path.read_text().splitlines() if line]
            self.last_logged_step = max((json.loads(line)["step"] for line in lines), default=None)
            kept = [line for line in lines if json.loads(line)["step"] <= resume_step]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(path)
        elif resume_step is None and path.exists():
            path.unlink()  # a fresh run in a reused directory starts a fresh curve

    def write(self, record: dict[str, Any]) -> None:
        # Non-finite losses are written as NaN/Infinity (Python's json reads them back): a diverged run must show.
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def wandb_mode(requested: str) -> str:
    if requested == WandbMode.auto:
        return "online" if _has_wandb_key() else "offline"
    return str(requested)


class WandbMetrics:
    """A thin wrapper: init (or resume) the run, log with our step as the x axis, finish.

    ``run_config`` is the whole resolved run config as plain data, stored as the W&B run's config.
    """

    def __init__(self, section: WandbConfig, run_name: str, run_config: dict[str, Any], run_dir: Path,
                 run_id: Optional[str]):
        import wandb

        mode = wandb_mode(section.mode)
        self.run = wandb.init(
            project=section.project,
            entity=section.entity,
            group=section.group,
            name=section.name or run_name,
            tags=list(section.tags),
            config=run_config,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            mode=cast(Any, mode),  # wandb_mode() gives one of W&B's mode names
        )
        self.run.define_metric(WANDB_STEP_KEY)
        self.run.define_metric("*", step_metric=WANDB_STEP_KEY)
        log.info("W&B run %s (%s mode)", self.run.id, mode)

    @property
    def run_id(self) -> str:
        return self.run.id

    def write(self, record: dict[str, Any]) -> None:
        self.run.log({WANDB_STEP_KEY: record["step"], **{k: v for k, v in record.items() if k != "step"}})

    def log_artifact(self, path: Path, name: str, kind: str) -> None:
        import wandb

        artifact = wandb.Artifact(f"{self.run.id}-{name}", type=kind)
        artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def close(self) -> None:
        self.run.finish()


# In the run directory: the last step any launch logged to the run's W&B run, kept across resumes (metrics.jsonl is
# trimmed on each resume, so after two resumes from one checkpoint it no longer shows how far the first one got).
WANDB_LOGGED_MARK = ".wandb_logged_step"


class MetricsLogger:
    """Fan a record out to the console, the JSONL file and W&B (rank 0 only; other ranks log nothing).

    ``run_name`` is W&B's default display name, ``run_config`` (plain data) the W&B run's config, ``total_steps``
    the denominator of the console's ``step N/total``. Resuming an existing W&B run (``wandb_run_id``), records up
    to the last step already logged to it (``wandb_logged_step``) go to the console and metrics.jsonl only.
    """

    def __init__(self, wandb: WandbConfig, run_dir: Path, is_main: bool, resume_step: Optional[int],
                 wandb_run_id: Optional[str], *, run_name: str, run_config: dict[str, Any], total_steps: int):
        self.is_main = is_main
        self.total_steps = total_steps
        self.jsonl = JsonlMetrics(run_dir / "metrics.jsonl", resume_step) if is_main else None
        enabled = is_main and wandb.enabled and wandb_mode(wandb.mode) != WandbMode.disabled
        self.wandb = WandbMetrics(wandb, run_name, run_config, run_dir, wandb_run_id) if enabled else None
        self.wandb_logged_step = 0
        if is_main:
            assert self.jsonl is not None
            self.wandb_logged_step = _wandb_logged_step(run_dir / WANDB_LOGGED_MARK, resume_step, wandb_run_id,
                                                        self.jsonl.last_logged_step)

    @property
    def wandb_run_id(self) -> Optional[str]:
        return self.wandb.run_id if self.wandb else None

    def log_train(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.is_main:
            return
        log.info(format_line(step, self.total_steps, metrics))
        self._write({"step": step, **metrics})

    def log_event(self, step: int, metrics: dict[str, Any], text: str) -> None:
        if not self.is_main:
            return
        log.info("step %d | %s", step, text)
        self._write({"step": step, **metrics})

    def _write(self, record: dict[str, Any]) -> None:
        assert self.jsonl is not None  # only the main rank writes, and it has the file
        self.jsonl.write(record)
        if self.wandb and record["step"] > self.wandb_logged_step:
            self.wandb.write(record)

    def log_artifact(self, path: Path, name: str, kind: str = "profile") -> None:
        """A file (e.g. a profiler trace) as a W&B artifact of this run, named ``<run id>-<name>`` (rank 0, W&B on;
        nothing otherwise)."""
        if self.wandb:
            self.wandb.log_artifact(path, name, kind)
            log.info("W&B artifact %s-%s (%s): %s", self.wandb.run_id, name, kind, path)

    def close(self) -> None:
        if self.wandb:
            self.wandb.close()


def _wandb_logged_step(mark: Path, resume_step: Optional[int], wandb_run_id: Optional[str],
                       jsonl_last_step: Optional[int]) -> int:
    """The last step the W&B run being resumed already holds (0 for a new W&B run), remembered in ``mark``."""
    if resume_step is None or wandb_run_id is None:
        mark.unlink(missing_ok=True)  # a fresh run, or a new W&B run: nothing logged to it yet
        return 0
    try:
        remembered = int(mark.read_text())
    except (FileNotFoundError, ValueError):
        remembered = 0
    logged = max(remembered, jsonl_last_step or 0)
    if logged > resume_step:
        durable.atomic_write_text(mark, str(logged))
        log.info("W&B run %s already holds steps up to %d: steps %d-%d go to metrics.jsonl only", wandb_run_id,
                 logged, resume_step + 1, logged)
    return logged
