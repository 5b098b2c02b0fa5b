#!/usr/bin/env python
"""docs/hpz.md's option matrix, from the emulator launch's JSON: every option with hpZ, works or refused.

    HPZ_MATRIX_FULL=1 HPZ_RESULTS_DIR=runs/hpz .venv/bin/python -m pytest tests/hpz/test_hpz_matrix.py
    .venv/bin/python benchmarks/hpz_matrix.py runs/hpz/hpz_emulated.json --update docs/hpz.md
    .venv/bin/python benchmarks/hpz_matrix.py --launch runs/hpz/hpz_emulated.json --update docs/hpz.md  # own launch

The JSON is what tests/hpz/worker_emulator.py writes (4 ranks = 2 emulated nodes x 2, hpZ 2, under the emulated
asynchronous accelerator): the fp32/bf16 runs of test_hpz_emulated.py, the option runs of worker_matrix.py
(test_hpz_matrix.py); the refused rows are zerotrain.hpz.options' messages (test_hpz_options.py). Per row: races per
rank (every rank equal unless several numbers are shown) in ``stock`` and ``ordered`` for Llama / Falcon, and the
largest |loss difference| from the reference (plain ZeRO-3 with the same option; ``sync`` where stated) over every
rank's training and evaluation losses. ``--update FILE`` rewrites the table between the markers in FILE.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "hpz"))
BEGIN, END = "<!-- hpz-matrix:begin (benchmarks/hpz_matrix.py) -->", "<!-- hpz-matrix:end -->"
KINDS = ("llama", "falcon")

# What each working row relies on in zerotrain.hpz (no combination needed a new fix), and caveats.
NOTES = {
    "fp32": "the fix itself (ordered: the all-gather stream waits on each shard copy's event)",
    "bf16": "as fp32",
    "offload_optimizer": "DeepSpeed's optimizer step on host states; torch AdamW (DeepSpeedCPUAdam in train.py)",
    "fp16_dynamic": "DeepSpeed level only: train.precision offers bf16/fp32. The CPU accelerator is told fp16 works "
                    "(torch's CPU kernels compute it); the scale moved and ended equal in both arms",
    "allgather_sequential": "the sequential path reads the secondary shard too: our all-gather hook orders it",
    "activation_checkpointing": "the recompute gathers from the hpZ shards in backward: ordered like any read",
    "frozen_embeddings": "a frozen shard is built once and never invalidated by DeepSpeed (weights unchanged)",
    "clip_grad_accum": "norm above the clip every step (clipping active)",
    "pretrained_load": "weights loaded after zero.Init partitioned the model; verified equal to the file",
    "resume": "zerotrain.hpz drops every shard after load_checkpoint (DeepSpeed's epilogue drops only the trainable "
              "parameters' shards)",
    "mmlu_hook": "zerotrain.evaluation.evaluate between steps: the same log-likelihoods as plain ZeRO-3",
    "layer_fetch": "one coalesced all-gather reads every shard of a decoder layer: our all-gather hook orders it "
                   "after each of their copies (one event wait per shard, as per module)",
    "grad_reduce_hierarchical": "reference: sync with the same reduction (plain ZeRO-3 has no hpZ group to reduce "
                                "in); vs flat ZeRO-3 it is within the tolerances of the section above (summation "
                                "order)",
}
REFUSED_LABELS = {
    "offload_param": "zero.offload_param (cpu)",
    "super_offload": "SuperOffload",
    "zenflow": "ZenFlow",
    "mics": "MiCS",
    "deepcompile": "DeepCompile",
    "autoep": "AutoEP",
    "quantized_nontrainable": "zero_quantized_nontrainable_weights",
    "qwz_cpu": "qwZ (zero_quantized_weights)",
    "qgz_cpu": "qgZ (zero_quantized_gradients)",
}


def _races(run: dict) -> str:
    counts = [e["races"] + e["freed_source_races"] for e in run["emulator"]]
    return str(counts[0]) if len(set(counts)) == 1 else "/".join(map(str, counts))


def _max_diff(run: dict, reference: dict) -> float:
    diffs = [abs(a - b) for mine, ref in zip(run["losses"], reference["losses"])
             for a, b in zip(mine["train"] + mine["eval"], ref["train"] + ref["eval"])]
    return max(diffs, default=0.0)


def _diff(value: float, skipped: list) -> str:
    text = "0 (bitwise)" if value == 0 else f"{value:.2g}"
    return text + (f", {max(skipped)} step(s) skipped" if any(skipped) else "")


def _row(label: str, runs: dict, key, reference_arm: str, note: str) -> str:
    stock, ordered, diffs, stock_diffs = [], [], [], []
    for kind in KINDS:
        missing = [key(kind, arm) for arm in (reference_arm, "ordered") if key(kind, arm) not in runs]
        if missing:
            return f"| {label} | NOT RUN ({', '.join(missing)}) | | | | |"
        ref = runs[key(kind, reference_arm)]
        o = runs[key(kind, "ordered")]
        s = runs.get(key(kind, "stock"))
        if s is None:  # Falcon's stock arm outside HPZ_MATRIX_FULL=1
            stock.append("not run")
            stock_diffs.append("not run")
            ordered.append(_races(o))
            diffs.append(_diff(_max_diff(o, ref), o["skipped_steps"]))
            if _max_diff(o, ref) != 0 or any(o["skipped_steps"]) or _races(o) != "0":
                return f"| {label} | FAILS ({kind}: ordered races {_races(o)}) | | | | {note} |"
            continue
        if any("error" in r for r in (ref, s, o)):
            return f"| {label} | ERROR | | | | see the launch's JSON |"
        stock.append(_races(s))
        ordered.append(_races(o))
        diffs.append(_diff(_max_diff(o, ref), o["skipped_steps"]))
        stock_diffs.append(_diff(_max_diff(s, ref), s["skipped_steps"]))
        works = _max_diff(o, ref) == 0 and not any(o["skipped_steps"]) and _races(o) == "0"
        flagged = _races(s) != "0"
        if not (works and flagged):
            return (f"| {label} | FAILS ({kind}: ordered races {_races(o)}, stock races {_races(s)}) | "
                    f"{' / '.join(stock)} | {' / '.join(ordered)} | {' / '.join(diffs)} | {note} |")
    ref_name = "plain ZeRO-3" if reference_arm == "plain" else f"`{reference_arm}`"
    return (f"| {label} | works | {' / '.join(stock)} | {' / '.join(ordered)} | {' / '.join(diffs)} vs "
            f"{ref_name} (stock: {' / '.join(stock_diffs)}) | {note} |")


def table(results: dict) -> str:
    import worker_matrix as M

    runs = results["runs"]
    lines = ["| option (with hpZ 2) | result | races/rank stock (Llama / Falcon) | races/rank ordered | "
             "max \\|loss diff\\| ordered (Llama / Falcon) | notes |", "|---|---|---|---|---|---|"]
    for dtype in ("fp32", "bf16"):
        lines.append(_row(dtype, runs, lambda kind, arm, d=dtype: f"{kind}:{d}:{arm}", "plain", NOTES[dtype]))
    for option, what in M.OPTIONS.items():
        reference = M.REFERENCE_ARM.get(option, "plain")
        lines.append(_row(what, runs, lambda kind, arm, o=option: f"matrix:{o}:{kind}:{arm}", reference,
                          NOTES[option]))
    for name, refusal in M.refusals().items():  # zerotrain.hpz.options now, as test_hpz_options.py checks it
        if not refusal["refused"]:
            lines.append(f"| {REFUSED_LABELS.get(name, name)} | NOT REFUSED | | | | |")
            continue
        why = refusal["message"].split(" is refused: ", 1)[-1].replace(" (docs/hpz.md#option-matrix)", "")
        if "no CPU kernels" in why:
            why += "; the emulator does not cover it there (below)"
        lines.append(f"| {REFUSED_LABELS.get(name, name)} | refused, exit {refusal['exit_code']} "
                     f"(`{'`, `'.join(refusal['keys'])}`) | - | - | - | {why} |")
    steps = results.get("steps")
    lines.append("")
    lines.append(f"Runs: fp32/bf16 rows {steps} optimizer steps, option rows {M.STEPS}, each of gradient "
                 "accumulation 2 (3 with clipping) and an evaluation pass; races are racy shard reads plus "
                 "freed-source copies per rank over the whole run.")
    return "\n".join(lines)


def update(path: Path, text: str) -> None:
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path}: the markers {BEGIN!r} ... {END!r} are missing")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def launch(out: Path) -> None:
    from tools import launcher
    specs = [f"{k}:{d}:{arm}" for k in KINDS for d in ("fp32", "bf16") for arm in ("plain", "stock", "ordered")]
    import worker_matrix as M
    out.parent.mkdir(parents=True, exist_ok=True)
    launcher.torchrun(4, REPO / "tests" / "hpz" / "worker_emulator.py", str(out), *specs, *M.specs(full=True),
                      env={"HPZ_TMP": str(out.parent)}, timeout=3600)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", type=Path, help="the emulator launch's JSON (HPZ_RESULTS_DIR/hpz_emulated.json)")
    parser.add_argument("--launch", action="store_true", help="run the launch first, writing that JSON")
    parser.add_argument("--update", type=Path, help="rewrite the table between the markers in this file")
    args = parser.parse_args(argv)
    if args.launch:
        launch(args.json)
    text = table(json.loads(args.json.read_text()))
    print(text)
    if args.update:
        update(args.update, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
