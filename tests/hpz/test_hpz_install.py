"""install/uninstall bookkeeping, idempotence, version check (single process, no distributed)."""

from __future__ import annotations

import deepspeed
import pytest
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.partition_parameters import Init
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.utils import groups as ds_groups
from transformers import PreTrainedModel

from zerotrain import hpz

# Every attribute the module may replace. The test fails if install() patches anything not listed.
EXPECTED = [
    (Init, "_partition_param_sec"),
    (PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__all_gather_params_"),
    (DeepSpeedZeroOptimizer_Stage3, "_post_step"),
    (ds_groups, "_create_zero_param_parallel_group"),
    (ds_groups, "_get_zero_param_intra_parallel_group"),
    (DeepSpeedEngine, "_configure_zero_optimizer"),
    (DeepSpeedEngine, "_set_zero_group_parallelism"),
    (DeepSpeedEngine, "load_checkpoint"),
    (DeepSpeedEngine, "load_module_state_dict"),
    (PreTrainedModel, "resize_token_embeddings"),
]
_ABSENT = object()


def own(owner, name):
    return vars(owner).get(name, _ABSENT)


@pytest.fixture(autouse=True)
def clean():
    hpz.uninstall()
    yield
    hpz.uninstall()


def test_uninstall_restores_every_patched_attribute_identically():
    before = {(o, n): own(o, n) for o, n in EXPECTED}
    assert before[(DeepSpeedEngine, "_set_zero_group_parallelism")] is _ABSENT  # the eval-engine defect
    hpz.install()
    patched = {(o, n) for o, n, _ in hpz.patched_attributes()}
    assert patched == set(before), "install() patches something this test does not check"
    for key, original in before.items():
        assert own(*key) is not original, f"{key[1]} not patched"
    hpz.uninstall()
    for key, original in before.items():
        assert own(*key) is original, f"{key[1]} not restored to the original object"
    assert hpz.active_mode() == "off" and not hpz.is_installed()


def test_install_twice_is_harmless_and_reconfigures_mode():
    hpz.install(mode="ordered")
    first = {(o, n): own(o, n) for o, n in EXPECTED}
    hpz.install(mode="ordered")
    assert {(o, n): own(o, n) for o, n in EXPECTED} == first  # same objects, not wrapped twice
    hpz.install(mode="sync", verify=True)
    assert hpz.active_mode() == "sync" and hpz.verify_enabled()
    assert {(o, n): own(o, n) for o, n in EXPECTED} == first
    hpz.uninstall()
    hpz.uninstall()  # twice: still harmless
    assert own(Init, "_partition_param_sec") is not first[(Init, "_partition_param_sec")]


def test_disabling_a_fix_then_enabling_it_reinstalls_cleanly():
    original = own(DeepSpeedEngine, "load_checkpoint")
    hpz.install(disable_fixes=("stale", "eval_engine"))
    assert own(DeepSpeedEngine, "load_checkpoint") is original
    assert own(DeepSpeedEngine, "_set_zero_group_parallelism") is _ABSENT
    hpz.install()
    assert own(DeepSpeedEngine, "load_checkpoint") is not original
    hpz.uninstall()
    assert own(DeepSpeedEngine, "load_checkpoint") is original


@pytest.mark.parametrize("mode", ["stock", "legacy"])
def test_racy_modes_warn_loudly(mode):
    with pytest.warns(RuntimeWarning, match="RACY"):
        hpz.install(mode=mode)
    assert hpz.active_mode() == mode


def test_bad_mode_rejected():
    with pytest.raises(ValueError, match="unknown hpZ mode"):
        hpz.install(mode="fast")
    assert not hpz.is_installed()


@pytest.mark.parametrize("version", ["0.13.4", "0.20.0", "1.0.0", "garbage"])
def test_version_outside_supported_range_is_refused(monkeypatch, version):
    monkeypatch.setattr(deepspeed, "__version__", version)
    with pytest.raises(hpz.HpzVersionError) as err:
        hpz.install()
    message = str(err.value)
    assert version in message and hpz.SUPPORTED_DEEPSPEED in message and "0.19.8" in message
    assert not hpz.is_installed()


def test_pinned_version_is_supported():
    assert deepspeed.__version__.startswith("0.19.")
    hpz.install()
    assert hpz.active_mode() == "ordered"


def test_counters_snapshot_and_reset():
    hpz.reset_counters()
    snap = hpz.counters()
    for name in ("events_recorded", "waits_issued", "host_syncs", "shards_built", "shards_read", "verify_checks",
                 "device_ordered_copies", "source_record_streams", "legacy_unwritten_elements"):
        assert snap[name] == 0


def test_uninstall_turns_verification_off_for_the_next_install_and_the_reader_hook():
    """Found when the suite ran on two workers (another order of tests in one process): verify stayed on after an
    uninstall, and the next test's reader hook verified shards of parameters that had no process group."""
    hpz.install(mode="sync", verify=True)
    hpz.uninstall()
    assert not hpz._verify and not hpz.verify_enabled()
    hpz.install(mode="ordered")
    assert not hpz.verify_enabled()
    hpz.uninstall()
