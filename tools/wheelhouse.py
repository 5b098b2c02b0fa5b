"""Build a wheelhouse: every wheel a node with its own PyTorch needs to run zerotrain offline, for a target Python.

    python tools/wheelhouse.py --python 3.12 --out wheelhouse/py312     # what `make wheelhouse PY=3.12` runs

Needs PyPI (run it where pip can reach it) and, to build DeepSpeed's pure wheel, a torch in the running interpreter
(the project's .venv). The wheels are requirements-node.txt's closure at requirements.txt's pins; torch, what
only torch needs and numpy (the node's own; ``--with-numpy`` adds it) are left out: DeepSpeed and accelerate are
taken without their dependencies (``--no-deps``; their other requirements become roots), and any other package
that would pull torch in is an error. Packages PyPI has only as
source (DeepSpeed, antlr4-python3-runtime) are built here and accepted only as pure ``py3-none-any`` wheels.
Target: CPython ``--python`` on manylinux x86-64 (glibc 2.17 to ``--glibc``); for the running interpreter's own
version, its native tags. One version of each package; ``manifest.json`` and ``manifest.txt`` list name, version,
file, sha256 and size. Refuses (exit 2, nothing written) above ``--max-mib``. The node-side install is
tools/node_env.sh (docs/offline_install.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parent.parent
NO_DEPS = {"deepspeed", "accelerate"}  # they require torch: taken alone, their other requirements become roots
NEVER = {"torch", "triton"}  # the node's own; CUDA wheels of several GB
# Comes with every PyTorch install we target (NGC containers, site modules) and is 16 MiB of the 40: left out
# unless --with-numpy. The node's copy must satisfy requirements-node.txt's range (tools/node_env.sh checks).
NODE_STACK = {"numpy"}


def _pip(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, check=False, text=True, capture_output=True)


def target_flags(python: str, glibc: int | None) -> list[str]:
    """pip's platform flags for CPython ``python`` on manylinux x86-64; none for this interpreter's own version."""
    native = f"{sys.version_info.major}.{sys.version_info.minor}"
    if python == native and glibc is None:
        return []
    tag = python.replace(".", "")
    flags = ["--python-version", python, "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "abi3",
             "--abi", "none", "--only-binary=:all:"]
    for n in range(17, (glibc or 35) + 1):  # pip matches manylinux_2_N exactly: name every N
        flags += ["--platform", f"manylinux_2_{n}_x86_64"]
    return flags + ["--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64", "--platform", "any"]


def target_environment(python: str) -> dict[str, str]:
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.0", implementation_name="cpython",
               platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
               platform_machine="x86_64", os_name="posix")
    return env


def read_pins(path: Path) -> dict[str, Requirement]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = req
    return pins


def wheel_requirements(wheel: Path, env: dict[str, str]) -> list[Requirement]:
    """A wheel's Requires-Dist for the target environment, extras left out."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    reqs = [Requirement(ln.split(":", 1)[1].strip()) for ln in lines if ln.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({**env, "extra": ""})]


def fetch_one(spec: str, out: Path, flags: list[str]) -> Path:
    """``spec``'s wheel for the target, downloaded, or built here from source if it is pure Python."""
    before = set(out.iterdir())
    proc = _pip("download", "--no-deps", "--only-binary=:all:", *flags, "-d", str(out), spec)
    if proc.returncode != 0:
        proc = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), spec)
        if proc.returncode != 0:
            raise SystemExit(f"wheelhouse: cannot download or build {spec}:\n"
                             f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    new = [p for p in set(out.iterdir()) - before if p.suffix == ".whl"]
    if not new:  # already there
        name = canonicalize_name(Requirement(spec).name)
        new = [p for p in out.glob("*.whl") if parse_wheel_filename(p.name)[0] == name]
    wheel = new[0]
    tags = parse_wheel_filename(wheel.name)[3]
    if "-none-any" not in wheel.name and proc.args[4] == "wheel":
        raise SystemExit(f"wheelhouse: {spec} has no wheel for the target and builds only as {wheel.name}, "
                         f"not a pure py3-none-any wheel: {sorted(str(t) for t in tags)}")
    return wheel


def resolve(roots: list[str], constraints: Path, out: Path, flags: list[str]) -> list[tuple[str, str]]:
    """(name, version) of the closure of ``roots`` for the target, metadata only (pip's resolver, --dry-run).

    A requirement PyPI offers only as source is built into ``out`` as a pure wheel and the resolution retried.
    """
    for _ in range(8):
        proc = _pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-", "--only-binary=:all:",
                    *flags, "--find-links", str(out), "-c", str(constraints), *roots)
        if proc.returncode == 0:
            report = json.loads(proc.stdout)
            return [(canonicalize_name(i["metadata"]["name"]), i["metadata"]["version"]) for i in report["install"]]
        missing = re.search(r"satisfies the requirement (\S+)", proc.stderr)
        if not missing:
            raise SystemExit(f"wheelhouse: pip could not resolve {' '.join(roots)}:\n{proc.stderr[-3000:]}")
        req = Requirement(missing.group(1))
        pin = read_pins(constraints).get(canonicalize_name(req.name))
        fetch_one(str(pin) if pin else str(req), out, [])  # source-only: build it here (pure, so for any target)
    raise SystemExit("wheelhouse: resolution kept failing on source-only packages")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build(python: str, out: Path, glibc: int | None, max_mib: float, wandb: bool, with_numpy: bool) -> dict:
    flags = target_flags(python, glibc)
    env = target_environment(python)
    pins = read_pins(REPO / "requirements.txt")
    roots = [str(r) for r in read_pins(REPO / "requirements-node.txt").values()] + (["wandb"] if wandb else [])
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        constraints = tmp / "constraints.txt"
        constraints.write_text("".join(f"{r}\n" for n, r in pins.items() if n not in NEVER))
        wheels = tmp / "wheels"
        wheels.mkdir()
        plain = []
        for spec in roots:
            name = canonicalize_name(Requirement(spec).name)
            if name not in NO_DEPS:
                plain.append(spec)
                continue
            wheel = fetch_one(str(pins.get(name, spec)), wheels, flags)
            plain += [str(r) for r in wheel_requirements(wheel, env) if canonicalize_name(r.name) not in NEVER]
        closure = resolve(sorted(set(plain)), constraints, wheels, flags)
        pulled = [n for n, _ in closure if n in NEVER]
        if pulled:
            raise SystemExit(f"wheelhouse: a requirement pulls in {pulled}; the node's own torch must be kept")
        have = {parse_wheel_filename(p.name)[0] for p in wheels.glob("*.whl")}
        left_out = set() if with_numpy else NODE_STACK
        for name, version in closure:
            if name not in have and name not in left_out:
                fetch_one(f"{name}=={version}", wheels, flags)
        manifest = write_manifest(wheels, python, flags, max_mib, sorted(left_out))
        (tmp / "constraints.txt").unlink()
        if out.exists():
            shutil.rmtree(out)
        wheels.rename(out)
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_manifest(wheels: Path, python: str, flags: list[str], max_mib: float, left_out: list[str]) -> dict:
    entries = []
    for p in sorted(wheels.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(p.name)
        entries.append({"name": str(name), "version": str(version), "file": p.name, "sha256": sha256(p),
                        "size": p.stat().st_size})
    names = [e["name"] for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SystemExit(f"wheelhouse: more than one version of {twice}: {[e['file'] for e in entries]}")
    total = sum(e["size"] for e in entries)
    if total > max_mib * 2**20:
        biggest = sorted(entries, key=lambda e: -e["size"])[:5]
        raise SystemExit(f"wheelhouse: {total / 2**20:.1f} MiB is over the {max_mib:g} MiB limit; largest: "
                         + ", ".join(f"{e['file']} {e['size'] / 2**20:.1f} MiB" for e in biggest))
    manifest = {"python": python, "platform": "native" if not flags else "manylinux x86-64",
                "pip_flags": flags, "left_out": sorted(NEVER) + left_out, "total_bytes": total, "wheels": entries}
    (wheels / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    lines = [f"{e['name']}=={e['version']}  {e['size']:>10,}  {e['sha256']}  {e['file']}" for e in entries]
    (wheels / "manifest.txt").write_text("\n".join(lines + [f"total {total:,} bytes ({total / 2**20:.1f} MiB), "
                                                            f"{len(entries)} wheels; left out (the node's own): "
                                                            f"{', '.join(sorted(NEVER) + left_out)}"]) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default="3.12", help="target CPython version, e.g. 3.12 (default: %(default)s)")
    ap.add_argument("--out", type=Path, help="output directory (default: wheelhouse/pyXY)")
    ap.add_argument("--glibc", type=int, default=None,
                    help="newest manylinux_2_N accepted (default: 35; for the running Python's own version: native)")
    ap.add_argument("--max-mib", type=float, default=40.0, help="size limit in MiB (default: %(default)s)")
    ap.add_argument("--wandb", action="store_true", help="add wandb (not needed for training or the GPU check)")
    ap.add_argument("--with-numpy", action="store_true", help="add numpy (16 MiB; nodes with torch have one)")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python):
        ap.error(f"--python {args.python!r}: expected a CPython version such as 3.12")
    out = args.out or REPO / "wheelhouse" / f"py{args.python.replace('.', '')}"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        manifest = build(args.python, out.resolve(), args.glibc, args.max_mib, args.wandb, args.with_numpy)
    except SystemExit as e:
        print(e.code, file=sys.stderr)
        return 2
    print(f"{out}: {len(manifest['wheels'])} wheels, {manifest['total_bytes'] / 2**20:.1f} MiB "
          f"(manifest.txt, manifest.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
