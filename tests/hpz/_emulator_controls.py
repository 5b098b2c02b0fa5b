"""Deliberately broken variants of ``ordered``: negative controls the emulator must catch.

Each wraps a real function of :mod:`zerotrain.hpz.ordering` and breaks exactly one
ordering rule; the tests install them with ``monkeypatch`` (unit tests) or a
context manager (the 4-rank worker):

* ``event_before_copy``: the copy event is recorded before the copy is enqueued;
* ``event_wrong_stream``: recorded after the copy, but on a stream that did not copy;
* ``skip_one_wait``: the all-gather never waits for one parameter's shard, the one
  released last (a stream-level wait on an earlier event cannot cover it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deepspeed.accelerator import get_accelerator

from zerotrain.hpz import ordering

CONTROLS = ("event_before_copy", "event_wrong_stream", "skip_one_wait")


def _replacing_copy_events(build: Callable, event_after: Callable[[Any], Any]) -> Callable:
    """A shard builder that replaces every copy event it records with ``event_after(early_event)``."""

    def builder(init, param, has_been_updated=False, fallback=None):
        before = getattr(param.ds_secondary_tensor, ordering.EVENT_ATTR, None)
        early = get_accelerator().Event()
        early.record()  # before the copy is enqueued
        build(init, param, has_been_updated=has_been_updated, fallback=fallback)
        event = getattr(param.ds_secondary_tensor, ordering.EVENT_ATTR, None)
        if event is not None and event is not before:  # a copy was enqueued just now
            setattr(param.ds_secondary_tensor, ordering.EVENT_ATTR, event_after(early))

    return builder


def event_before_copy(build: Callable) -> Callable:
    return _replacing_copy_events(build, lambda early: early)


def event_wrong_stream(build: Callable) -> Callable:
    accel = get_accelerator()
    side = accel.Stream(name="wrong")

    def on_side(early):
        event = accel.Event()
        event.record(side)
        return event

    return _replacing_copy_events(build, on_side)


def skip_one_wait(before_read: Callable) -> Callable:
    """No wait for one parameter's shard: the highest ds_id read so far (in Llama the lm_head, released
    last in forward -- no other shard's event is recorded after its copy, so no other wait covers it)."""
    highest = [-1]

    def reader_hook(readers, allgather_stream, forward=True):
        highest[0] = max([highest[0]] + [p.ds_id for p in readers])
        before_read([p for p in readers if p.ds_id != highest[0]], allgather_stream, forward)

    return reader_hook


def target(control: str) -> str:
    """The name in :mod:`zerotrain.hpz.ordering` the control replaces."""
    return "before_secondary_read" if control == "skip_one_wait" else "build_secondary_shard"


def wrap(control: str, original: Callable) -> Callable:
    return {"event_before_copy": event_before_copy, "event_wrong_stream": event_wrong_stream,
            "skip_one_wait": skip_one_wait}[control](original)
