"""Node layout checks and zero_hpz_partition_size resolution, on fake gathered node lists."""

import pytest

from zerotrain.launch.layout import (
    LayoutError,
    layout_from_node_names,
    resolve_hpz_partition_size,
    resolve_zero_config,
)

TWO_BY_TWO = ["node1", "node1", "node2", "node2"]
FOUR_BY_EIGHT = [f"gpu{n:02d}" for n in range(1, 5) for _ in range(8)]


def test_contiguous_layout_describes_nodes_and_ranks():
    layout = layout_from_node_names(FOUR_BY_EIGHT)
    assert (layout.world_size, layout.num_nodes, layout.ranks_per_node) == (32, 4, 8)
    assert layout.nodes == ["gpu01", "gpu02", "gpu03", "gpu04"]
    assert layout.node_index[7] == 0 and layout.node_index[8] == 1 and layout.node_index[31] == 3
    assert list(layout.ranks_on_node(2)) == list(range(16, 24))
    assert layout.same_node(8, 15) and not layout.same_node(7, 8)


def test_node_index_follows_rank_order_not_names():
    layout = layout_from_node_names(["b", "b", "a", "a"])
    assert layout.nodes == ["b", "a"] and layout.node_index == (0, 0, 1, 1)


def test_cyclic_distribution_is_rejected():
    with pytest.raises(LayoutError, match="not node-contiguous.*rank 1 runs on node2"):
        layout_from_node_names(["node1", "node2", "node1", "node2"])


def test_node_returning_later_is_rejected():
    with pytest.raises(LayoutError, match="not node-contiguous"):
        layout_from_node_names(["a", "a", "b", "b", "a", "a", "b", "b"])


def test_uneven_nodes_are_rejected():
    with pytest.raises(LayoutError, match="different numbers of ranks: node1: 3, node2: 1"):
        layout_from_node_names(["node1", "node1", "node1", "node2"])


def test_auto_is_ranks_per_node():
    assert resolve_hpz_partition_size("auto", layout_from_node_names(FOUR_BY_EIGHT)) == 8
    assert resolve_hpz_partition_size("auto", layout_from_node_names(TWO_BY_TWO)) == 2
    assert resolve_hpz_partition_size("auto", layout_from_node_names(["solo"])) == 1


@pytest.mark.parametrize("size", [1, 2, 4, 8, "4"])
def test_divisors_of_ranks_per_node_are_valid(size):
    assert resolve_hpz_partition_size(size, layout_from_node_names(FOUR_BY_EIGHT)) == int(size)


def test_size_not_dividing_world_is_an_error():
    with pytest.raises(LayoutError, match="does not divide the world size 32"):
        resolve_hpz_partition_size(3, layout_from_node_names(FOUR_BY_EIGHT))


@pytest.mark.parametrize("size", [16, 32])
def test_groups_spanning_nodes_are_an_error(size):
    with pytest.raises(LayoutError, match="cross node boundaries"):
        resolve_hpz_partition_size(size, layout_from_node_names(FOUR_BY_EIGHT))


def test_size_dividing_world_but_straddling_nodes_is_an_error():
    # 3 nodes x 4 ranks, hpZ 6 divides 12 but group [0..5] spans node 0 and node 1
    layout = layout_from_node_names([n for n in "abc" for _ in range(4)])
    with pytest.raises(LayoutError, match="cross node boundaries"):
        resolve_hpz_partition_size(6, layout)


@pytest.mark.parametrize("value", [0, -2, "big", 2.5j])
def test_nonsense_sizes_are_errors(value):
    with pytest.raises(LayoutError):
        resolve_hpz_partition_size(value, layout_from_node_names(TWO_BY_TWO))


def test_hpz_groups_are_intra_node():
    import dataclasses

    layout = dataclasses.replace(layout_from_node_names(FOUR_BY_EIGHT), hpz_size=4)
    assert layout.hpz_groups[:3] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(layout.is_intra_node(g) for g in layout.hpz_groups) and len(layout.hpz_groups) == 8


def test_zero_section_resolved_without_touching_other_keys():
    zero = {"stage": 3, "zero_hpz_partition_size": "auto", "zero_quantized_weights": True}
    resolved = resolve_zero_config(zero, layout_from_node_names(TWO_BY_TWO))
    assert resolved == {"stage": 3, "zero_hpz_partition_size": 2, "zero_quantized_weights": True}
    assert zero["zero_hpz_partition_size"] == "auto"  # a copy
    assert resolve_zero_config({"stage": 3}, layout_from_node_names(TWO_BY_TWO)) == {"stage": 3}


def test_size_larger_than_a_single_node_world_is_clamped():
    assert resolve_hpz_partition_size(2, layout_from_node_names(["solo"])) == 1
    assert resolve_hpz_partition_size(8, layout_from_node_names(["a"] * 4)) == 4
    with pytest.raises(LayoutError, match="does not divide the world size 4"):  # two nodes: never clamped
        resolve_hpz_partition_size(8, layout_from_node_names(TWO_BY_TWO))
