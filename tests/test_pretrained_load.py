"""A pretrained load under ZeRO-3 on 4 CPU ranks, for real (benchmarks/pretrained_load_memory.py's worker): the
gathered parameters equal the safetensors' byte for byte, no rank but rank 0 holds the checkpoint, and the node's
measured peak stays within the memory plan's pretrained-load row."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("pretrained_load_memory",
                                               REPO / "benchmarks" / "pretrained_load_memory.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)  # type: ignore[union-attr]

# 22 M parameters in fp32 (an 84 MiB checkpoint in 4 shards): large enough that the plan's row (the checkpoint, the
# partitions, the gathered embedding) dwarfs what a process allocates besides (a few MiB). The ranks run with the
# benchmark's MALLOC_MMAP_THRESHOLD_ (what the loader holds, not what glibc keeps of freed small tensors).
SHAPE = {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 8, "intermediate_size": 1536,
         "vocab_size": 8192}


@pytest.mark.launch  # through the benchmark's launcher call, which the tier marking does not follow
def test_pretrained_load_equals_the_file_and_fits_the_plans_host_row(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    bench.write_checkpoint(checkpoint, "fp32", SHAPE, "30MB")
    assert len(list(checkpoint.glob("*.safetensors"))) > 1  # sharded as the Hub's are
    argv = bench.overrides(checkpoint, "fp32", SHAPE)
    result = bench.launch(argv, 4, tmp_path / "load.json", timeout=1500)
    plan_bytes = bench.planned(argv, 4)
    on_disk = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))

    assert result["checksums"] and result["checksums"] == result["file_checksums"]  # every tensor, every byte
    ranks = {r["rank"]: r for r in result["ranks"]}
    # Rank 0 alone maps the checkpoint (its file pages); the others read only the headers. A rank's file PSS also
    # grows by the library pages the load first touches (shared by the ranks, measured 3-4.5 MiB each), so the bar
    # for the others is half of what each would hold if all four mapped the file (on_disk / 4 each, by PSS).
    assert max(s[4] for s in ranks[0]["samples"]) > 0.9 * on_disk
    for rank in (1, 2, 3):
        grew = max(s[4] for s in ranks[rank]["samples"]) - ranks[rank]["samples"][0][4]
        assert grew < on_disk / 8, (rank, grew, on_disk)
    # The node's load by PSS (shared pages once); the sum of RSS counts the libraries' pages the load first touches
    # once per rank (measured 13 MiB each here), so it is no measure of the node.
    pss_load = result["node_peak_pss"] - result["node_pss_before"]
    assert 0.5 * plan_bytes < pss_load <= plan_bytes, (pss_load, plan_bytes)
