"""Throughput of our training loop next to a plain Hugging Face ``Trainer``, and of data preparation.

Same model (tiny Llama), same data (the shipped corpus), same batch and the same DeepSpeed config (ZeRO-3 + hpZ 2
on 4 CPU processes by default). Four arms, each loop with each ZeRO-3 fetch unit:

* ours as shipped (``train.param_fetch=layer``: a decoder layer per coalesced all-gather) and with
  ``train.param_fetch=module``;
* the HF Trainer as shipped (DeepSpeed's per-submodule fetch, ``module``) and with the layer unit set the way a
  Trainer user can (``deepspeed.utils.set_z3_leaf_modules``, the call ours makes).

So the table separates what the loop does from what the fetch unit does. Both loops are timed the same way: the wall
clock from one step's end to the next (everything between included), the first two steps left out
(benchmarks/zerotrain_timed.py, benchmarks/hf_trainer_baseline.py). The arms run ``--repeats`` times, in rounds
whose order alternates (ABCD DCBA ...) so that a shared machine's drift hits every arm alike; the table gives each
arm's median and range, and the CPU seconds a step costs all ranks together (with more ranks than cores, any
rank's CPU second is wall time for the others). Prints a Markdown table.

    .venv/bin/python benchmarks/train_throughput.py [--steps 30] [--repeats 3] [--nproc 4] [--recipe tiny_llama]
        [--hpz 2] [key=value ...]   # overrides of the recipe, e.g. the 4M-parameter Llama of benchmarks/slow_link.py:
                                    # model.hidden_size=256 model.num_layers=4 model.intermediate_size=704

The Hugging Face runs read our first run's config.yaml and deepspeed_config.json, so overrides apply to both.
"""

import argparse
import json
import statistics
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


# name -> (loop, ZeRO-3 fetch unit); the first is ours as shipped, the third the HF Trainer as shipped
ARMS = {"ours": ("zerotrain train.py", "layer"), "ours-module": ("zerotrain train.py", "module"),
        "hf": ("HF Trainer", "module"), "hf-layer": ("HF Trainer", "layer")}


def rounds(names: list[str], repeats: int) -> list[list[str]]:
    """The arms' order in each round: forwards, backwards, forwards... (ours as shipped opens the first round: the
    HF runs read its run directory)."""
    return [names if r % 2 == 0 else names[::-1] for r in range(repeats)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--recipe", default="tiny_llama")
    parser.add_argument("--hpz", type=int, default=2)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"a subset of {','.join(ARMS)} (ours always runs)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, for both loops")
    args = parser.parse_args()
    if args.steps < 5 or args.repeats < 1:
        parser.error("--steps must be at least 5 (two warm-up steps are left out) and --repeats at least 1")
    arms = ["ours", *(a for a in args.arms.split(",") if a != "ours")]
    if set(arms) - set(ARMS):
        parser.error(f"--arms: unknown {','.join(sorted(set(arms) - set(ARMS)))}; choose from {','.join(ARMS)}")

    work = Path(tempfile.mkdtemp(prefix="zerotrain-bench-"))
    data = prepare(work / "data")
    ours_args = [f"recipe={args.recipe}", f"train.steps={args.steps}", "train.log_interval=5", "train.eval_interval=0",
                 "checkpoint.save_final=false", "wandb.enabled=false", f"zero.zero_hpz_partition_size={args.hpz}",
                 f"run.output_dir={work}", f"data.train.0.path={work / 'data'}", *args.overrides]
    config_dir = work / "ours-0"  # the config both HF arms read: ours as shipped, first round

    def run(name: str, r: int) -> dict:
        loop, fetch = ARMS[name]
        out = work / f"{name}-{r}.json"
        if loop == "HF Trainer":
            torchrun(args.nproc, "benchmarks/hf_trainer_baseline.py", str(config_dir), str(args.steps), str(out), fetch)
        else:
            torchrun(args.nproc, "benchmarks/zerotrain_timed.py", str(out), *ours_args, f"run.name={name}-{r}",
                     f"train.param_fetch={fetch}")
        result = json.loads(out.read_text())
        if result["torch_world"] != args.nproc:
            sys.exit(f"{name} ran on {result['torch_world']} ranks, not {args.nproc}: not comparable")
        return result

    times: dict[str, list[float]] = {name: [] for name in arms}
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    for r, order in enumerate(rounds(arms, args.repeats)):
        for name in order:
            result = run(name, r)
            times[name].append(result["step_time_s"])
            cpu[name].append(result["cpu_s_per_step"])
            print(f"round {r + 1}/{args.repeats}: {name} {times[name][-1]:.3f} s/step, {cpu[name][-1]:.3f} CPU s/step",
                  file=sys.stderr, flush=True)

    median = {name: statistics.median(t) for name, t in times.items()}
    tokens = result["tokens_per_s"] * result["step_time_s"]  # per step, the same in every arm (the last run's)
    title = " ".join([args.recipe, *args.overrides])
    print(f"\n{title}, {args.nproc} CPU processes, ZeRO-3 hpZ {args.hpz}, {args.steps} steps, median of "
          f"{args.repeats} launches per arm (wall clock step end to step end, first two steps left out)\n")
    print("| loop | ZeRO-3 fetch unit | step time (s) | range (s) | CPU s per step, all ranks | tokens/s | "
          "HF Trainer as shipped / this | HF Trainer, same unit / this |")
    print("|---|---|---|---|---|---|---|---|")

    def ratio(baseline: str, name: str) -> str:
        return f"{median[baseline] / median[name]:.2f}x" if baseline in median else "-"

    for name in arms:
        loop, fetch = ARMS[name]
        same_unit = "hf" if fetch == "module" else "hf-layer"
        print(f"| {loop} | {fetch} | {median[name]:.3f} | {min(times[name]):.3f}-{max(times[name]):.3f} | "
              f"{statistics.median(cpu[name]):.3f} | {tokens / median[name]:,.0f} | {ratio('hf', name)} | "
              f"{ratio(same_unit, name)} |")
    print(f"\ndata/prepare.py on the shipped corpus (tokenizer training included): {data['tokens']:,} tokens in "
          f"{data['seconds']:.1f} s = {data['tokens_per_s']:,.0f} tokens/s")


if __name__ == "__main__":
    try:
        main()
    except LaunchError as e:
        sys.exit(f"error: {e}")
