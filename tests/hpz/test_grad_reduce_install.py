"""``hpz.install(grad_reduce=...)`` bookkeeping and the ``hpz.grad_reduce`` config key (single process).

The reduction itself, its refusals and its numbers run on 4 ranks in ``tests/comm/test_grad_reduce.py``.
"""

from __future__ import annotations

import pytest
from deepspeed.runtime.comm import coalesced_collectives
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from zerotrain import hpz
from zerotrain.config import ConfigError
from zerotrain.hpz import grad_reduce
from zerotrain.run_config import parse_args

GRAD_REDUCE_PATCHES = [
    (coalesced_collectives, "_torch_reduce_scatter_fn"),
    (DeepSpeedZeroOptimizer_Stage3, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"),
    (DeepSpeedZeroOptimizer_Stage3, "__init__"),
    (DeepSpeedZeroOptimizer, "__init__"),
]


def own(owner, name):
    return vars(owner).get(name)


@pytest.fixture(autouse=True)
def clean():
    hpz.uninstall()
    yield
    hpz.uninstall()


def test_flat_patches_nothing_of_the_gradient_path():
    before = [own(o, n) for o, n in GRAD_REDUCE_PATCHES]
    hpz.install()
    assert grad_reduce.get_mode() == "flat"
    assert [own(o, n) for o, n in GRAD_REDUCE_PATCHES] == before


def test_hierarchical_patches_the_gradient_path_and_uninstall_restores_it_identically():
    before = {(o, n): own(o, n) for o, n in GRAD_REDUCE_PATCHES}
    hpz.install(grad_reduce="hierarchical")
    assert grad_reduce.get_mode() == "hierarchical"
    patched = {(o, n) for o, n, _ in hpz.patched_attributes()}
    for key, original in before.items():
        assert key in patched and own(*key) is not original, key[1]
    first = {key: own(*key) for key in before}
    hpz.install(grad_reduce="flat")  # back to flat: the wrappers stay (pass-through), nothing is wrapped twice
    hpz.install(grad_reduce="hierarchical")
    assert {key: own(*key) for key in before} == first
    hpz.uninstall()
    assert grad_reduce.get_mode() == "flat"
    for key, original in before.items():
        assert own(*key) is original, f"{key[1]} not restored"


def test_changing_the_fixes_reapplies_the_gradient_patches():
    hpz.install(grad_reduce="hierarchical")
    hpz.install(grad_reduce="hierarchical", disable_fixes=("stale",))  # a new PatchSet underneath
    patched = {(o, n) for o, n, _ in hpz.patched_attributes()}
    assert set(GRAD_REDUCE_PATCHES) <= patched


def test_unknown_grad_reduce_is_rejected_before_anything_is_installed():
    with pytest.raises(ValueError, match="unknown hpz grad_reduce 'tree'"):
        hpz.install(grad_reduce="tree")
    assert not hpz.is_installed()


def test_config_key_and_its_choices():
    assert parse_args(["recipe=tiny_llama"]).hpz.grad_reduce == "flat"
    assert parse_args(["recipe=tiny_llama", "hpz.grad_reduce=hierarchical"]).hpz.grad_reduce == "hierarchical"
    with pytest.raises(ConfigError, match="hierarchical"):
        parse_args(["recipe=tiny_llama", "hpz.grad_reduce=tree"])
