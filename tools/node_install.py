"""Which wheels of a wheelhouse a node with its own PyTorch needs, decided without pip's resolver (tools/node_env.sh).

    VENV/bin/python tools/node_install.py WHEELHOUSE REQUIREMENTS plan     # prints the wheel files to install
    VENV/bin/python tools/node_install.py WHEELHOUSE REQUIREMENTS check    # exit 2 naming any unmet requirement

Run by the venv's interpreter, which sees the node's site-packages after its own. pip's resolver cannot do this
with ``--no-index``: asked for DeepSpeed it re-resolves everything it requires, torch included, and then torch's own
pins (torch 2.11.0+cu130 requires ``setuptools<82``, ``cuda-toolkit[...]==13.0.2``, ``triton==3.6.0``, ...), which
the node satisfies in its own way or not at all and which a wheelhouse without torch cannot change: seen on an
H200 node as ``ResolutionImpossible`` for ``deepspeed==0.19.8``. So the closure is walked here instead, over the
requirements of REQUIREMENTS and of each wheel taken (their ``Requires-Dist``, markers evaluated, extras left out):
a package installed on the node is kept when its version satisfies every specifier the walk has met for it, else
the wheelhouse's version is taken (it must satisfy them all) and its own requirements are walked. What the walk
never descends into is the node's business: the requirements of packages it keeps (torch's above all).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import sys
import zipfile
from pathlib import Path


def _packaging(wheelhouse: Path) -> None:
    """Import ``packaging`` from the wheelhouse's own pure wheel (a node python may lack it, or have an old one)."""
    wheel = next(iter(sorted(wheelhouse.glob("packaging-*-py3-none-any.whl"))), None)
    if wheel is not None:
        sys.path.insert(0, str(wheel))
        import packaging.requirements  # noqa: F401 -- what walk() uses, imported while the wheel is on the path
        import packaging.utils  # noqa: F401
        sys.path.remove(str(wheel))  # else importlib.metadata would count the wheel as installed on the node


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = zf.read(name).decode("utf-8")
    header = text.split("\n\n", 1)[0]
    return [line.split(":", 1)[1].strip() for line in header.splitlines() if line.startswith("Requires-Dist:")]


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def walk(wheelhouse: Path, requirements: Path) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(wheels to install by name, node packages kept by name with their version, unmet requirements)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    manifest = json.loads((wheelhouse / "manifest.json").read_text())
    wheels = {canonicalize_name(w["name"]): w for w in manifest["wheels"]}
    specs: dict[str, list[tuple[Requirement, str]]] = {}
    take: dict[str, str] = {}
    keep: dict[str, str] = {}
    lines = [x.split("#", 1)[0].strip() for x in requirements.read_text().splitlines()]
    queue = [(Requirement(x), requirements.name) for x in lines if x]
    while queue:
        req, source = queue.pop(0)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        specs.setdefault(name, []).append((req, source))
        wanted = [r.specifier for r, _ in specs[name]]
        if name in take:
            continue  # the wheelhouse's version: checked below against every specifier met
        have = _installed(name)
        if have is not None and all(s.contains(Version(have), prereleases=True) for s in wanted):
            keep[name] = have
            continue
        keep.pop(name, None)
        if name in wheels:
            take[name] = wheels[name]["file"]
            queue += [(Requirement(x), wheels[name]["file"]) for x in _requires(wheelhouse / take[name])]
    unmet = []
    for name, met in sorted(specs.items()):
        version = wheels[name]["version"] if name in take else _installed(name)
        for req, source in met:
            if version is None or not req.specifier.contains(Version(version), prereleases=True):
                there = (f"the wheelhouse's {version}" if name in take else f"the node's {version}" if version
                         else "none installed and none in the wheelhouse")
                unmet.append(f"{req} (from {source}): {there}")
    return take, keep, unmet


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[2] not in ("plan", "check"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    wheelhouse, requirements, what = Path(argv[0]), Path(argv[1]), argv[2]
    _packaging(wheelhouse)
    take, keep, unmet = walk(wheelhouse, requirements)
    if unmet:
        print("node_install: unmet requirements:\n  " + "\n  ".join(unmet), file=sys.stderr)
        return 2
    if what == "plan":
        print("\n".join(str(wheelhouse / f) for f in sorted(take.values())))
        print(f"node_install: {len(take)} wheels from {wheelhouse}; kept from the node: "
              + (", ".join(f"{n} {v}" for n, v in sorted(keep.items())) or "nothing"), file=sys.stderr)
    elif take:
        print("node_install: still missing after the install: " + ", ".join(sorted(take)), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
