#!/usr/bin/env python
"""The paper's convergence figure on the CPU: plain ZeRO-3 vs hpZ legacy / stock / sync / ordered, under the emulator.

    .venv/bin/python benchmarks/hpz_race_figure.py                  # 5 runs of 200 steps, ~12 min on 2 cores
    .venv/bin/python benchmarks/hpz_race_figure.py --steps 20 --modes zero3,stock --out-dir runs/race_try
    .venv/bin/python benchmarks/hpz_race_figure.py --plot-only      # table and figure again from the runs

On DeepSpeed's CPU accelerator every hpZ mode computes the same thing (the copy that fills a secondary shard has
finished when it returns), so the paper's figure -- racy hpZ diverging from ZeRO-3, the fixed one on top of it --
cannot be drawn without a GPU. Under the emulated asynchronous accelerator (``hpz.emulate_async=true``,
``zerotrain/hpz/async_emulator.py``) the shard copy is deferred on its stream as on a GPU, with the worst-case
scheduling CUDA allows, so the race happens, and every racy read is counted.

Each mode is one ``train.py`` launch (4 CPU ranks = 2 emulated nodes of 2, hpZ 2; the tiny Llama of
``recipe=tiny_llama`` from scratch on the shipped corpus, same seed and data; ``zero.overlap_comm=true`` so that
DeepSpeed gathers on a stream of its own, and prefetch/reuse/persistence 0, so that the backward really reads the
shards). ``train.nan_policy=continue`` keeps a diverging run going, to draw its curve.

Printed (and written to ``--table``, ``<out-dir>/hpz_race_figure.json``): per mode the final loss, the largest
loss difference from ZeRO-3, the optimizer steps DeepSpeed skipped (an invalid gradient norm), and the racy shard
accesses of all ranks with the first step that raced; the curves go to ``--figure`` (``python -m tools.compare``).
What the emulator can and cannot show (ordering, not timing): docs/hpz.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from tools import compare, launcher

REPO = Path(__file__).resolve().parent.parent

MODES = {  # name -> overrides (the rest is common)
    "zero3": ["zero=zero3_cpu"],
    "legacy": ["zero=zero3_hpz_cpu", "hpz.mode=legacy"],
    "stock": ["zero=zero3_hpz_cpu", "hpz.mode=stock"],
    "sync": ["zero=zero3_hpz_cpu", "hpz.mode=sync"],
    "ordered": ["zero=zero3_hpz_cpu", "hpz.mode=ordered"],
}
COMMON = ["recipe=tiny_llama", "hpz.emulate_async=true", "zero.overlap_comm=true", "train.nan_policy=continue",
          "train.log_interval=1", "train.eval_interval=0", "checkpoint.interval=0",
          "checkpoint.save_final=false", "checkpoint.resume=false", "wandb.enabled=false"]


def prepare_corpus(out_dir: Path) -> Path:
    """The shipped corpus, prepared as the tests prepare it (2048-piece tokenizer, 2% validation split)."""
    if not (out_dir / "manifest.json").is_file():
        launcher.run([launcher.PYTHON, "data/prepare.py", "input=data/corpus/shakespeare_milton.txt",
                      f"output={out_dir}", "tokenizer.train_vocab_size=2048", "valid_fraction=0.02",
                      "progress=false"], timeout=900)
    return out_dir


def train(mode: str, out_dir: Path, data: Path, args: argparse.Namespace) -> float:
    started = time.perf_counter()
    launcher.torchrun(4, "train.py", *COMMON, *MODES[mode], f"train.steps={args.steps}",
                      f"train.grad_accum={args.grad_accum}", f"train.seq_len={args.seq_len}",
                      f"run.output_dir={out_dir / 'runs'}", f"run.name={mode}", f"data.train.0.path={data}",
                      timeout=args.timeout)
    return time.perf_counter() - started


def records(run_dir: Path) -> list[dict]:
    rows = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip())
    return [r for r in rows if "loss" in r and "step" in r]


def summarise(mode: str, rows: list[dict], reference: dict[int, float] | None, seconds: float) -> dict:
    last = rows[-1]
    gaps = [abs(r["loss"] - reference[r["step"]]) for r in rows if reference and r["step"] in reference]
    differs = [r["step"] for r in rows if reference and r["step"] in reference and r["loss"] != reference[r["step"]]]
    return {
        "mode": mode,
        "steps": last["step"],
        "final_loss": last["loss"],
        "max_abs_loss_diff_vs_zero3": max(gaps) if gaps else None,
        "first_step_differing_from_zero3": differs[0] if differs else None,
        "nonfinite_losses": sum(not math.isfinite(r["loss"]) for r in rows),
        "skipped_steps": last.get("skipped_steps"),
        "races_all_ranks": last.get("hpz/races_total"),
        "first_race_step": last.get("hpz/first_race_step"),
        "steps_with_races": sum(1 for r in rows if r.get("hpz/races", 0) + r.get("hpz/freed_source_races", 0)),
        "deferred_writes": sum(r.get("hpz/deferred_writes", 0) for r in rows),
        "wall_s": round(seconds, 1),
    }


def table(rows: list[dict]) -> str:
    def cell(key, v):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if key == "max_abs_loss_diff_vs_zero3" and v == 0:
            return "0 (bitwise)"
        if key == "wall_s":
            return f"{v:.0f}"
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    cols = [("mode", "mode"), ("final loss", "final_loss"), ("max \\|Δloss\\| vs zero3", "max_abs_loss_diff_vs_zero3"),
            ("first step ≠ zero3", "first_step_differing_from_zero3"), ("skipped steps", "skipped_steps"),
            ("races (all ranks)", "races_all_ranks"), ("first race step", "first_race_step"),
            ("steps with races", "steps_with_races"), ("shard writes deferred", "deferred_writes"),
            ("wall s", "wall_s")]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(k, r[k]) for _, k in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--out-dir", type=Path, default=REPO / "runs" / "hpz_race_fig")
    p.add_argument("--figure", type=Path, default=None, help="PNG (default <out-dir>/hpz_race_figure.png)")
    p.add_argument("--table", type=Path, default=None, help="Markdown table (default <out-dir>/hpz_race_figure.md)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--plot-only", action="store_true", help="no training: table and figure from the runs there")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        p.error(f"--modes: unknown {unknown or 'empty'}; choose from {','.join(MODES)}")
    figure = args.figure or args.out_dir / "hpz_race_figure.png"
    table_path = args.table or args.out_dir / "hpz_race_figure.md"
    args.out_dir.mkdir(parents=True, exist_ok=True)

    timing = args.out_dir / "wall_s.json"  # per mode, kept for --plot-only
    seconds = json.loads(timing.read_text()) if timing.is_file() else {}
    if not args.plot_only:
        data = prepare_corpus(args.out_dir / "data")
        for mode in modes:
            print(f"[hpz_race_figure] {mode}: {args.steps} steps under the emulator ...", flush=True)
            seconds[mode] = train(mode, args.out_dir, data, args)
            timing.write_text(json.dumps(seconds))

    runs = {m: records(args.out_dir / "runs" / m) for m in modes}
    reference = {r["step"]: r["loss"] for r in runs["zero3"]} if "zero3" in runs else None
    summary = [summarise(m, runs[m], None if m == "zero3" else reference, seconds.get(m, math.nan)) for m in modes]
    text = table(summary)
    print(text)
    table_path.parent.mkdir(parents=True, exist_ok=True)
    steps = runs[modes[0]][-1]["step"]
    note = (f"\n\n{steps} steps, tiny Llama, 4 CPU ranks (hpZ 2), gradient accumulation {args.grad_accum}, "
            f"seq_len {args.seq_len}, under hpz.emulate_async=true (benchmarks/hpz_race_figure.py). Races: racy "
            f"shard accesses summed over ranks (hpz/races_total); skipped steps: DeepSpeed's skipped_steps; wall s: "
            f"the whole launch on a shared CPU under the emulator (no hpZ speed measurement).\n")
    table_path.write_text(text + note)
    (args.out_dir / "hpz_race_figure.json").write_text(json.dumps(summary, indent=1))
    status = compare.main([*(f"{m}={args.out_dir / 'runs' / m}" for m in modes), "--baseline", modes[0], "-o",
                           str(figure), "--title", "hpZ under the emulated asynchronous accelerator (CPU)"])
    print(f"table: {table_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
