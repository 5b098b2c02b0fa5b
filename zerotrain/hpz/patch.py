"""Install/uninstall bookkeeping for run-time patches.

We never edit DeepSpeed's files; we replace a handful of attributes on its
classes and modules. :class:`PatchSet` remembers the exact original object of
every attribute it replaces (looked up in the owner's own ``__dict__``, so an
inherited attribute is recorded as "absent" rather than copied down) and puts
it back on :meth:`PatchSet.restore`, so uninstalling leaves DeepSpeed exactly as
it was: ``getattr(owner, name) is original`` for every patched attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List

_ABSENT = object()  # marker: the owner did not define the attribute itself


@dataclass
class _Record:
    owner: Any
    name: str
    original: Any  # the raw __dict__ entry (keeps staticmethod/classmethod wrappers) or _ABSENT


class PatchSet:
    """An ordered list of attribute replacements that can be undone exactly."""

    def __init__(self) -> None:
        self._records: List[_Record] = []
        # Arbitrary undo callbacks (e.g. removing hooks registered on live modules).
        self._undo: List[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._records)

    def original(self, owner: Any, name: str) -> Any:
        """The attribute as DeepSpeed defined it (bound lookups still work through the class)."""
        for rec in self._records:
            if rec.owner is owner and rec.name == name:
                return getattr(owner, name) if rec.original is _ABSENT else rec.original
        return getattr(owner, name)

    def replace(self, owner: Any, name: str, new: Any) -> Any:
        """Set ``owner.name = new`` and return the previous attribute value (for wrapping)."""
        if any(rec.owner is owner and rec.name == name for rec in self._records):
            raise RuntimeError(f"{owner!r}.{name} patched twice in one PatchSet")
        raw = vars(owner).get(name, _ABSENT)
        previous = getattr(owner, name, None)
        self._records.append(_Record(owner, name, raw))
        setattr(owner, name, new)
        return previous

    def on_restore(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def records(self) -> List[tuple]:
        """(owner, name, original) for every patch; ``original`` is None when the owner lacked it."""
        return [(r.owner, r.name, None if r.original is _ABSENT else r.original) for r in self._records]

    def restore(self) -> None:
        """Undo everything, newest first."""
        for fn in reversed(self._undo):
            fn()
        self._undo.clear()
        for rec in reversed(self._records):
            if rec.original is _ABSENT:
                if rec.name in vars(rec.owner):
                    delattr(rec.owner, rec.name)
            else:
                setattr(rec.owner, rec.name, rec.original)
        self._records.clear()
