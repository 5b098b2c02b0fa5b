"""Changes made at run time to pinned DeepSpeed: the version range they are written against, and their exact undo.

We never edit DeepSpeed's files; we replace a handful of attributes on its classes, modules and objects, or repair
what one of its functions left behind. Each of those depends on DeepSpeed internals that change between releases,
so each user checks :func:`require_supported` first and installs through a :class:`PatchSet`:

* :mod:`zerotrain.hpz` (the hpZ shard ordering, groups, stale-shard hooks, hierarchical gradient reduce);
* :mod:`zerotrain.comm_accounting` and :mod:`zerotrain.step_timing`, which observe ``deepspeed.comm``'s backend
  methods through one dispatcher per method (:func:`add_collective_hook`), never wrapping each other's wrappers;
* :func:`zerotrain.checkpoint.universal.repair` (what DeepSpeed's ZeRO-3 load of a universal checkpoint gets wrong);
* :func:`defer_import_time_compile` (an engine build importing all of ``torch._inductor`` for Muon's kernels).

:class:`PatchSet` remembers the exact original object of every attribute it replaces (looked up in the owner's own
``__dict__``, so an inherited attribute is recorded as "absent" rather than copied down) and puts it back on
:meth:`PatchSet.restore`, so uninstalling leaves DeepSpeed exactly as it was: ``getattr(owner, name) is original``
for every patched attribute.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from zerotrain.errors import ZerotrainError

SUPPORTED_DEEPSPEED = ">=0.19.0,<0.20"
PINNED_DEEPSPEED = "0.19.8"  # requirements.txt's pin, the version the patches are tested on

_ABSENT = object()  # marker: the owner did not define the attribute itself


class DeepSpeedVersionError(ZerotrainError, RuntimeError):
    """The installed DeepSpeed is outside the range a patch was written against."""


def require_supported(component: str, internals: str, alternative: str,
                      error: type[DeepSpeedVersionError] = DeepSpeedVersionError) -> str:
    """The installed DeepSpeed's version, when it is in :data:`SUPPORTED_DEEPSPEED`; otherwise ``error``, naming
    ``component``, the ``internals`` it depends on and the ``alternative`` to installing the pinned version."""
    import deepspeed
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    found = getattr(deepspeed, "__version__", "unknown")
    try:
        ok = Version(found) in SpecifierSet(SUPPORTED_DEEPSPEED)
    except InvalidVersion:
        ok = False
    if not ok:
        raise error(
            f"{component} supports deepspeed{SUPPORTED_DEEPSPEED} (pinned {PINNED_DEEPSPEED}) but deepspeed {found} "
            f"is installed. Its {internals} may differ; install deepspeed=={PINNED_DEEPSPEED} or {alternative}.")
    return found


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


# --------------------------------------------------------------------------- torch.compile at import, deferred

_compile_patch: Optional[PatchSet] = None


def defer_import_time_compile() -> None:
    """Make ``deepspeed.runtime.compiler.compile()`` decorate lazily: ``torch.compile`` is applied at a decorated
    function's first call instead of at its module's import.

    Every ZeRO engine build imports DeepSpeed's Muon module (``is_zero_supported_optimizer``, ZeRO-3's and ZeRO-1/2's
    constructors, to test ``isinstance(optimizer, MuonWithAuxAdam)``), and that module decorates three functions
    with ``@compiler.compile()``, DeepSpeed's only users of it. ``torch.compile`` compiles at the first call anyway,
    but builds its inductor wrapper at decoration, which imports all of ``torch._inductor`` (and networkx): measured
    2 CPU s per process, an eighth of a 2-step tiny run on 4 ranks, for functions that only a Muon optimizer calls.
    Deferred, a run that uses Muon gets the same compiled functions at their first call, one that does not never
    imports inductor. Call before the first engine build (``zerotrain.engine.initialize`` and the evaluation's
    ``Zero3Model`` do); idempotent, for the process."""
    global _compile_patch
    if _compile_patch is not None:
        return
    try:
        require_supported("defer_import_time_compile", "deepspeed.runtime.compiler.compile", "nothing")
    except DeepSpeedVersionError:
        return  # a speed-up only: another DeepSpeed builds its engines as it always did
    from deepspeed.runtime import compiler

    def compile():  # noqa: A001 -- DeepSpeed's name: ``@compiler.compile()``
        return _lazy_torch_compile

    patches = PatchSet()
    patches.replace(compiler, "compile", compile)
    _compile_patch = patches


def _lazy_torch_compile(fn: Optional[Callable] = None, **kwargs: Any) -> Any:
    """``torch.compile(fn, **kwargs)``, applied at the first call of ``fn``."""
    if fn is None:
        return functools.partial(_lazy_torch_compile, **kwargs)
    compiled: Optional[Callable] = None

    @functools.wraps(fn)
    def call(*args, **call_kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **kwargs)
        return compiled(*args, **call_kwargs)

    return call


# --------------------------------------------------------------------------- hooks on deepspeed.comm's backend

CollectiveHook = Callable[..., Any]
"""``hook(method, call, *args, **kwargs)``: runs the collective by calling ``call(*args, **kwargs)`` and returns its
result (an observer records around that call; it must not change the arguments or the result)."""

_hooks: dict[str, tuple[CollectiveHook, frozenset]] = {}  # owner -> (hook, methods), outermost first
_backend: Any = None  # the deepspeed.comm backend object the dispatchers are installed on
_backend_patches: Optional[PatchSet] = None


def add_collective_hook(owner: str, hook: CollectiveHook, methods: Iterable[str]) -> None:
    """Route every call of ``methods`` on deepspeed.comm's backend (``deepspeed.comm.comm.cdb``, the object every
    ``deepspeed.comm`` entry point ends in) through ``hook``, after ``deepspeed.init_distributed``.

    Each method is wrapped once, by one dispatcher that calls the hooks of every ``owner`` (comm accounting, step
    timing) nested in the order they were added (the first added outermost), so owners can be added and removed in
    any order without one undoing another's wrapper. Adding for an ``owner`` again replaces its hook."""
    global _backend, _backend_patches
    import deepspeed.comm.comm as ds_comm

    backend = ds_comm.cdb
    if backend is None:
        raise RuntimeError("deepspeed.comm is not initialised: call deepspeed.init_distributed first")
    if backend is not _backend:  # a new process group's backend: the old one's dispatchers go
        _remove_dispatchers()
    _hooks.pop(owner, None)
    _hooks[owner] = (hook, frozenset(methods))
    patches = _backend_patches or PatchSet()
    wrapped = {name for _, name, _ in patches.records()}
    for method in sorted(set().union(*(m for _, m in _hooks.values())) - wrapped):
        original = getattr(backend, method, None)
        if callable(original):  # an instance attribute shadowing the class's method: restoring deletes it again
            patches.replace(backend, method, _dispatcher(method, original))
    _backend, _backend_patches = backend, patches


def remove_collective_hook(owner: str) -> None:
    """Stop calling ``owner``'s hook; the last one removed restores the backend's methods. Harmless when absent."""
    _hooks.pop(owner, None)
    if not _hooks:
        _remove_dispatchers()


def _remove_dispatchers() -> None:
    global _backend, _backend_patches
    if _backend_patches is not None:
        _backend_patches.restore()
    _backend = _backend_patches = None


def _dispatcher(method: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        call = original
        for hook, methods in reversed(list(_hooks.values())):  # innermost first, so the first added runs outermost
            if method in methods:
                call = functools.partial(hook, method, call)
        return call(*args, **kwargs)

    return dispatch
