"""Compare training runs: loss curves, throughput, a summary table, and a loss-parity check.

Runs come from

* local run directories (``<run.output_dir>/<run.name>``): their ``metrics.jsonl``, which the trainer always writes
  (beside the W&B run, online or offline);
* a W&B group, online, through the public API (``wandb.Api().runs(...)``, ``run.scan_history()``): runs that live
  only on the server;
* a local group: every run directory under ``--runs-root`` whose ``config.yaml`` names the W&B group.

W&B's binary transaction logs (``wandb/*run-*/run-*.wandb``) are not read: ``metrics.jsonl`` holds the same rows,
and ``wandb sync`` + the API covers a run whose directory is gone.

Whatever the source, rows go through one conversion, :func:`run_from_rows`: a row is a training record when it has
``loss``, a validation record when it has ``val/loss``; the step is ``step`` (metrics.jsonl) or
:data:`zerotrain.loggers.WANDB_STEP_KEY` (W&B), and a step logged twice (a run resumed from a checkpoint older than
its last logged step re-logs those steps in W&B) keeps its *last* value. Non-finite losses (``NaN``, ``Infinity``)
are kept: a diverged run is drawn up to the divergence and marked there.

Usage (``zerotrain-compare`` is the same command, installed by ``pip install -e .``)::

    python -m tools.compare runs/a runs/b [zero3=runs/c] [--baseline zero3] [-o compare.png] [--table t.md]
    python -m tools.compare --group paper-llama2-7b --project zerotrain-paper [--entity E]   # W&B online
    python -m tools.compare --group paper-llama2-7b --runs-root runs                         # local
    python -m tools.compare --assert-equal runs/a runs/b [--atol 1e-6] [--common-steps-only]

Exit status: 0 fine (runs equal with ``--assert-equal``), 1 the runs differ, 2 bad input (missing run directory,
empty metrics, unknown baseline, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from zerotrain.loggers import WANDB_STEP_KEY

log = logging.getLogger("tools.compare")

LOSS = "loss"
VAL_LOSS = "val/loss"
# The step of a row: ours first (metrics.jsonl), then our W&B step metric, then W&B's own row counter.
STEP_KEYS = ("step", WANDB_STEP_KEY)
WANDB_ROW_STEP = "_step"


class CompareError(Exception):
    """Bad input the user can fix (missing run, empty metrics, unknown baseline): exit status 2."""


# --------------------------------------------------------------------------------------------------------------
# The run model and the one conversion every source goes through
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    source: str
    records: list[dict[str, Any]]  # training records, one per step, sorted by step; each has 'step' and 'loss'
    val: list[tuple[int, float]] = field(default_factory=list)  # (step, val/loss), sorted
    replaced: int = 0  # training rows superseded by a later row for the same step (a resumed run)
    group: Optional[str] = None

    @property
    def steps(self) -> list[int]:
        return [r["step"] for r in self.records]

    @property
    def losses(self) -> list[float]:
        return [r[LOSS] for r in self.records]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the training records that have a numeric ``key``."""
        pairs = [(r["step"], r[key]) for r in self.records if isinstance(r.get(key), float)]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def first_bad(self) -> Optional[tuple[int, str]]:
        """The first step whose loss is NaN, infinite or exactly zero (hpZ's failure shows as either), and which."""
        for r in self.records:
            loss = r[LOSS]
            if math.isnan(loss):
                return r["step"], "NaN"
            if math.isinf(loss):
                return r["step"], "inf"
            if loss == 0.0:
                return r["step"], "zero"
        return None

    def elapsed(self) -> Optional[list[float]]:
        """Seconds of training up to each record: the sum of ``step_time_s`` x steps in each logged window (the
        trainer logs the mean step time of the window). This is time spent in training steps only: start-up,
        validation, checkpoints and requeue gaps are left out, so runs compare fairly. Without ``step_time_s``,
        the W&B wall-clock timestamps (``_timestamp``) relative to the first row; None without either."""
        if all(isinstance(r.get("step_time_s"), float) for r in self.records):
            out, total, previous = [], 0.0, 0
            for r in self.records:
                total += r["step_time_s"] * max(r["step"] - previous, 1)
                previous = r["step"]
                out.append(total)
            return out
        if all(isinstance(r.get("_timestamp"), float) for r in self.records):
            start = self.records[0]["_timestamp"]
            return [r["_timestamp"] - start for r in self.records]
        return None


def _number(value: Any) -> Any:
    """JSON value -> float where it is a number (also W&B's 'NaN'/'Infinity' strings); other values unchanged."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("nan", "infinity", "+infinity", "-infinity", "inf",
                                                            "-inf", "+inf"):
        return float(value.strip().lower().replace("infinity", "inf"))
    return value


def _row_step(row: dict[str, Any]) -> Optional[int]:
    for key in STEP_KEYS:
        value = row.get(key)
        if value is not None:
            return int(value)
    value = row.get(WANDB_ROW_STEP)  # a W&B run logged without our step metric
    return int(value) if value is not None else None


def run_from_rows(name: str, rows: Iterable[dict[str, Any]], source: str, group: Optional[str] = None) -> Run:
    """Rows of logged values (metrics.jsonl lines, W&B history rows from the API) -> a :class:`Run`.

    A row with ``loss`` is a training record, one with ``val/loss`` a validation record; other rows are ignored.
    A later row for the same step replaces the earlier one entirely (last value wins: a resumed run)."""
    train: dict[int, dict[str, Any]] = {}
    val: dict[int, float] = {}
    replaced = 0
    for row in rows:
        step = _row_step(row)
        if step is None:
            continue
        loss = _number(row.get(LOSS))
        if isinstance(loss, float):
            record = {k: _number(v) for k, v in row.items() if k not in STEP_KEYS}
            record["step"] = step
            if step in train:
                replaced += 1
            train[step] = record
        val_loss = _number(row.get(VAL_LOSS))
        if isinstance(val_loss, float):
            val[step] = val_loss
    if not train:
        raise CompareError(f"{source}: no training records (rows with a '{LOSS}' value) in {name!r}: "
                           "the run has not logged a training step yet")
    records = [train[s] for s in sorted(train)]
    return Run(name=name, source=source, records=records, val=sorted(val.items()), replaced=replaced, group=group)


# --------------------------------------------------------------------------------------------------------------
# Sources: metrics.jsonl (local run directories), W&B online (the public API)
# --------------------------------------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl. A malformed last line (a run killed while writing it) is skipped with a
    warning; a malformed line elsewhere is an error naming the line."""
    lines = path.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                log.warning("%s:%d: incomplete last line skipped (%s)", path, number, e)
                continue
            raise CompareError(f"{path}:{number}: not a JSON object: {e}") from None
        if not isinstance(row, dict):
            raise CompareError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    if not rows:
        raise CompareError(f"{path} is empty: the run has not logged a step yet (it logs every train.log_interval "
                           "steps)")
    return rows


def _saved_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _wandb_only(what: Path) -> CompareError:
    return CompareError(f"{what}: W&B's binary run files are not read; compare reads the run directory's "
                        "metrics.jsonl, which the trainer writes beside every W&B run. For a run that lives only on "
                        "the W&B server use --group GROUP --project PROJECT [--entity ENTITY] (wandb.Api)")


def load_run_dir(path: str | Path, name: Optional[str] = None) -> Run:
    """A run from a run directory (or a metrics.jsonl given directly)."""
    path = Path(path)
    if not path.exists():
        raise CompareError(f"run directory {path} does not exist (a run directory is <run.output_dir>/<run.name>, "
                           "e.g. runs/tiny-llama)")
    if path.is_file():
        if path.suffix == ".wandb":
            raise _wandb_only(path)
        return run_from_rows(name or (path.parent.name if path.suffix == ".jsonl" else path.stem), read_jsonl(path),
                             str(path))
    jsonl = path / "metrics.jsonl"
    if not jsonl.is_file():
        if any(path.glob("wandb/*run-*/run-*.wandb")):
            raise _wandb_only(path)
        raise CompareError(f"{path}: no metrics.jsonl. Is it a run directory (<run.output_dir>/<run.name>)?")
    run = run_from_rows(name or path.name, read_jsonl(jsonl), str(jsonl))
    run.group = (_saved_config(path).get("wandb") or {}).get("group")
    return run


def find_local_group(root: str | Path, group: str) -> list[Run]:
    """Every run directory directly under ``root`` whose saved config.yaml names W&B group ``group``."""
    root = Path(root)
    if not root.is_dir():
        raise CompareError(f"--runs-root {root}: no such directory")
    runs = [load_run_dir(run_dir) for run_dir in sorted(p for p in root.iterdir() if p.is_dir())
            if (_saved_config(run_dir).get("wandb") or {}).get("group") == group]
    if not runs:
        raise CompareError(f"no run directory under {root} has a config.yaml naming W&B group {group!r} (the trainer "
                           "saves config.yaml in every run directory)")
    return runs


def load_wandb_group(project: str, group: str, entity: Optional[str] = None, api: Any = None) -> list[Run]:
    """Every run of a W&B group, online (needs an API key). ``api`` defaults to ``wandb.Api()``; the tests pass a
    stand-in with the same ``runs(path, filters=...)`` / ``scan_history()`` surface."""
    if api is None:
        import wandb

        api = wandb.Api(timeout=60)
    path = f"{entity}/{project}" if entity else project
    runs = []
    for remote in api.runs(path, filters={"group": group}):
        rows = remote.scan_history(page_size=1000)
        try:
            runs.append(run_from_rows(remote.name, rows, source=getattr(remote, "url", path), group=group))
        except CompareError as e:
            log.warning("skipping W&B run %s: %s", remote.name, e)
    if not runs:
        raise CompareError(f"no W&B runs with logged training steps in {path}, group {group!r}")
    return sorted(runs, key=lambda r: r.name)


# --------------------------------------------------------------------------------------------------------------
# Summary table
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Summary:
    name: str
    logged: int  # training records after de-duplication
    last_step: int
    final_loss: float
    first_bad: Optional[tuple[int, str]]
    tokens_per_s: Optional[float]
    mfu: Optional[float]
    train_time_s: Optional[float]
    relative: Optional[float] = None  # tokens_per_s / the baseline's
    replaced: int = 0
    last_val_loss: Optional[float] = None


def _throughput_windows(run: Run) -> list[dict[str, Any]]:
    """Logged windows used for throughput: all but the first (start-up: first all-gathers, allocator warm-up)."""
    windows = [r for r in run.records if isinstance(r.get("tokens_per_s"), float)]
    return windows[1:] if len(windows) > 1 else windows


def mean_throughput(run: Run) -> Optional[float]:
    """Tokens per second over the run, the first logged window left out: total tokens / total time of the windows
    when step times are logged (time-weighted), else the mean of the logged rates."""
    windows = _throughput_windows(run)
    if not windows:
        return None
    previous = {r["step"]: p["step"] for p, r in zip(run.records, run.records[1:])}
    if all(isinstance(r.get("step_time_s"), float) for r in windows):
        durations = [r["step_time_s"] * max(r["step"] - previous.get(r["step"], 0), 1) for r in windows]
        total = sum(durations)
        if total > 0:
            return sum(r["tokens_per_s"] * d for r, d in zip(windows, durations)) / total
    return sum(r["tokens_per_s"] for r in windows) / len(windows)


def mean_mfu(run: Run) -> Optional[float]:
    values = [r["mfu"] for r in _throughput_windows(run) if isinstance(r.get("mfu"), float)]
    if not values:
        values = [r["mfu"] for r in run.records if isinstance(r.get("mfu"), float)]
    return sum(values) / len(values) if values else None


def pick_baseline(runs: Sequence[Run], baseline: Optional[str]) -> Run:
    """The run named ``baseline`` exactly, else the one run whose name ends with it (``hpz-stock`` finds
    ``paper-llama2-7b-hpz-stock``); the first run when None."""
    if baseline is None:
        return runs[0]
    exact = [r for r in runs if r.name == baseline]
    if exact:
        return exact[0]
    suffix = [r for r in runs if r.name.endswith(baseline)]
    if len(suffix) == 1:
        return suffix[0]
    names = ", ".join(r.name for r in runs)
    if suffix:
        raise CompareError(f"--baseline {baseline}: ambiguous, matches {', '.join(r.name for r in suffix)}")
    raise CompareError(f"--baseline {baseline}: no such run. Runs: {names}")


def summarize(runs: Sequence[Run], baseline: Optional[str] = None) -> list[Summary]:
    base = pick_baseline(runs, baseline)
    base_tps = mean_throughput(base)
    out = []
    for run in runs:
        tps = mean_throughput(run)
        elapsed = run.elapsed()
        out.append(Summary(
            name=run.name,
            logged=len(run.records),
            last_step=run.records[-1]["step"],
            final_loss=run.records[-1][LOSS],
            first_bad=run.first_bad(),
            tokens_per_s=tps,
            mfu=mean_mfu(run),
            train_time_s=elapsed[-1] if elapsed else None,
            relative=tps / base_tps if tps is not None and base_tps else None,
            replaced=run.replaced,
            last_val_loss=run.val[-1][1] if run.val else None,
        ))
    return out


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _loss(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if math.isfinite(value) else str(value)


def summary_markdown(summaries: Sequence[Summary], baseline_name: str) -> str:
    header = ["run", "steps", "final loss", "last val loss", "first NaN/0 loss", "tokens/s",
              f"vs {baseline_name}", "MFU", "train time"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for s in summaries:
        steps = f"{s.last_step}" + (f" ({s.logged} logged)" if s.logged != s.last_step else "")
        bad = f"{s.first_bad[0]} ({s.first_bad[1]})" if s.first_bad else "-"
        cells = [
            s.name, steps, _loss(s.final_loss), _loss(s.last_val_loss), bad,
            f"{s.tokens_per_s:,.0f}" if s.tokens_per_s is not None else "-",
            f"{100 * s.relative:.1f}%" if s.relative is not None else "-",
            f"{100 * s.mfu:.1f}%" if s.mfu is not None else "-",
            _duration(s.train_time_s),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = ["tokens/s: time-weighted mean over the logged windows, the first (start-up) window left out. "
             "train time: sum of logged step times (no start-up, validation, checkpoints or queue time)."]
    resumed = [s.name for s in summaries if s.replaced]
    if resumed:
        notes.append("resumed (re-logged steps replaced by their last value): " + ", ".join(
            f"{s.name} ({s.replaced} row(s))" for s in summaries if s.replaced))
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


# --------------------------------------------------------------------------------------------------------------
# Figure
# --------------------------------------------------------------------------------------------------------------

PANEL_LOSS_STEP = "loss vs step"
PANEL_LOSS_TIME = "loss vs training time"
PANEL_TOKENS = "throughput (tokens/s)"
PANEL_MFU = "MFU"


def _finite_prefix(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    """Points up to (not including) the first non-finite y: a diverged run is drawn up to its divergence."""
    out_x, out_y = [], []
    for x, y in zip(xs, ys):
        if not math.isfinite(y):
            break
        out_x.append(x)
        out_y.append(y)
    return out_x, out_y


def plot_runs(runs: Sequence[Run], path: Optional[str | Path] = None, title: Optional[str] = None):
    """One figure: loss vs step, loss vs training time, tokens/s and MFU (a panel only where some run has data).
    A run whose loss turns NaN/inf/zero is marked (x) at that step. Returns the matplotlib Figure; writes a PNG to
    ``path`` when given. Uses the Agg canvas directly (no pyplot state, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [PANEL_LOSS_STEP]
    if any(r.elapsed() for r in runs):
        panels.append(PANEL_LOSS_TIME)
    if any(r.series("tokens_per_s")[0] for r in runs):
        panels.append(PANEL_TOKENS)
    if any(r.series("mfu")[0] for r in runs):
        panels.append(PANEL_MFU)
    ncols = 2 if len(panels) > 1 else 1
    nrows = (len(panels) + 1) // 2
    fig = Figure(figsize=(7 * ncols, 4.5 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = {name: fig.add_subplot(nrows, ncols, i + 1) for i, name in enumerate(panels)}
    colors = [f"C{i % 10}" for i in range(len(runs))]
    longest = max((e[-1] for e in (r.elapsed() for r in runs) if e), default=0.0)
    unit, per_unit = ("h", 3600.0) if longest >= 7200 else ("min", 60.0) if longest >= 120 else ("s", 1.0)

    for run, color in zip(runs, colors):
        bad = run.first_bad()
        label = run.name + (f" ({'loss 0' if bad[1] == 'zero' else bad[1]} at step {bad[0]})" if bad else "")
        steps, losses = run.steps, run.losses
        elapsed = run.elapsed()
        curves = [(axes[PANEL_LOSS_STEP], steps)]
        if elapsed and PANEL_LOSS_TIME in axes:
            curves.append((axes[PANEL_LOSS_TIME], [t / per_unit for t in elapsed]))
        for ax, xs in curves:
            px, py = _finite_prefix(xs, losses)
            ax.plot(px, py, color=color, label=label, linewidth=1.2)
            if bad:
                index = steps.index(bad[0])
                if bad[1] == "zero":
                    mark_x, mark_y = xs[index], 0.0
                elif py:  # NaN/inf: at the last finite value
                    mark_x, mark_y = px[-1], py[-1]
                else:
                    mark_x, mark_y = xs[index], None
                if mark_y is not None:
                    ax.plot([mark_x], [mark_y], marker="x", markersize=10, markeredgewidth=2, color=color,
                            linestyle="none")
                    ax.annotate(f"{bad[1]} @ {bad[0]}", (mark_x, mark_y), textcoords="offset points",
                                xytext=(4, 6), color=color, fontsize=8)
                else:
                    ax.axvline(mark_x, color=color, linestyle=":", linewidth=1)
        if run.val:
            vx, vy = _finite_prefix([s for s, _ in run.val], [v for _, v in run.val])
            axes[PANEL_LOSS_STEP].plot(vx, vy, color=color, linestyle="--", marker="o", markersize=3,
                                       linewidth=0.8, label=f"{run.name} (validation)")
        for panel, key, scale in ((PANEL_TOKENS, "tokens_per_s", 1.0), (PANEL_MFU, "mfu", 100.0)):
            xs, ys = run.series(key)
            if panel in axes and xs:
                axes[panel].plot(xs, [y * scale for y in ys], color=color, label=run.name, linewidth=1.0)

    labels = {PANEL_LOSS_STEP: ("step", "loss"),
              PANEL_LOSS_TIME: (f"training time ({unit}, sum of step times)", "loss"),
              PANEL_TOKENS: ("step", "tokens/s (all devices)"), PANEL_MFU: ("step", "MFU (%)")}
    for name, ax in axes.items():
        ax.set_title(name)
        ax.set_xlabel(labels[name][0])
        ax.set_ylabel(labels[name][1])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


# --------------------------------------------------------------------------------------------------------------
# Parity check
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Parity:
    ok: bool
    message: str
    first_step: Optional[int] = None  # the first step whose values differ, if any


def _same(a: float, b: float, atol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)  # the same divergence at the same step counts as equal
    if math.isinf(a) or math.isinf(b):
        return a == b
    return a == b if atol == 0 else abs(a - b) <= atol


def check_parity(a: Run, b: Run, key: str = LOSS, atol: float = 0.0, common_steps_only: bool = False) -> Parity:
    """Do two runs log the same ``key`` on the same steps? Exact by default (``atol=0``: bitwise-equal floats);
    NaN equals NaN at the same step. Without ``common_steps_only`` differing step sets fail too."""
    va, vb = dict(zip(*a.series(key))), dict(zip(*b.series(key)))
    if not va or not vb:
        empty = a.name if not va else b.name
        return Parity(False, f"{empty} logged no '{key}' values")
    common = sorted(set(va) & set(vb))
    problems = []
    first = None
    if not common:
        problems.append(f"no common steps ({a.name}: {_span(va)}; {b.name}: {_span(vb)})")
    for step in common:
        if not _same(va[step], vb[step], atol):
            first = step
            diff = abs(va[step] - vb[step])
            problems.append(f"{key} differs first at step {step}: {a.name}={va[step]!r} {b.name}={vb[step]!r} "
                            f"(|difference| {diff!r} > atol {atol!r})")
            break
    only_a, only_b = sorted(set(va) - set(vb)), sorted(set(vb) - set(va))
    if (only_a or only_b) and not common_steps_only:
        detail = "; ".join(f"only in {run.name}: {_list(steps)}" for run, steps in ((a, only_a), (b, only_b))
                           if steps)
        problems.append(f"the logged steps differ ({detail}); --common-steps-only compares the common "
                        f"{len(common)} step(s) only")
    if problems:
        return Parity(False, "; ".join(problems), first)
    tolerance = "bitwise equal" if atol == 0 else f"equal within atol {atol!r}"
    return Parity(True, f"{key} of {a.name} and {b.name}: {tolerance} on {len(common)} common step(s) "
                        f"({common[0]}..{common[-1]})")


def _span(values: dict[int, float]) -> str:
    return f"steps {min(values)}..{max(values)}"


def _list(steps: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, steps[:limit]))
    return f"{shown}{', ...' if len(steps) > limit else ''} ({len(steps)} step(s))"


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Compare training runs (loss curves, throughput, summary table) or check loss parity.",
        epilog="Examples:\n"
               "  %(prog)s runs/paper-x-zero3 runs/paper-x-hpz-stock --baseline zero3 -o cmp.png\n"
               "  %(prog)s --group paper-x --project zerotrain-paper --baseline hpz-stock   (W&B online)\n"
               "  %(prog)s --group paper-x --runs-root runs                                 (local)\n"
               "  %(prog)s --assert-equal runs/a runs/b [--atol 1e-6] [--common-steps-only]\n"
               "Exit status: 0 ok, 1 runs differ (--assert-equal), 2 bad input.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="*", metavar="RUN",
                   help="run directory (<run.output_dir>/<run.name>) or its metrics.jsonl; NAME=PATH names it")
    p.add_argument("--group", help="a W&B group: online (--project/--entity) or, with --runs-root, local")
    p.add_argument("--project", default=None, help="W&B project for --group (default: $WANDB_PROJECT or zerotrain)")
    p.add_argument("--entity", default=None, help="W&B entity for --group (default: your default entity)")
    p.add_argument("--runs-root", default=None, help="with --group: find the group's run directories under DIR")
    p.add_argument("-o", "--out", default=None, help="PNG to write (default compare.png; none with --assert-equal "
                                                     "unless given)")
    p.add_argument("--table", default=None, help="also write the Markdown summary to this file")
    p.add_argument("--baseline", default=None, help="run the throughput column is relative to (exact name or "
                                                    "unique suffix; default: the first run)")
    p.add_argument("--title", default=None, help="figure title")
    p.add_argument("--assert-equal", action="store_true",
                   help="exit 1 unless every run's values equal the first run's on their steps")
    p.add_argument("--key", default=LOSS, help="the training-record value --assert-equal compares (default: loss; "
                                             "e.g. grad_norm)")
    p.add_argument("--atol", type=float, default=0.0, help="--assert-equal tolerance (default 0: exact)")
    p.add_argument("--common-steps-only", action="store_true",
                   help="--assert-equal: compare the common steps only (runs of different lengths)")
    return p


def _parse_run_arg(arg: str) -> tuple[Optional[str], str]:
    name, sep, path = arg.partition("=")
    if sep and name and "/" not in name and not Path(arg).exists():
        return name, path
    return None, arg


def load_runs(args: argparse.Namespace) -> list[Run]:
    runs: list[Run] = []
    for arg in args.runs:
        name, path = _parse_run_arg(arg)
        runs.append(load_run_dir(path, name=name))
    if args.group:
        if args.runs_root:
            runs.extend(find_local_group(args.runs_root, args.group))
        else:
            project = args.project or os.environ.get("WANDB_PROJECT") or "zerotrain"
            runs.extend(load_wandb_group(project, args.group, entity=args.entity))
    elif args.runs_root:
        raise CompareError("--runs-root needs --group")
    if not runs:
        raise CompareError("no runs given: name run directories, or --group (with --project, or --runs-root)")
    names = [r.name for r in runs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise CompareError(f"several runs are named {', '.join(duplicates)}: name them with NAME=PATH")
    return runs


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    args = build_parser(prog).parse_args(argv)
    try:
        runs = load_runs(args)
        if args.assert_equal:
            if len(runs) < 2:
                raise CompareError("--assert-equal needs two runs (or more: each is checked against the first)")
            status = 0
            for other in runs[1:]:
                parity = check_parity(runs[0], other, key=args.key, atol=args.atol,
                                      common_steps_only=args.common_steps_only)
                print(("OK: " if parity.ok else "DIFFERENT: ") + parity.message)
                status = status or (0 if parity.ok else 1)
            if args.out:
                plot_runs(runs, args.out, title=args.title)
            return status
        baseline = pick_baseline(runs, args.baseline)
        table = summary_markdown(summarize(runs, baseline.name), baseline.name)
        print(table, end="")
        if args.table:
            Path(args.table).write_text(table)
        out = args.out or "compare.png"
        plot_runs(runs, out, title=args.title or args.group)
        print(f"figure: {out}")
        return 0
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(prog="python -m tools.compare"))
