"""The one version gate every run-time change to DeepSpeed goes through (zerotrain.ds_patches): hpZ's is tested in
tests/hpz/test_hpz_install.py; here the gate itself and the universal-load repair, which must refuse before it
touches an optimizer whose DeepSpeed it was not written for."""

from __future__ import annotations

import deepspeed
import pytest

from zerotrain import ds_patches
from zerotrain.checkpoint import universal


def test_the_pinned_deepspeed_passes_the_gate():
    assert ds_patches.require_supported("x", "y", "z") == deepspeed.__version__ == ds_patches.PINNED_DEEPSPEED


@pytest.mark.parametrize("version", ["0.18.9", "0.20.0", "garbage"])
def test_another_deepspeed_is_refused_naming_the_component_and_the_way_out(monkeypatch, version):
    monkeypatch.setattr(deepspeed, "__version__", version)
    with pytest.raises(ds_patches.DeepSpeedVersionError) as err:
        ds_patches.require_supported("zerotrain.thing", "its internals", "do without it")
    message = str(err.value)
    assert "zerotrain.thing" in message and version in message and ds_patches.SUPPORTED_DEEPSPEED in message
    assert "install deepspeed==0.19.8 or do without it" in message


def test_the_universal_load_repair_refuses_another_deepspeed_before_reading_anything(monkeypatch, tmp_path):
    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    with pytest.raises(ds_patches.DeepSpeedVersionError, match="load_hp_checkpoint_state_from_checkpoint_dir_stage3"):
        universal.repair(engine=None, universal=tmp_path)  # nothing at tmp_path: the gate comes first
    monkeypatch.setattr(deepspeed, "__version__", ds_patches.PINNED_DEEPSPEED)
    with pytest.raises(FileNotFoundError):  # negative control: the pinned version goes on to read the copy
        universal.repair(engine=None, universal=tmp_path)
