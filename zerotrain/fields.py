"""Declaring config fields: the range of values each numeric field accepts, beside the field, checked by one walker.

A component's config section is a dataclass, used as an OmegaConf structured config: OmegaConf itself rejects an
unknown key, a value of the wrong type and, for an ``Enum`` field, a value that is not one of its members. What a
type cannot say (a learning rate is not negative, Adam takes two betas, an interval is not negative) is declared
with :func:`bounded` on the field's own line and checked, for every section at once, by :func:`check_ranges`::

    lr: float = bounded(3e-4, ge=0)
    \"\"\"Peak learning rate; the schedule multiplies it.\"\"\"
    betas: list[float] = bounded(factory=lambda: [0.9, 0.95], length=2, ge=0, lt=1)
    \"\"\"Adam's (beta1, beta2).\"\"\"

Every numeric field declares a range (``tests/test_config.py`` walks the schema and fails on one that does not),
so a new field cannot forget to. The field's docstring (the string literal under it) says what it is for.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerotrain.errors import ConfigError

RANGE = "zerotrain.range"  # the key of a field's Range in its dataclass metadata


@dataclass(frozen=True)
class Range:
    """Bounds on a number (or on every number of a list), and the length of a list."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    length: int | None = None  # a list of exactly this many items
    min_length: int | None = None  # a list of at least this many items
    hint: str | None = None  # what to do about a value out of range, appended to the message

    def describe(self) -> str:
        """The valid values in words, e.g. ``>= 1``, ``in [0, 1)``."""
        low = (f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None)
        high = (f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None)
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f"{'>=' if self.ge is not None else '>'} {low[1:]}"
        if high:
            return f"{'<=' if self.le is not None else '<'} {high[:-1]}"
        return "any number"

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    @property
    def bounds_numbers(self) -> bool:
        return any(b is not None for b in (self.ge, self.gt, self.le, self.lt))


def _num(bound: float) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


def bounded(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | Any = dataclasses.MISSING,
            ge: float | None = None, gt: float | None = None, le: float | None = None,
            lt: float | None = None, length: int | None = None, min_length: int | None = None,
            hint: str | None = None) -> Any:
    """A dataclass field with a declared range: ``bounded(1, ge=1)``, ``bounded(factory=list, min_length=1)``.

    ``None`` (an optional field left unset) is always accepted; bounds on a list apply to each of its items.
    """
    spec = Range(ge=ge, gt=gt, le=le, lt=lt, length=length, min_length=min_length, hint=hint)
    return dataclasses.field(default=default, default_factory=factory, metadata={RANGE: spec})


def declared_range(f: dataclasses.Field) -> Range | None:
    return f.metadata.get(RANGE)


def range_problem(spec: Range, value: Any) -> str | None:
    """Why ``value`` is outside ``spec`` (None if it is inside), phrased to follow ``key=value``."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if spec.length is not None and len(value) != spec.length:
            return f"has {len(value)} item(s); it must have exactly {spec.length}"
        if spec.min_length is not None and len(value) < spec.min_length:
            return f"has {len(value)} item(s); it must have at least {spec.min_length}"
        bad = [(i, v) for i, v in enumerate(value) if spec.bounds_numbers and not spec.contains(v)]
        if bad:
            i, v = bad[0]
            return f"is out of range: item {i} ({v!r}) must be {spec.describe()}"
        return None
    if spec.bounds_numbers and not spec.contains(value):
        return f"is out of range: it must be {spec.describe()}"
    return None


def check_ranges(section: Any, prefix: str = "") -> None:
    """Check every bounded field of a dataclass instance, nested sections and lists of sections included.

    Raises :class:`ConfigError` naming the first key out of range, its value and the valid range.
    """
    for f in dataclasses.fields(section):
        key, value = f"{prefix}{f.name}", getattr(section, f.name)
        spec = declared_range(f)
        problem = range_problem(spec, value) if spec else None
        if problem:
            assert spec is not None  # a problem comes from a declared range
            raise ConfigError(f"{key}={_show(value)} {problem}" + (f": {spec.hint}" if spec.hint else ""))
        if dataclasses.is_dataclass(value):
            check_ranges(value, f"{key}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    check_ranges(item, f"{key}.{i}.")


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return str(value)
