"""Which torch names zerotrain uses resolve in one torch's Python sources but not in another's (the supported range).

    python tools/torch_api_check.py OLD_TORCH_ROOT NEW_TORCH_ROOT     # each: a directory holding torch/

Collects every ``torch.a.b`` attribute chain and ``from torch.x import y`` in zerotrain/, train.py, tools/ and
benchmarks/gpu_check.py, resolves each statically (module file, then a def/class/assignment/import of the name in
it; no import of torch, so an unpacked wheel of any platform will do, e.g. macOS's small one) and prints the names
that resolve under NEW but not OLD. Names a static reading cannot follow (star imports, C stubs) fail under both and
are not reported. Exit 1 if any name is missing from OLD.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("zerotrain", "train.py", "tools", "benchmarks/gpu_check.py")


def used_names() -> set[str]:
    names = set()
    for src in SOURCES:
        path = REPO / src
        for f in path.rglob("*.py") if path.is_dir() else [path]:
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
                    names |= {f"{node.module}.{a.name}" for a in node.names}
                elif isinstance(node, ast.Import):
                    names |= {a.name for a in node.names if a.name.split(".")[0] == "torch"}
                elif isinstance(node, ast.Attribute):
                    parts, n = [], node
                    while isinstance(n, ast.Attribute):
                        parts.append(n.attr)
                        n = n.value
                    if isinstance(n, ast.Name) and n.id == "torch":
                        names.add(".".join(["torch", *reversed(parts)]))
    return names


def _module_files(root: Path, module: str) -> list[Path]:
    base = root / module.replace(".", "/")
    return [p for p in (base.with_suffix(".py"), base / "__init__.py", base.with_suffix(".pyi"), base / "__init__.pyi")
            if p.exists()]


def resolves(root: Path, name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        files = _module_files(root, ".".join(parts[:i]))
        if files:
            break
    else:
        return False
    if i == len(parts):
        return True
    attr = re.escape(parts[i])
    pattern = rf"(def|class)\s+{attr}\b|\b{attr}\s*[:=]|import[^\n]*\b{attr}\b"
    return any(re.search(pattern, f.read_text(errors="replace")) for f in files)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    old, new = (Path(a) for a in argv)
    names = used_names()
    missing = sorted(n for n in names if resolves(new, n) and not resolves(old, n))
    print(f"{len(names)} torch names used; resolving under {new} but not {old}: {missing or 'none'}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
