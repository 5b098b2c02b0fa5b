"""Peak host memory of a pretrained load under ZeRO-3, per rank and per node, against the memory plan's row; and the
loaded weights against the file's.

    .venv/bin/python benchmarks/pretrained_load_memory.py [--hidden 1536 --layers 12] [--ranks 4]
        [--shard-size 200MB] [--precision bf16] [--json out.json]

Writes a Llama checkpoint of random weights as the Hub ships one (``save_pretrained``, sharded safetensors and an
index), then loads it on ``--ranks`` CPU ranks (torchrun, gloo) through the project's own path: the ``deepspeed``
config the trainer builds, ``HfDeepSpeedConfig`` alive, ``zerotrain.models.build_model`` with
``model.pretrained_path`` (transformers' ``from_pretrained`` under ``zero.Init``). Each rank resets its peak RSS
(``/proc/self/clear_refs`` 5) just before the load, samples ``/proc/self/smaps_rollup`` every 10 ms during it, and
reads the kernel's exact peak (``VmHWM``) after it. The ranks run with ``MALLOC_MMAP_THRESHOLD_=131072`` unless
``--malloc-mmap-threshold 0``: with glibc's defaults, freed tensors under 32 MiB stay in the heap, which at these
sizes adds more than the loader itself holds (zerotrain/memory_plan.py's docstring). Then every parameter is
gathered and its bytes hashed (SHA-256) against the tensor of the same name in the safetensors files.

How pages are counted: RSS counts every resident page a process maps, so pages two ranks share (the libraries'
code, a file both map) count once per rank, and a node's sum of RSS over-counts; PSS divides each shared page among
the processes that map it, so the sum of PSS over a node's ranks is what the node holds. The per-node rows are
therefore the sum of the ranks' peaks of RSS (an upper bound: the peaks need not coincide) and the peak over time of
the sum of the ranks' sampled PSS (10 ms samples: a briefer peak can slip through). "Load" columns are above each
rank's own level just before the load (Python, torch, DeepSpeed, transformers), which the plan does not count.
The plan's row (``zerotrain.memory_plan.pretrained_load_bytes``) is for rank 0's node: the checkpoint once, plus
every rank's partition and one gathered module.

Measured (4 CPU ranks of one node, bf16, 0.44 B parameters, 5 shards): docs/paper.md, "Host memory of a pretrained
load" (the defaults here). ``tests/test_pretrained_load.py`` runs this worker at a tiny size on 4 ranks and asserts
the checksums and that the measured node peak stays within the plan.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from tools.launcher import torchrun

KIB = 1024
GIB = 2**30
SAMPLE_S = 0.01
# Every allocation of 128 KiB or more mmapped, so freed tensors go back to the system: what the loader holds, not
# what glibc keeps of small freed tensors (zerotrain/memory_plan.py's docstring).
MMAP_THRESHOLD = 128 * KIB


def overrides(checkpoint: Path, precision: str, shape: dict[str, int]) -> list[str]:
    """The run config of the load: the tiny recipe, plain ZeRO-3, the checkpoint and its shape."""
    return ["recipe=tiny_llama", "zero=zero3_cpu", f"model.pretrained_path={checkpoint}",
            f"train.precision={precision}", *(f"model.{k}={v}" for k, v in shape.items())]


def write_checkpoint(directory: Path, precision: str, shape: dict[str, int], shard_size: str) -> int:
    """Random weights of the shape, saved as the Hub's sharded safetensors; returns the parameter count."""
    from zerotrain import models, run_config

    cfg = run_config.parse_args(overrides(directory, precision, shape))
    cfg.model.pretrained_path = None  # built from the shape, no HfDeepSpeedConfig alive: a plain module
    torch.manual_seed(0)
    module = models.build_model(cfg.model, precision)
    module.save_pretrained(directory, max_shard_size=shard_size)
    return sum(p.numel() for p in module.parameters())


# --------------------------------------------------------------------------------------------------------------
# The worker: one rank of the load
# --------------------------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _rollup() -> dict[str, int]:
    """Rss, Pss, Pss_Anon, Pss_File, ... of this process in bytes (/proc/self/smaps_rollup)."""
    values = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        name, _, rest = line.partition(":")
        values[name] = int(rest.split()[0]) * KIB
    return values


class Sampler(threading.Thread):
    """Samples (time, RSS, PSS, anonymous PSS, file PSS) every SAMPLE_S seconds until stopped."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, int, int, int, int]] = []
        self._stop_event = threading.Event()

    def sample(self) -> None:
        r = _rollup()
        self.samples.append((time.time(), r["Rss"], r["Pss"], r.get("Pss_Anon", 0), r.get("Pss_File", 0)))

    def run(self) -> None:
        while not self._stop_event.wait(SAMPLE_S):
            self.sample()

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.sample()


def _time_loading_phase() -> list[float]:
    """Records when transformers starts and ends copying the checkpoint in (``_load_pretrained_model``): before
    it, the model is built under ``zero.Init``."""
    from transformers import PreTrainedModel

    stamps: list[float] = []
    original = PreTrainedModel._load_pretrained_model

    def timed(*args, **kwargs):
        stamps.append(time.time())
        try:
            return original(*args, **kwargs)
        finally:
            stamps.append(time.time())

    PreTrainedModel._load_pretrained_model = staticmethod(timed)  # type: ignore[method-assign]
    return stamps


def gathered_checksums(model: torch.nn.Module, rank: int) -> dict[str, str]:
    """SHA-256 of every parameter's bytes, gathered from its ZeRO-3 partitions (rank 0's dict; {} elsewhere)."""
    import deepspeed

    sums = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):  # collective: every rank, in the same order
            if rank == 0:
                sums[name] = hashlib.sha256(param.data.contiguous().view(torch.uint8).numpy()).hexdigest()
    return sums


def file_checksums(directory: Path) -> dict[str, str]:
    """SHA-256 of every tensor's bytes in the checkpoint's safetensors files."""
    from safetensors import safe_open

    sums = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sums[name] = hashlib.sha256(f.get_tensor(name).contiguous().view(torch.uint8).numpy()).hexdigest()
    return sums


def worker(out: Path, argv: list[str]) -> int:
    from transformers.integrations import HfDeepSpeedConfig

    from zerotrain import distributed, models
    from zerotrain import engine as engine_lib
    from zerotrain.run_config import parse_args

    cfg = parse_args(argv)
    dist = distributed.init(cfg.cluster.init_timeout_s, cfg.cluster.collective_timeout_s)
    train = cfg.train
    ds_config = engine_lib.deepspeed_config(  # as the trainer builds it
        cfg.zero, micro_batch_size=train.micro_batch_size, grad_accum=train.grad_accum, grad_clip=train.grad_clip,
        precision=train.precision, seed=cfg.run.seed, dp_size=dist.world_size, hpz_size=1, extra=cfg.deepspeed)
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841 - transformers partitions at construction while it lives
    distributed.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on is the load's
    before = _rollup()
    sampler = Sampler()
    sampler.sample()
    sampler.start()
    phases = _time_loading_phase()
    model = models.build_model(cfg.model, train.precision)
    sampler.stop()
    peak_rss = _status_kib("VmHWM") * KIB
    partition = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    record = {"rank": dist.rank, "local_rank": dist.local_rank, "rss_before": before["Rss"],
              "pss_before": before["Pss"], "peak_rss": peak_rss, "partition_bytes": partition,
              "samples": sampler.samples, "reading": phases}
    records = distributed.gather_objects(record)
    sums = gathered_checksums(model, dist.rank)
    if dist.rank == 0:
        expected = file_checksums(Path(cfg.model.pretrained_path))
        out.write_text(json.dumps({"ranks": records, "checksums": sums, "file_checksums": expected}))
    distributed.barrier()
    return 0


# --------------------------------------------------------------------------------------------------------------
# The driver: checkpoint, launch, table
# --------------------------------------------------------------------------------------------------------------


def node_pss_peak(ranks: list[dict]) -> tuple[int, int]:
    """(peak over time of the sum of the ranks' PSS, the sum just before the load): every rank's latest sample at
    each sampling time of any rank."""
    series = [sorted(r["samples"]) for r in ranks]
    stamps = [[x[0] for x in s] for s in series]
    peak = 0
    for t in sorted(t for s in stamps for t in s):
        total = sum(s[max(bisect.bisect_right(ts, t) - 1, 0)][2] for s, ts in zip(series, stamps))
        peak = max(peak, total)
    return peak, sum(r["pss_before"] for r in ranks)


def launch(argv: list[str], ranks: int, out: Path, mmap_threshold: int = MMAP_THRESHOLD,
           timeout: float = 1800) -> dict:
    """Launch the load on ``ranks`` ranks of one node; the worker's JSON with the per-node figures added.
    ``mmap_threshold``: glibc's MALLOC_MMAP_THRESHOLD_ for the ranks (0: glibc's dynamic default)."""
    env = {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)} if mmap_threshold else {}
    torchrun(ranks, __file__, "--worker", str(out), *argv, timeout=timeout, env=env)
    result = json.loads(out.read_text())
    workers = result["ranks"]
    result["node_peak_pss"], result["node_pss_before"] = node_pss_peak(workers)
    result["node_peak_rss_sum"] = sum(r["peak_rss"] for r in workers)
    result["node_rss_before"] = sum(r["rss_before"] for r in workers)
    return result


def planned(argv: list[str], ranks: int) -> int:
    """The memory plan's pretrained-load row for one node of ``ranks`` ranks."""
    from zerotrain import memory_plan
    from zerotrain.launch.world import World
    from zerotrain.run_config import parse_args

    cfg = parse_args(argv)
    p = memory_plan.plan(cfg, World(1, ranks, "benchmark"))
    assert p.load is not None
    return p.load.bytes


def table(result: dict, plan_bytes: int, params: int, checkpoint: Path, mmap_threshold: int) -> str:
    def g(n: float) -> str:
        return f"{n / GIB:.2f}"

    files = sorted(checkpoint.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    lines = [f"checkpoint: {params / 1e9:.3f} B parameters, {g(size)} GiB in {len(files)} safetensors shard(s) "
             f"(largest {g(max(f.stat().st_size for f in files))} GiB); {len(result['ranks'])} ranks on one node; "
             f"MALLOC_MMAP_THRESHOLD_={mmap_threshold or 'unset (glibc dynamic)'}",
             "| rank | RSS before | peak RSS | load (peak RSS - before) | peak PSS | peak anon PSS | peak file PSS "
             "| partition |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["ranks"], key=lambda r: r["rank"]):
        s = r["samples"]
        lines.append(f"| {r['rank']} | {g(r['rss_before'])} | {g(r['peak_rss'])} "
                     f"| {g(r['peak_rss'] - r['rss_before'])} | {g(max(x[2] for x in s))} "
                     f"| {g(max(x[3] for x in s))} | {g(max(x[4] for x in s))} "
                     f"| {g(r['partition_bytes'])} |")
    rss_load = result["node_peak_rss_sum"] - result["node_rss_before"]
    pss_load = result["node_peak_pss"] - result["node_pss_before"]
    lines += ["", "| per node (GiB) | before | peak | load (peak - before) | plan's pretrained-load row |",
              "|---|---|---|---|---|",
              f"| sum of the ranks' peak RSS (upper bound) | {g(result['node_rss_before'])} "
              f"| {g(result['node_peak_rss_sum'])} | {g(rss_load)} | {g(plan_bytes)} |",
              f"| peak of the summed PSS (10 ms samples) | {g(result['node_pss_before'])} "
              f"| {g(result['node_peak_pss'])} | {g(pss_load)} | {g(plan_bytes)} |"]
    same = result["checksums"] == result["file_checksums"]
    lines.append(f"\nloaded weights: {len(result['checksums'])} gathered parameters, SHA-256 "
                 f"{'equal to' if same else 'DIFFERENT FROM'} the safetensors' ({len(result['file_checksums'])})")
    return "\n".join(lines)


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        return worker(Path(sys.argv[2]), sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=4096, help="MLP width (Llama's default for hidden 1536)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--shard-size", default="200MB", help="save_pretrained's max_shard_size")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--malloc-mmap-threshold", type=int, default=MMAP_THRESHOLD,
                        help="glibc's MALLOC_MMAP_THRESHOLD_ for the ranks; 0: glibc's dynamic default")
    parser.add_argument("--json", type=Path, default=None, help="also write the measurement here")
    args = parser.parse_args()
    shape = {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": args.heads,
             "num_kv_heads": args.heads, "intermediate_size": args.ffn, "vocab_size": args.vocab}
    with tempfile.TemporaryDirectory(prefix="zt-load-bench-") as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        params = write_checkpoint(checkpoint, args.precision, shape, args.shard_size)
        argv = overrides(checkpoint, args.precision, shape)
        result = launch(argv, args.ranks, Path(tmp) / "load.json", args.malloc_mmap_threshold)
        plan_bytes = planned(argv, args.ranks)
        print(table(result, plan_bytes, params, checkpoint, args.malloc_mmap_threshold))
        if args.json:
            args.json.write_text(json.dumps({**result, "plan_bytes": plan_bytes, "params": params}))
        return 0 if result["checksums"] == result["file_checksums"] else 1


if __name__ == "__main__":
    from zerotrain.launch.teardown import exit_with

    exit_with(main)
