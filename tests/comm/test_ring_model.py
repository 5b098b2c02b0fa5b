"""The ring model (zerotrain.comm_model), ``hpz.grad_reduce=auto``'s choice, and the accounting's ring-model count on
fake layouts (no processes)."""

from __future__ import annotations

import math

import pytest
import torch

from test_comm_bytes import accountants  # the same per-rank accountants over hand-made groups

from zerotrain import comm_accounting, comm_model, ring_collectives
from zerotrain.comm_model import Shape
from zerotrain.distributed import Collectives


def test_flat_vs_hierarchical_is_w_minus_1_over_w_against_n_minus_1_over_n():
    for nodes, k, saving in ((2, 2, 1.5), (2, 8, 1.875), (4, 8, 31 / 32 / 0.75)):
        s = Shape(nodes, k, k)
        assert comm_model.flat(s, 1) == pytest.approx((s.world - 1) / s.world)
        assert comm_model.hierarchical(s, 1) == pytest.approx((nodes - 1) / nodes)
        assert comm_model.flat(s, 1) / comm_model.hierarchical(s, 1) == pytest.approx(saving)
    assert comm_model.flat(Shape(4, 8, 8), 1) / comm_model.hierarchical(Shape(4, 8, 8), 1) == pytest.approx(1.29,
                                                                                                           abs=5e-3)


def test_step_totals_on_2x2_fp32():
    """ZeRO-3 2.25 S, hpZ 1.5 S, hpZ + hierarchical 1.25 S per node and step: 1.5x and 1.8x, not 1.33x / 2.40x."""
    s = Shape(2, 2, 2)
    assert [comm_model.step(s, v, 1.0) for v in ("zero3", "hpz", "hpz-hier")] == pytest.approx([2.25, 1.5, 1.25])


def test_hpz_4_on_8_rank_nodes_saves_with_a_ring_stage_2_and_loses_with_an_all_to_all():
    s = Shape(2, 8, 4)
    assert comm_model.hierarchical(s, 1, "ring") == pytest.approx(0.75)  # m = 4 groups
    assert comm_model.hierarchical(s, 1, "all_to_all") == pytest.approx(1.0)  # 2 groups per node, both send
    assert comm_model.flat(s, 1) == pytest.approx(15 / 16)


def test_auto_is_hierarchical_only_where_it_sends_fewer():
    assert comm_model.choose("auto", Shape(2, 2, 2)).mode == "hierarchical"
    assert comm_model.choose("auto", Shape(2, 8, 4), "ring").mode == "hierarchical"
    assert comm_model.choose("auto", Shape(2, 8, 4), "all_to_all").mode == "flat"  # 1.0 B > 0.9375 B
    assert comm_model.choose("auto", Shape(1, 4, 4)).mode == "flat"  # one node: nothing to save
    assert comm_model.choose("auto", Shape(2, 2, 1)).mode == "flat"  # no hpZ group
    choice = comm_model.choose("auto", Shape(2, 8, 8))
    assert choice.saving == pytest.approx(1.875) and "1.88x" in choice.describe()
    assert choice.warning is None


def test_explicit_hierarchical_that_sends_more_warns_with_the_numbers():
    choice = comm_model.choose("hierarchical", Shape(4, 8, 4), "all_to_all")
    assert choice.mode == "hierarchical"  # asked for explicitly: honoured
    assert "1.5000 vs 0.9688" in choice.warning and "4 node(s) x 8 ranks with hpZ 4" in choice.warning
    assert comm_model.choose("hierarchical", Shape(4, 8, 4), "ring").warning is None  # control: it saves
    assert comm_model.choose("flat", Shape(4, 8, 4), "all_to_all").warning is None


def test_grad_reduce_choose_without_an_hpz_group_stays_flat():
    from zerotrain.hpz import grad_reduce

    assert grad_reduce.choose("auto", 2, 2, 1).mode == "flat"
    with pytest.raises(ValueError, match="resolved"):
        grad_reduce.set_mode("auto")


def test_collectives_enum_and_modes_agree_and_auto_means_ring_on_the_emulated_cluster():
    assert tuple(Collectives) == ring_collectives.MODES
    assert ring_collectives.resolve("auto", {"ZT_EMULATED_NNODES": "2"}) == "ring"
    assert ring_collectives.resolve("auto", {}) == "native"
    assert ring_collectives.resolve("native", {"ZT_EMULATED_NNODES": "2"}) == "native"
    with pytest.raises(ValueError, match="cluster.collectives"):
        ring_collectives.resolve("tree")


class FakeGroup:
    pass


def _ring_per_node(accs, nodes):
    return sum(sum(a.ring.values()) for a in accs) / nodes


def test_accounting_ring_model_matches_the_closed_form():
    """A flat reduce-scatter and all-gather of a 4 KiB buffer over 2x4 node-contiguous ranks, and the hierarchical
    stages (hpZ 4: reduce-scatter inside the node, then over the same-local-rank pairs) count what comm_model says."""
    names = ["a"] * 4 + ["b"] * 4
    world, node_a, node_b = FakeGroup(), FakeGroup(), FakeGroup()
    pairs = [FakeGroup() for _ in range(4)]
    groups = {world: list(range(8)), node_a: [0, 1, 2, 3], node_b: [4, 5, 6, 7],
              **{p: [i, 4 + i] for i, p in enumerate(pairs)}}
    nbytes = 4096
    full, part = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4 // 8)
    accs = accountants(names, groups)
    for acc in accs:
        acc.record("reduce_scatter_tensor", (), {"output_tensor": part, "input_tensor": full, "group": world})
    assert _ring_per_node(accs, 2) == pytest.approx(comm_model.flat(Shape(2, 4, 4), nbytes))  # 7/8 B
    logical = sum(a.counters["reduce_scatter"][4] for a in accs) / 2
    assert logical == pytest.approx(4 * (4 / 8) * nbytes)  # the logical count: k (W-k)/W B per node

    accs = accountants(names, groups)
    for rank, acc in enumerate(accs):
        acc.record("all_gather_into_tensor", (), {"output_tensor": full, "input_tensor": part, "group": world})
    assert _ring_per_node(accs, 2) == pytest.approx(comm_model.flat(Shape(2, 4, 4), nbytes))

    accs = accountants(names, groups)
    quarter, eighth = torch.zeros(nbytes // 4 // 4), torch.zeros(nbytes // 4 // 8)
    for rank, acc in enumerate(accs):
        acc.record("reduce_scatter_tensor", (), {"output_tensor": quarter, "input_tensor": full,
                                                 "group": node_a if rank < 4 else node_b})
        acc.record("reduce_scatter_tensor", (), {"output_tensor": eighth, "input_tensor": quarter,
                                                 "group": pairs[rank % 4]})
    assert _ring_per_node(accs, 2) == pytest.approx(comm_model.hierarchical(Shape(2, 4, 4), nbytes, "ring"))


def test_accounting_ring_model_of_all_reduce_broadcast_all_to_all():
    names = ["a", "a", "b", "b"]
    world = FakeGroup()
    accs = accountants(names, {world: [0, 1, 2, 3]})
    for acc in accs:
        acc.record("all_reduce", (torch.zeros(8),), {"group": world})  # 32 B: each rank sends 2*3/4*32 = 48
    assert _ring_per_node(accs, 2) == pytest.approx(48)  # ranks 1 and 3 have off-node successors: 96 / 2
    accs = accountants(names, {world: [0, 1, 2, 3]})
    for acc in accs:
        acc.record("broadcast", (), {"tensor": torch.zeros(5), "src": 0, "group": world})
    assert _ring_per_node(accs, 2) == pytest.approx(20 / 2)  # 0->1->2->3: only rank 1's hop leaves a node
    accs = accountants(names, {world: [0, 1, 2, 3]})
    for acc in accs:
        acc.record("all_to_all_single", (), {"output": torch.zeros(8), "input": torch.zeros(8), "group": world,
                                             "output_split_sizes": None, "input_split_sizes": None})
    assert _ring_per_node(accs, 2) == pytest.approx(4 * 2 * 8 / 2)  # straight to the 2 off-node peers


def test_metrics_record_reports_per_node_ring_bytes_beside_the_logical_count():
    snap = {"reduce_scatter": {"calls": 4, "send_intra": 4, "send_inter": 8, "recv_intra": 4, "recv_inter": 8,
                               comm_accounting.RING_FIELD: 6}}
    rec = comm_accounting.metrics_record(snap, steps=1, nodes=2)
    assert rec["comm/inter_node_bytes_per_node"] == 4.0 and rec["comm/ring_inter_node_bytes_per_node"] == 3.0
    assert rec["comm/reduce_scatter/ring_inter_node_bytes_per_node"] == 3.0
    assert "comm/ring_inter_node_bytes_per_node" not in comm_accounting.metrics_record(snap, steps=1)
    assert not math.isnan(rec["comm/inter_node_bytes"])


def test_untested_deepspeed_is_refused_naming_both_versions(monkeypatch):
    import deepspeed

    from zerotrain.hpz import grad_reduce

    grad_reduce.check_version()  # the pinned one: accepted (the control)
    monkeypatch.setattr(deepspeed, "__version__", "0.19.9")
    with pytest.raises(grad_reduce.GradReduceConfigError, match=r"tested with deepspeed 0\.19\.8; deepspeed 0\.19\.9"):
        grad_reduce.check_version()


def test_a_renamed_deepspeed_argument_names_the_version_not_a_key_error():
    from zerotrain.hpz import grad_reduce

    arguments = grad_reduce._Arguments({"zero_hpz_partition_size": 2})
    assert arguments["zero_hpz_partition_size"] == 2
    with pytest.raises(grad_reduce.GradReduceConfigError, match=r"'reduce_scatter', which deepspeed \S+ does not"):
        arguments["reduce_scatter"]
