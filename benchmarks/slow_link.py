#!/usr/bin/env python
"""Plain ZeRO-3 vs hpZ (stock, sync, ordered) vs hpZ + hierarchical gradients over slow inter-node links, on an
emulated 2-node cluster.

    sudo .venv/bin/python benchmarks/slow_link.py                       # ~11 min on 2 cores (with hpz-sync: 14)
    sudo .venv/bin/python benchmarks/slow_link.py --rates 50mbit,unshaped --steps 6 --out-dir runs/slow_link
    sudo .venv/bin/python benchmarks/slow_link.py --rates 20mbit --collectives ring,native   # + gloo's own
    sudo .venv/bin/python benchmarks/slow_link.py --param-fetch module   # DeepSpeed's per-submodule all-gathers

One launch of 2 emulated nodes x 2 processes (``tools.emulate``: a network namespace per node, ``tc``-shaped
veth links, intra-node traffic over each namespace's loopback) runs every (bandwidth, variant) pair one after
the other in the same processes, with the real trainer (``zerotrain.trainer.Trainer``) on a small Llama
(hidden 256, 4 layers, 4.0M parameters: 16 MB of fp32 weights, so each step moves tens of MB between nodes) and
``zerotrain.comm_accounting`` installed. The baseline is what NCCL users have: ``--collectives ring`` (default) runs
every reduce-scatter and all-gather as a ring over point-to-point (``cluster.collectives=ring``,
``zerotrain.ring_collectives``), so each variant moves the bytes NCCL's ring algorithms would; ``native`` adds gloo's
own collectives (its reduce-scatter is an all-reduce: about twice the gradient bytes) as separate, labelled rows.
Between bandwidths the worker asks the parent to reshape the links (files
in the output directory) and waits. The first ``--warmup`` steps of each run are left out of the measurements
(DeepSpeed's trace validation, and hpZ's first forward that still reads the secondary shards zero.Init made).

Printed (and written to ``<out-dir>/slow_link.md``, ``.json``, ``.png``): a side-by-side table (per bandwidth, every
variant's step time and speed-up, beside the ratio of wire bytes), then per bandwidth and variant:
step time, tokens/s, the speed-up over plain ZeRO-3 at that bandwidth (same collectives), the bytes that really
left each node's interface per step (``/proc/net/dev`` of each namespace's eth0, averaged over the nodes: the
collectives' payload plus TCP/IP headers) beside the ring model's inter-node bytes per node for the same calls
(``comm/ring_inter_node_bytes_per_node`` of ``zerotrain/comm_accounting.py``, closed form in
``zerotrain/comm_model.py``) and their ratio, and the accounting's logical inter-node bytes (received from other
nodes, all ranks). Every run's ``metrics.jsonl`` is in ``<out-dir>/runs/<rate>-<variant>/``, for
``python -m tools.compare``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from tools import launcher

REPO = Path(__file__).resolve().parent.parent

VARIANTS = {  # name -> overrides
    "zero3": ["zero=zero3_cpu"],
    "hpz-stock": ["zero=zero3_hpz_cpu", "hpz.mode=stock"],
    "hpz-sync": ["zero=zero3_hpz_cpu", "hpz.mode=sync"],
    "hpz-ordered": ["zero=zero3_hpz_cpu", "hpz.mode=ordered"],
    # hpZ + gradients reduce-scattered inside the node first, then across nodes over 1/hpZ of the data.
    "hpz-hier": ["zero=zero3_hpz_cpu", "hpz.mode=ordered", "hpz.grad_reduce=hierarchical"],
}
DEFAULT_VARIANTS = "zero3,hpz-ordered,hpz-hier"
MODEL = ["model.hidden_size=256", "model.num_layers=4", "model.intermediate_size=704"]
# Little compute per step (2 x 64 tokens per rank): the communication is what is measured.
TRAIN = ["train.micro_batch_size=2", "train.seq_len=64", "train.eval_interval=0", "train.log_interval=1",
         "wandb.enabled=false", "checkpoint.save_final=false", "checkpoint.resume=false", "schedule.warmup_steps=2"]


def rate_label(rate: str) -> str:
    return "unshaped" if rate in ("unshaped", "none", "") else rate


# ------------------------------------------------------------------------------------------------------------------
# Worker (runs under torchrun inside the emulated nodes)
# ------------------------------------------------------------------------------------------------------------------


def _tx_bytes(ifname: str = "eth0") -> int:
    """Bytes sent by this network namespace's interface (/proc/net/dev is per namespace)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == ifname:
            return int(rest.split()[8])
    return 0


def _wait_for(path: Path, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if time.time() > deadline:
            raise TimeoutError(f"no {path} after {timeout} s (is the emulator's parent alive?)")
        time.sleep(0.05)


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from zerotrain import comm_accounting
    from zerotrain.run_config import parse_args
    from zerotrain.trainer import StepCallback, Trainer

    class MeasureSteadyState(StepCallback):
        """Marks (time, this node's tx bytes) before the first measured step and after the last, with barriers so
        every rank agrees, and the job-wide collective byte counts of the measured steps only."""

        def __init__(self):
            self.marks: list[tuple[float, int]] = []
            self.snaps: list[dict] = []

        def on_step_begin(self, trainer, step):
            if step == args.warmup + 1:
                dist.barrier()
                comm_accounting.snapshot_and_reset()  # drop the warm-up steps' counts
                self.marks.append((time.perf_counter(), _tx_bytes()))

        def on_step_end(self, trainer, step, result):
            if step == args.steps:
                dist.barrier()
                self.marks.append((time.perf_counter(), _tx_bytes()))
                self.snaps.append(comm_accounting.snapshot_and_reset(all_ranks=True))

    out = Path(args.out_dir)
    ctl = out / "control"
    results = []
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    for rate, collectives, variant in ((r, c, v) for r in args.rates.split(",") for c in args.collectives.split(",")
                                       for v in args.variants.split(",")):
        label = f"{rate_label(rate)}-{variant}" + ("" if collectives == "ring" else f"-{collectives}")
        if rank == 0:  # ask the parent for this bandwidth, wait until the links are shaped
            (ctl / f"want-{label}").write_text(rate)
            _wait_for(ctl / f"shaped-{label}")
        overrides = ["recipe=tiny_llama", f"data.train.0.path={args.data}", f"run.output_dir={out / 'runs'}",
                     f"run.name={label}", f"train.steps={args.steps}", *MODEL, *TRAIN, *VARIANTS[variant],
                     f"cluster.collectives={collectives}", f"train.param_fetch={args.param_fetch}"]
        measure = MeasureSteadyState()
        # Barriers inside: nobody starts before rank 0 is released.
        trainer = Trainer(parse_args(overrides), callbacks=[measure])
        comm_accounting.install(trainer.layout)
        try:
            rc = trainer.fit()
        finally:
            comm_accounting.uninstall()
        measured = args.steps - args.warmup
        (t0, tx0), (t1, tx1) = measure.marks
        snaps = measure.snaps
        # Wire bytes: each node's eth0 tx, counted once per node (local rank 0), averaged over the nodes.
        wire = torch.tensor([float(tx1 - tx0) if local_rank == 0 else 0.0], dtype=torch.float64)
        dist.all_reduce(wire)
        nodes = trainer.layout.num_nodes
        record = comm_accounting.metrics_record(snaps[0], measured, nodes=nodes)
        results.append({
            "rate": rate_label(rate), "variant": variant, "collectives": collectives, "rc": rc,
            "steps": measured,
            "step_time_s": (t1 - t0) / measured,
            "tokens_per_s": trainer.tokens_per_step * measured / (t1 - t0),
            "inter_node_bytes": record["comm/inter_node_bytes"],
            "intra_node_bytes": record["comm/intra_node_bytes"],
            "wire_bytes": wire.item() / measured / nodes,  # per node
            "ring_model_bytes": record["comm/ring_inter_node_bytes_per_node"],
            "comm": record,
        })
        trainer.engine.destroy()
        del trainer
        dist.barrier()
        if rank == 0:
            print(f"[slow_link] done {label}: {results[-1]['step_time_s']:.3f} s/step, "
                  f"{results[-1]['inter_node_bytes'] / 1e6:.2f} MB inter-node/step (logical), "
                  f"{results[-1]['wire_bytes'] / 1e6:.2f} MB on the wire/step per node (ring model "
                  f"{results[-1]['ring_model_bytes'] / 1e6:.2f})", flush=True)
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


# ------------------------------------------------------------------------------------------------------------------
# Parent: the emulated cluster, reshaping on request, the table and the figure
# ------------------------------------------------------------------------------------------------------------------


COLLECTIVES = {"ring": "ring (NCCL's bytes)", "native": "gloo native"}


def _baselines(results: list[dict]) -> dict:
    return {(r["rate"], r.get("collectives", "ring")): r for r in results if r["variant"] == "zero3"}


def table(results: list[dict]) -> str:
    base = _baselines(results)
    lines = ["| inter-node link | variant | collectives | step time (s) | tokens/s | speed-up vs ZeRO-3 | "
             "wire MB/step per node | ring model MB/step per node | wire / model | inter-node MB/step "
             "(logical, all ranks) | intra-node MB/step (logical) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        c = r.get("collectives", "ring")
        b = base.get((r["rate"], c))
        speedup = b["step_time_s"] / r["step_time_s"] if b else float("nan")
        lines.append(f"| {r['rate']} | {r['variant']} | {COLLECTIVES[c]} | {r['step_time_s']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {speedup:.2f}x | {r['wire_bytes'] / 1e6:.2f} | "
                     f"{r['ring_model_bytes'] / 1e6:.2f} | {r['wire_bytes'] / r['ring_model_bytes']:.3f} | "
                     f"{r['inter_node_bytes'] / 1e6:.2f} | {r['intra_node_bytes'] / 1e6:.2f} |")
    return "\n".join(lines)


def side_by_side(results: list[dict]) -> str:
    """One row per link and collectives: every variant's step time, its speed-up over ZeRO-3 with the same
    collectives and, for comparison, the ratio of ZeRO-3's wire bytes to its own (the speed-up if only the bytes
    between nodes mattered), then the wire bytes per node beside the ring model's."""
    variants = list(dict.fromkeys(r["variant"] for r in results))
    rows = {(r["rate"], r.get("collectives", "ring"), r["variant"]): r for r in results}
    head = ["link", "collectives", *(f"{v} s/step" for v in variants),
            *(f"{v} speed-up (wire ratio)" for v in variants[1:]),
            "wire MB/step per node " + " / ".join(variants), "ring model MB/step per node"]
    lines = ["| " + " | ".join(head) + " |", "|---|---" + "|---:" * (len(head) - 2) + "|"]
    for rate, c in dict.fromkeys((r["rate"], r.get("collectives", "ring")) for r in results):
        got = [rows.get((rate, c, v)) for v in variants]
        base = got[0]
        cells = [rate, COLLECTIVES[c], *(f"{g['step_time_s']:.3f}" if g else "-" for g in got)]
        for g in got[1:]:
            cells.append(f"{base['step_time_s'] / g['step_time_s']:.2f}x ({base['wire_bytes'] / g['wire_bytes']:.2f}x)"
                         if g and base else "-")
        cells.append(" / ".join(f"{g['wire_bytes'] / 1e6:.1f}" if g else "-" for g in got))
        cells.append(" / ".join(f"{g['ring_model_bytes'] / 1e6:.1f}" if g else "-" for g in got))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(results: list[dict], path: Path) -> None:
    import matplotlib

    first = results[0].get("collectives", "ring")  # the figure shows the first collectives' runs
    results = [r for r in results if r.get("collectives", "ring") == first]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(r["rate"] for r in results))
    variants = list(dict.fromkeys(r["variant"] for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(variants)
    for j, v in enumerate(variants):
        rows = {r["rate"]: r for r in results if r["variant"] == v}
        xs = [i + (j - (len(variants) - 1) / 2) * width for i in range(len(rates))]
        axes[0].bar(xs, [rows[k]["step_time_s"] if k in rows else 0 for k in rates], width, label=v)
        axes[1].bar(xs, [rows[k]["wire_bytes"] / 1e6 if k in rows else 0 for k in rates], width, label=v)
    for ax, title in zip(axes, ("step time (s)", "MB per step out of each node (wire)")):
        ax.set_xticks(range(len(rates)), rates)
        ax.set_xlabel("inter-node bandwidth per node")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"ZeRO-3 vs hpZ (+ hierarchical gradients), 2 emulated nodes x 2 CPU processes (gloo, "
                 f"{COLLECTIVES[first]} collectives), small Llama (4.0M params)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parent(args) -> int:
    import subprocess

    from tools.emulate import EmulatedCluster, EmulatorError, SignalExit, install_signal_handlers, parse_rate

    out = Path(args.out_dir).resolve()
    ctl = out / "control"
    ctl.mkdir(parents=True, exist_ok=True)
    for f in ctl.iterdir():
        f.unlink()
    (out / "results.json").unlink(missing_ok=True)
    shutil.rmtree(out / "runs", ignore_errors=True)  # metrics.jsonl of an earlier benchmark would be appended to
    data = Path(args.data).resolve()
    if not (data / "manifest.json").is_file():
        print(f"[slow_link] preparing {data}", flush=True)
        launcher.run([launcher.PYTHON, "data/prepare.py", "input=data/corpus/shakespeare_milton.txt",
                      f"output={data}", "tokenizer.train_vocab_size=2048", "valid_fraction=0.02", "progress=false"],
                     timeout=1800)
    rates = args.rates.split(",")
    for r in rates:
        parse_rate(r)  # refuse a bad rate before anything starts
    install_signal_handlers()
    t_start = time.time()
    cluster = EmulatedCluster(nodes=2, rate_mbit=None)
    try:
        cluster.setup()
        port = 29500
        worker_args = [str(Path(__file__).resolve()), "--worker", "--out-dir", str(out), "--data", str(data),
                       "--rates", args.rates, "--variants", args.variants, "--steps", str(args.steps),
                       "--collectives", args.collectives, "--param-fetch", args.param_fetch,
                       "--warmup", str(args.warmup)]
        from tools.emulate import torchrun_argv

        procs = [cluster.popen(i, torchrun_argv(sys.executable, cluster, i, 2, port, worker_args),
                               env={**launcher.CPU_ENV, **cluster.node_env(i, port)}, cwd=REPO,
                               stdout=open(out / f"node{i}.log", "w"), stderr=subprocess.STDOUT)
                 for i in range(2)]
        done = set()
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"a node failed (see {out}/node*.log)")
            for want in sorted(ctl.glob("want-*")):
                if want.name in done:
                    continue
                rate = want.read_text()
                cluster.shape(parse_rate(rate), 0.0)
                print(f"[slow_link] {time.time() - t_start:5.0f} s: {want.name[5:]} (links: "
                      f"{cluster.describe_link()})", flush=True)
                (ctl / want.name.replace("want-", "shaped-")).write_text("ok")
                done.add(want.name)
            time.sleep(0.05)
        if any(p.returncode for p in procs):
            raise RuntimeError(f"a node failed (see {out}/node*.log)")
    except (KeyboardInterrupt, SignalExit) as e:
        print(f"[slow_link] interrupted ({e!r}): cleaning up", file=sys.stderr)
        return 130
    except (EmulatorError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        cluster.close()
    results = json.loads((out / "results.json").read_text())
    md = side_by_side(results) + "\n\n" + table(results) if results[0]["variant"] == "zero3" else table(results)
    note = (f"\n\n2 emulated nodes x 2 processes, {args.steps - args.warmup} measured steps per run "
            f"(after {args.warmup} warm-up), ZeRO-3 fetch unit {args.param_fetch} (train.param_fetch), "
            f"{time.time() - t_start:.0f} s in all. MB = 10^6 bytes.\n")
    (out / "slow_link.md").write_text(md + note)
    (out / "slow_link.json").write_text(json.dumps(results, indent=1))
    figure(results, out / "slow_link.png")
    print(md + note)
    print(f"wrote {out / 'slow_link.md'}, {out / 'slow_link.png'}; runs in {out / 'runs'}")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100mbit,50mbit,20mbit,unshaped",
                   help="inter-node bandwidths per node and direction (comma-separated; 'unshaped')")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"subset of {','.join(VARIANTS)}")
    p.add_argument("--collectives", default="ring",
                   help="ring (the bytes of NCCL's ring algorithms) and/or native (gloo's own), comma-separated")
    p.add_argument("--steps", type=int, default=6, help="steps per run (default 6)")
    p.add_argument("--param-fetch", default="layer", choices=("layer", "module"),
                   help="ZeRO-3's fetch unit for every variant (train.param_fetch; default layer, the trainer's)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the measurements (default 2)")
    p.add_argument("--out-dir", default=str(REPO / "runs" / "slow_link"))
    p.add_argument("--data", default=str(REPO / "data" / "prepared" / "shakespeare"),
                   help="prepared data directory (prepared from the shipped corpus if missing)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps <= args.warmup + 1:
        p.error("need --warmup >= 1 and --steps > --warmup + 1")
    for v in args.variants.split(","):
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    for c in args.collectives.split(","):
        if c not in COLLECTIVES:
            p.error(f"unknown --collectives {c!r}; choose from {', '.join(COLLECTIVES)}")
    return worker(args) if args.worker else parent(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
