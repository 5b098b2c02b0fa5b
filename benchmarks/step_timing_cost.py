"""What the step-time breakdown (zerotrain.step_timing) costs a step of the tiny recipe. Prints a Markdown table.

Two measurements, on one Trainer (tiny Llama, ZeRO-3 + hpZ 2 on 4 CPU processes by default):

* end to end: blocks of steps with the breakdown on and off (its hooks uninstalled, a do-nothing timer in its
  place), interleaved so that drift of a shared machine hits both alike (default: one step each, 40 blocks); the
  median step of each (wall time, and rank 0's CPU time, which other jobs on the machine disturb less), and the
  median over neighbouring (on, off) pairs of on/off - 1. On a shared machine these move by several per cent
  from run to run either way;
* by count: the clock readings the breakdown makes per step (spans recorded, each two readings) times what one
  costs, measured in a tight loop: the floor under the noise of the first.

    .venv/bin/python benchmarks/step_timing_cost.py [--nproc 4] [--blocks 40] [--block-steps 1] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tools import launcher
from tools.launcher import PYTHON

TIMEOUT_S = 3600


def span_cost_s(n: int = 20000) -> float:
    """Seconds one recorded span costs: entering and leaving a phase (two clock readings, one append, the trace
    range check) measured over ``n`` empty phases, a read() of them included."""
    from zerotrain.step_timing import StepTimes

    times = StepTimes("cpu")
    started = time.perf_counter()
    with times.step():
        for _ in range(n):
            with times.phase("forward"):
                pass
    times.read()
    return (time.perf_counter() - started) / (n + 1)


def worker(out: Path, overrides: list[str], blocks: int, block_steps: int, off_first: bool) -> int:
    import torch.distributed as dist

    from zerotrain import step_timing
    from zerotrain.run_config import parse_args
    from zerotrain.trainer import Trainer

    trainer = Trainer(parse_args(overrides))
    timer_on = trainer.step_times
    step, rows = 0, []
    for _ in range(2):  # warm-up: the first steps build the hpZ shards, the optimizer state, the comm op
        step += 1
        trainer._train_step(step)
    spans_per_step = []
    for block in range(blocks):
        on = block % 2 == (1 if off_first else 0)
        if on:
            step_timing.install(timer_on)
            trainer.step_times = timer_on
        else:
            step_timing.uninstall()
            trainer.step_times = step_timing.NullStepTimes()
        dist.barrier()
        for _ in range(block_steps):
            step += 1
            started, cpu = time.perf_counter(), time.process_time()
            trainer._train_step(step)
            rows.append({"on": on, "block": block, "seconds": time.perf_counter() - started,
                         "cpu_seconds": time.process_time() - cpu})
            if on:
                spans_per_step.append(len(timer_on._spans))
                timer_on.read()
    if trainer.dist.is_main:
        out.write_text(json.dumps({"rows": rows, "spans_per_step": spans_per_step, "span_cost_s": span_cost_s()}))
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=40, help="alternating blocks, on first")
    parser.add_argument("--block-steps", type=int, default=1)
    parser.add_argument("--off-first", action="store_true", help="start with an 'off' block (order bias check)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="run config overrides (after the tiny recipe's)")
    args = parser.parse_args()
    if args.worker:
        sys.exit(worker(Path(args.worker), args.overrides, args.blocks, args.block_steps, args.off_first))

    work = Path(tempfile.mkdtemp(prefix="zerotrain-bench-"))
    data = work / "data"
    launcher.run([PYTHON, "data/prepare.py", "input=data/corpus/shakespeare_milton.txt", f"output={data}",
                  "tokenizer.train_vocab_size=2048", "valid_fraction=0.02", "progress=false"], timeout=TIMEOUT_S)
    result = work / "result.json"
    launcher.torchrun(args.nproc, "benchmarks/step_timing_cost.py", f"--worker={result}", f"--blocks={args.blocks}",
                      f"--block-steps={args.block_steps}", *(["--off-first"] if args.off_first else []),
                      "recipe=tiny_llama", "train.steps=1000",
                      "wandb.enabled=false", "checkpoint.interval=0", "checkpoint.save_final=false",
                      "train.eval_interval=0", f"run.output_dir={work}", "run.name=bench", f"data.train.0.path={data}",
                      *args.overrides, timeout=TIMEOUT_S)
    r = json.loads(result.read_text())
    on = statistics.median(row["seconds"] for row in r["rows"] if row["on"])
    off = statistics.median(row["seconds"] for row in r["rows"] if not row["on"])
    cpu_on = statistics.median(row["cpu_seconds"] for row in r["rows"] if row["on"])
    cpu_off = statistics.median(row["cpu_seconds"] for row in r["rows"] if not row["on"])
    block_mean = {b: statistics.mean(row["seconds"] for row in r["rows"] if row["block"] == b)
                  for b in range(args.blocks)}
    on_blocks = [b for b in range(args.blocks) if any(row["block"] == b and row["on"] for row in r["rows"])]
    paired = statistics.median(block_mean[b] / block_mean[b + 1] - 1 if b + 1 in block_mean else
                               block_mean[b] / block_mean[b - 1] - 1 for b in on_blocks)
    spans = statistics.mean(r["spans_per_step"])
    by_count = spans * r["span_cost_s"] / off
    print(f"tiny_llama, {args.nproc} CPU ranks, {args.blocks} alternating blocks of {args.block_steps} steps\n")
    print("| measure | breakdown on | breakdown off | cost |")
    print("|---|---|---|---|")
    print(f"| median step, end to end | {on * 1e3:.1f} ms | {off * 1e3:.1f} ms | {100 * (on / off - 1):+.2f}% |")
    print(f"| median CPU time of rank 0's process | {cpu_on * 1e3:.1f} ms | {cpu_off * 1e3:.1f} ms | "
          f"{100 * (cpu_on / cpu_off - 1):+.2f}% |")
    print(f"| median of {args.blocks // 2} neighbouring (on, off) pairs | | | {100 * paired:+.2f}% |")
    print(f"| by count: {spans:.0f} spans/step x {r['span_cost_s'] * 1e6:.2f} us | | | {100 * by_count:.4f}% |")


if __name__ == "__main__":
    main()
