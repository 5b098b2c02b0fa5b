"""Throughput of our training loop next to a plain Hugging Face ``Trainer``, and of data preparation.

Same model (tiny Llama), same data (the shipped corpus), same batch and the same DeepSpeed config (ZeRO-3 + hpZ 2
on 4 CPU processes by default). Ours runs twice: as configured (``train.param_fetch=layer``, a decoder layer per
ZeRO-3 fetch) and with ``train.param_fetch=module`` (DeepSpeed's per-submodule fetch, what the HF Trainer gets), so
the table separates what the loop saves from what the fetch unit saves. Prints a Markdown table.

    .venv/bin/python benchmarks/train_throughput.py [--steps 30] [--nproc 4] [--recipe tiny_llama] [--hpz 2]
        [key=value ...]     # overrides of the recipe, e.g. the 4M-parameter Llama of benchmarks/slow_link.py:
                            # model.hidden_size=256 model.num_layers=4 model.intermediate_size=704

The Hugging Face run reads our run's config.yaml and deepspeed_config.json, so overrides apply to both.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tools import launcher
from tools.launcher import PYTHON, LaunchError

NO_WANDB = {"WANDB_MODE": "disabled"}  # neither loop logs to W&B: nothing to time but the training
TIMEOUT_S = 3600


def prepare(out: Path) -> dict:
    started = time.perf_counter()
    launcher.run([PYTHON, "data/prepare.py", "input=data/corpus/shakespeare_milton.txt", f"output={out}",
                  "tokenizer.train_vocab_size=2048", "valid_fraction=0.02", "progress=false"], timeout=TIMEOUT_S)
    elapsed = time.perf_counter() - started
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = sum(split["num_tokens"] for split in manifest["splits"].values())
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def torchrun(nproc: int, script: str, *args: str) -> None:
    launcher.torchrun(nproc, script, *args, env=NO_WANDB, timeout=TIMEOUT_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--recipe", default="tiny_llama")
    parser.add_argument("--hpz", type=int, default=2)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, for both loops")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="zerotrain-bench-"))
    data = prepare(work / "data")

    def ours(name: str, *extra: str) -> tuple[float, float]:
        """(step time, tokens/s) of a train.py run, steady state (the first window includes start-up work)."""
        torchrun(args.nproc, "train.py", f"recipe={args.recipe}", f"train.steps={args.steps}", "train.log_interval=5",
                 "train.eval_interval=0", "checkpoint.save_final=false", "wandb.enabled=false",
                 f"zero.zero_hpz_partition_size={args.hpz}", f"run.output_dir={work}", f"run.name={name}",
                 f"data.train.0.path={work / 'data'}", *args.overrides, *extra)
        records = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
        steady = [r for r in records if "tokens_per_s" in r][1:]
        return (sum(r["step_time_s"] for r in steady) / len(steady),
                sum(r["tokens_per_s"] for r in steady) / len(steady))

    # Ours as configured (train.param_fetch=layer unless overridden), then with DeepSpeed's per-module fetch, the
    # unit the HF Trainer gathers by: the loop alone against the loop plus the fetch unit.
    ours_step, ours_tps = ours("ours")
    module_step, module_tps = ours("ours-module-fetch", "train.param_fetch=module")
    torchrun(args.nproc, "benchmarks/hf_trainer_baseline.py", str(work / "ours"), str(args.steps),
             str(work / "hf.json"))
    hf = json.loads((work / "hf.json").read_text())
    if hf["torch_world"] != args.nproc:
        sys.exit(f"the HF Trainer ran on {hf['torch_world']} ranks, not {args.nproc}: not comparable")

    title = " ".join([args.recipe, *args.overrides])
    print(f"\n{title}, {args.nproc} CPU processes, ZeRO-3 hpZ {args.hpz}, {args.steps} steps "
          f"(steady state, first window excluded)\n")
    print("| loop | step time (s) | tokens/s | tokens/s per process | HF Trainer's step time / this |")
    print("|---|---|---|---|---|")
    rows = [("zerotrain train.py", ours_step, ours_tps),
            ("zerotrain train.py, train.param_fetch=module (DeepSpeed's unit)", module_step, module_tps),
            ("HF Trainer (same DeepSpeed config)", hf["step_time_s"], hf["tokens_per_s"])]
    for name, step, tps in rows:
        print(f"| {name} | {step:.3f} | {tps:,.0f} | {tps / args.nproc:,.0f} | {hf['step_time_s'] / step:.2f}x |")
    print(f"\ndata/prepare.py on the shipped corpus (tokenizer training included): {data['tokens']:,} tokens in "
          f"{data['seconds']:.1f} s = {data['tokens_per_s']:,.0f} tokens/s")


if __name__ == "__main__":
    try:
        main()
    except LaunchError as e:
        sys.exit(f"error: {e}")
