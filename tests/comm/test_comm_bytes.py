"""Communication accounting: the byte model on fake layouts, and hpZ vs ZeRO-3 inter-node bytes on a real job.

The real-job test runs the trainer on 4 processes as 2 emulated nodes x 2 (``torchrun --nnodes 2`` launches with
``ZEROTRAIN_NODE_NAME=node0/node1``; gloo over 127.0.0.1; first in test_grad_reduce.py's first launch, in its
processes: comm_launches.py), with plain ZeRO-3, with hpZ 2 and with hpZ 2 + hierarchical gradients, and checks the
measured bytes per step *exactly* against what ZeRO++ predicts for that layout, derived here from the model's shape
(per-parameter numel), DeepSpeed's partition padding and the algorithm - not from a measured number.
"""

from __future__ import annotations

import math

import pytest
import torch
from comm_launches import COMM_SHAPE, COMM_STEPS, HIER

from zerotrain import comm_accounting
from zerotrain.comm_accounting import _Accountant
from zerotrain.launch.layout import layout_from_node_names

# ----------------------------------------------------------------------------------------------------------------
# The byte model, on fake layouts (no processes)
# ----------------------------------------------------------------------------------------------------------------


class FakeGroup:
    pass


def accountants(names: list[str], groups: dict) -> list[_Accountant]:
    layout = layout_from_node_names(names)
    out = []
    for rank in range(len(names)):
        acc = _Accountant(layout, rank)
        for group, ranks in groups.items():
            if rank in ranks:
                acc._group_ranks[id(group)] = (tuple(ranks), ranks.index(rank))
        out.append(acc)
    return out


def totals(accs: list[_Accountant]) -> dict:
    out: dict = {}
    for acc in accs:
        for kind, values in acc.counters.items():
            row = out.setdefault(kind, [0.0] * 5)
            for i, v in enumerate(values):
                row[i] += v
    return out


def test_all_gather_and_reduce_scatter_byte_model():
    world, pair = FakeGroup(), FakeGroup()
    names = ["a", "a", "b", "b"]
    accs = accountants(names, {world: [0, 1, 2, 3], pair: [0, 1]})
    shard = torch.zeros(10)  # 40 bytes per rank
    for acc in accs:
        acc.record("all_gather_into_tensor", (), {"output_tensor": torch.zeros(40), "input_tensor": shard,
                                                  "group": world})
        acc.record("reduce_scatter_tensor", (), {"output_tensor": shard, "input_tensor": torch.zeros(40),
                                                 "group": world})
    for acc in accs[:2]:
        acc.record("all_gather_into_tensor", (), {"output_tensor": torch.zeros(20), "input_tensor": shard,
                                                  "group": pair})
    t = totals(accs)
    # calls, send_intra, send_inter, recv_intra, recv_inter: every rank gets 40 B from 1 same-node and 2 other-node
    # peers in the world; in the pair, 40 B from its one same-node peer.
    assert t["all_gather"] == [6, 4 * 40 + 2 * 40, 4 * 80, 4 * 40 + 2 * 40, 4 * 80]
    assert t["reduce_scatter"] == [4, 160, 320, 160, 320]


def test_all_reduce_broadcast_all_to_all_p2p_conserve_bytes():
    world = FakeGroup()
    names = ["a", "a", "a", "b", "b", "b"]
    accs = accountants(names, {world: list(range(6))})
    for rank, acc in enumerate(accs):
        acc.record("all_reduce", (torch.zeros(6, dtype=torch.float64), None, world, False), {})
        acc.record("broadcast", (), {"tensor": torch.zeros(5), "src": 4, "group": world})
        acc.record("all_to_all_single", (), {"output": torch.zeros(12), "input": torch.zeros(12), "group": world,
                                             "output_split_sizes": None, "input_split_sizes": None})
    accs[0].record("send", (), {"tensor": torch.zeros(3), "dst": 5})
    accs[5].record("recv", (), {"tensor": torch.zeros(3), "src": 0})
    t = totals(accs)
    for kind, (calls, s_intra, s_inter, r_intra, r_inter) in t.items():
        assert (s_intra, s_inter) == (r_intra, r_inter), kind  # every byte sent is received by someone
    # all-reduce of 48 B over 6 ranks: 2*48/6 = 16 B per peer each way; each rank has 2 same-node, 3 other peers.
    assert t["all_reduce"][3:] == [6 * 2 * 16, 6 * 3 * 16]
    # broadcast of 20 B from rank 4 (node b): ranks 3, 5 receive it intra-node, ranks 0-2 inter-node.
    assert t["broadcast"][3:] == [2 * 20, 3 * 20]
    assert t["all_to_all"][3:] == [6 * 2 * 8, 6 * 3 * 8]  # 48 B in 6 chunks of 8
    assert t["p2p"][1:] == [0, 12, 0, 12]


def test_metrics_record_keys_and_averages():
    snap = {"all_gather": {"calls": 8, "send_intra": 40, "send_inter": 80, "recv_intra": 40, "recv_inter": 80},
            "reduce_scatter": {"calls": 4, "send_intra": 4, "send_inter": 8, "recv_intra": 4, "recv_inter": 8}}
    rec = comm_accounting.metrics_record(snap, steps=4)
    assert rec["comm/inter_node_bytes"] == 22.0 and rec["comm/intra_node_bytes"] == 11.0
    assert rec["comm/all_gather/inter_node_bytes"] == 20.0 and rec["comm/reduce_scatter/calls"] == 1.0
    assert comm_accounting.snapshot_and_reset() == {}  # not installed: nothing, and nothing patched
    assert not comm_accounting.installed()


# ----------------------------------------------------------------------------------------------------------------
# hpZ vs ZeRO-3 on the real trainer: exact bytes
# ----------------------------------------------------------------------------------------------------------------

NODES, PER_NODE, HPZ = 2, 2, 2
WORLD = NODES * PER_NODE
STEPS = COMM_STEPS
FP32 = 4
SHAPE = COMM_SHAPE  # the tiny Llama reshaped so that DeepSpeed pads some parameters (comm_launches.py)


def llama_param_numels(vocab, hidden, layers, heads, kv_heads, intermediate) -> list[int]:
    """Every parameter of transformers' LlamaForCausalLM (untied, no biases), in module order."""
    head_dim = hidden // heads
    per_layer = [hidden * heads * head_dim, hidden * kv_heads * head_dim, hidden * kv_heads * head_dim,
                 heads * head_dim * hidden,                               # q, k, v, o
                 intermediate * hidden, intermediate * hidden, hidden * intermediate,  # gate, up, down
                 hidden, hidden]                                          # the two RMSNorms
    return [vocab * hidden] + per_layer * layers + [hidden, vocab * hidden]  # embed, layers, norm, lm_head


def aligned(numel: int, partitions: int) -> int:
    """DeepSpeed's ``_aligned_size``: numel padded to a multiple of the partition world size; each rank's
    ``ds_tensor`` holds aligned/world elements, hpZ's ``ds_secondary_tensor`` aligned/hpz."""
    return math.ceil(numel / partitions) * partitions


def expected_bytes(numels: list[int]) -> dict:
    """Bytes received per step, summed over all ranks, by the accounting's model (each rank receives every peer's
    shard), for ZeRO-3 and hpZ in steady state (every step after the first two).

    Each parameter is gathered once in forward and once in backward (prefetch, reuse and persistence are 0 in
    zero3_cpu / zero3_hpz_cpu), and its gradient reduce-scattered once:
    * a world all-gather of a parameter: each of the W ranks gets aligned/W elements from each of its W-k peers
      on the other node and k-1 on its own: inter (W-k)*aligned, intra (k-1)*aligned elements in all;
    * hpZ's backward all-gather over the hpZ group (h ranks, inside a node): W*(h-1)*aligned/h, all intra;
    * the gradient reduce-scatter over the world: as a world all-gather (aligned/W out per rank);
    * hierarchical gradients (``hpz.grad_reduce=hierarchical``), in place of that reduce-scatter: a reduce-scatter
      over the hpZ group with aligned/h out per rank (W*(h-1)*aligned/h, all intra), then an all-to-all of those
      aligned/h over the W/h ranks with the same hpZ-local rank, aligned/W to and from each member: (W-k)/h of
      them on other nodes, k/h-1 on this one.
    """
    a = sum(aligned(n, WORLD) for n in numels) * FP32
    k, w, h = PER_NODE, WORLD, HPZ
    world_ag = {"inter": (w - k) * a, "intra": (k - 1) * a}
    hpz_ag = {"inter": 0, "intra": w * (h - 1) * a // h}
    hier_rs = {"inter": 0, "intra": w * (h - 1) * a // h}
    hier_a2a = {"inter": (w - k) * a // h, "intra": (k - h) * a // h}
    return {
        "aligned_bytes": a,
        "zero3": {"all_gather": {"inter": 2 * world_ag["inter"], "intra": 2 * world_ag["intra"]},
                  "reduce_scatter": world_ag},
        "hpz": {"all_gather": {"inter": world_ag["inter"], "intra": world_ag["intra"] + hpz_ag["intra"]},
                "reduce_scatter": world_ag},
        # Step 1 of hpZ: the forward still reads the secondary shards zero.Init made (the parameters have not
        # changed yet), so both gathers of that step are hpZ-group gathers.
        "hpz_step1": {"all_gather": {"inter": 0, "intra": 2 * hpz_ag["intra"]}, "reduce_scatter": world_ag},
        "hpz_hier": {"all_gather": {"inter": world_ag["inter"], "intra": world_ag["intra"] + hpz_ag["intra"]},
                     "reduce_scatter": hier_rs, "all_to_all": hier_a2a},
    }


@pytest.fixture(scope="module")
def measured(comm_launches_results) -> dict:
    """The three variants' runs, from test_grad_reduce.py's first launch (comm_launches.py)."""
    comm = comm_launches_results["comm"]
    if "crashed" in comm:
        pytest.fail(f"the byte accounting's stage crashed:\n{comm['crashed']}")
    return comm


def test_layout_is_two_nodes_and_hpz_groups_are_intra_node(measured):
    for variant in ("zero3_cpu", "zero3_hpz_cpu", HIER):
        layout = measured[variant]["layout"]
        assert layout["node_of_rank"] == ["node0", "node0", "node1", "node1"]
    assert measured["zero3_hpz_cpu"]["layout"]["hpz_groups"] == [[0, 1], [2, 3]]
    assert measured["zero3_hpz_cpu"]["deepspeed_hpz_group"] == [0, 1]  # rank 0's, as DeepSpeed built it
    assert measured["zero3_cpu"]["deepspeed_hpz_group"] is None


def test_parameter_shapes_are_the_derivations(measured):
    numels = llama_param_numels(**SHAPE)
    ds = [p["ds_numel"] for p in measured["zero3_cpu"]["params"]]
    assert sorted(ds) == sorted(numels)
    assert any(n % WORLD for n in numels), "the shape should exercise DeepSpeed's padding"
    for p in measured["zero3_cpu"]["params"]:
        assert p["partition"] == aligned(p["ds_numel"], WORLD) // WORLD and p["element_size"] == FP32


def _kind(snapshot: dict, kind: str) -> dict:
    c = snapshot[kind]
    assert c["send_inter"] == c["recv_inter"] and c["send_intra"] == c["recv_intra"]
    return {"inter": int(c["recv_inter"]), "intra": int(c["recv_intra"])}


def test_hpz_inter_node_bytes_match_zeropp_prediction_exactly(measured):
    exp = expected_bytes(llama_param_numels(**SHAPE))
    z3 = measured["zero3_cpu"]["per_step"]
    hpz = measured["zero3_hpz_cpu"]["per_step"]
    assert len(z3) == len(hpz) == STEPS
    report = []
    for step in range(2, STEPS):  # steady state (steps 1-2 carry DeepSpeed's one-off trace-validation broadcasts)
        for name, snap in (("zero3", z3[step]), ("hpz", hpz[step])):
            for kind in ("all_gather", "reduce_scatter"):
                got = _kind(snap, kind)
                report.append(f"step {step + 1} {name:5s} {kind:14s} expected {exp[name][kind]} measured {got}")
                assert got == exp[name][kind], "\n".join(report)
        # hpZ leaves the small all-reduces (gradient norm) as they are.
        assert z3[step]["all_reduce"] == hpz[step]["all_reduce"]
        z3_total = sum(c["recv_inter"] for c in z3[step].values())
        hpz_total = sum(c["recv_inter"] for c in hpz[step].values())
        # The prediction: hpZ saves exactly the backward all-gather's inter-node bytes, (W-k) * aligned bytes.
        assert z3_total - hpz_total == (WORLD - PER_NODE) * exp["aligned_bytes"]
        report.append(f"step {step + 1} total inter-node bytes: zero3 {z3_total:.0f}, hpz {hpz_total:.0f}, "
                      f"ratio {hpz_total / z3_total:.4f}")
    first = hpz[0]
    for kind in ("all_gather", "reduce_scatter"):
        assert _kind(first, kind) == exp["hpz_step1"][kind]
    print("\n" + "\n".join(report))


def test_hierarchical_gradients_halve_inter_node_gradient_bytes_exactly(measured):
    """hpZ + hpz.grad_reduce=hierarchical: the gradients' inter-node bytes are exactly the prediction, and at most
    half (here, for 2 nodes with hpZ = ranks per node: exactly half) of ZeRO-3's; the parameter gathers are hpZ's."""
    exp = expected_bytes(llama_param_numels(**SHAPE))
    z3 = measured["zero3_cpu"]["per_step"]
    hier = measured[HIER]["per_step"]
    assert len(hier) == STEPS
    report = []
    for step in range(2, STEPS):
        snap = hier[step]
        others = {kind: c["recv_inter"] for kind, c in snap.items()
                  if kind not in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")}
        assert not any(others.values()), others
        for kind in ("all_gather", "reduce_scatter", "all_to_all"):
            got = _kind(snap, kind)
            report.append(f"step {step + 1} hier  {kind:14s} expected {exp['hpz_hier'][kind]} measured {got}")
            assert got == exp["hpz_hier"][kind], "\n".join(report)
        gradients = _kind(snap, "reduce_scatter")["inter"] + _kind(snap, "all_to_all")["inter"]
        zero3_gradients = _kind(z3[step], "reduce_scatter")["inter"]
        assert gradients * 2 <= zero3_gradients
        assert gradients == (WORLD - PER_NODE) * exp["aligned_bytes"] // HPZ
        assert z3[step]["all_reduce"] == snap["all_reduce"]
        total = sum(c["recv_inter"] for c in snap.values())
        z3_total = sum(c["recv_inter"] for c in z3[step].values())
        report.append(f"step {step + 1} inter-node gradient bytes: zero3 {zero3_gradients}, hierarchical {gradients}; "
                      f"all inter-node bytes: zero3 {z3_total:.0f}, hpz + hierarchical {total:.0f} "
                      f"(ratio {total / z3_total:.4f})")
    print("\n" + "\n".join(report))
