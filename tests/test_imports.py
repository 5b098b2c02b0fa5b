"""The package's import graph has no cycle, the config machinery depends on no component, every module imports.

The graph is read from the source with ``ast``, deferred imports (inside functions) included: a cycle that only a
deferred import closes still ties the two modules together (``config.py`` once validated the model section by
importing ``models.py``, which imported ``config.py``), so it counts here as one.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from tools.launcher import PYTHON, REPO

PACKAGE = REPO / "zerotrain"
# What the composition/override machinery may import from the package: the error types, the field declarations and
# the atomic-write helpers (config.save; durable imports nothing but the error types).
CONFIG_MAY_IMPORT = {"zerotrain.errors", "zerotrain.fields", "zerotrain.durable"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: Path) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source (``from pkg import sub`` -> pkg.sub)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # a submodule by name, or a name defined in the module ``base``
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


def import_graph() -> dict[str, set[str]]:
    return {name: imported_modules(name, path) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert graph["zerotrain.trainer"], "the graph reader found no imports at all: it is broken, not the package"
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle_closed_by_a_deferred_import():
    # Negative control: the shape of the cycle this test was written against (models.py imported config.py at the
    # top, config.py imported models.py inside a function).
    graph = import_graph()
    graph["zerotrain.config"] = graph["zerotrain.config"] | {"zerotrain.models"}
    graph["zerotrain.models"] = graph["zerotrain.models"] | {"zerotrain.config"}
    assert ["zerotrain.config", "zerotrain.models"] in cycles(graph)


def test_config_machinery_imports_no_component():
    assert imported_modules("zerotrain.config", MODULES["zerotrain.config"]) <= CONFIG_MAY_IMPORT


def test_every_module_imports_in_a_fresh_interpreter():
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    proc = subprocess.run([PYTHON, "-c", script, *MODULES], cwd=REPO, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
