#!/usr/bin/env bash
# An offline environment for zerotrain on a node that brings its own PyTorch (docs/offline_install.md):
#
#     bash tools/node_env.sh WHEELHOUSE VENV [PYTHON]      # PYTHON: the node's python with torch (default python3)
#
# Makes VENV (if missing) from PYTHON, makes PYTHON's own site-packages visible in it after its own (a .pth, so this
# works also when PYTHON is itself a venv, which `venv --system-site-packages` would not see through), then installs
# from WHEELHOUSE, with no index and no dependencies, the wheels tools/node_install.py chooses for
# requirements-node.txt: the node's packages are kept where their version satisfies every requirement met, torch
# always (the wheelhouse has none). Exit 2 on a missing wheelhouse or torch, or an unmet requirement (named);
# checks afterwards that torch is still the node's.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: bash tools/node_env.sh WHEELHOUSE VENV [PYTHON]" >&2
    exit 2
fi
wheelhouse=$1 venv=$2 py=${3:-python3}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ ! -f "$wheelhouse/manifest.json" ]; then
    echo "node_env.sh: $wheelhouse has no manifest.json; build it where PyPI is reachable: make wheelhouse PY=X.Y" >&2
    exit 2
fi
if ! torch_version=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
    echo "node_env.sh: $py cannot import torch; name the node's python with torch as the third argument" >&2
    exit 2
fi
if ! "$py" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(v < (2, 11))'; then
    echo "node_env.sh: torch $torch_version is older than 2.11, the oldest zerotrain supports" \
        "(docs/offline_install.md)" >&2
    exit 2
fi
if [ ! -x "$venv/bin/python" ]; then
    # No pip of its own: ensurepip of Python < 3.12 would also put setuptools 65 in the venv, shadowing the node's
    # (torch needs >= 77). The node's pip installs into it (pip >= 22.3: --python).
    "$py" -m venv --without-pip "$venv"
    purelib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$py" -c 'import site; print("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in
        site.getsitepackages()))' > "$purelib/_node_site.pth"
fi
if ! "$py" -m pip --version >/dev/null 2>&1; then
    echo "node_env.sh: $py has no pip" >&2
    exit 2
fi
# Which wheels: tools/node_install.py walks the closure itself (pip's resolver, with no index, re-resolves the
# node's torch's own pins and fails on them); then pip installs exactly those, without dependencies.
plan=$("$venv/bin/python" "$repo/tools/node_install.py" "$wheelhouse" "$repo/requirements-node.txt" plan)
if [ -n "$plan" ]; then
    mapfile -t wheels <<<"$plan"
    "$py" -m pip --python "$venv/bin/python" install --quiet --disable-pip-version-check --no-index --no-deps \
        "${wheels[@]}"
fi
"$venv/bin/python" "$repo/tools/node_install.py" "$wheelhouse" "$repo/requirements-node.txt" check
"$venv/bin/python" - "$torch_version" "$venv" <<'PY'
import os, sys
import torch, deepspeed, transformers, omegaconf  # noqa: E401 -- what zerotrain imports at start
version, venv = sys.argv[1], os.path.realpath(sys.argv[2])
if torch.__version__ != version or os.path.realpath(torch.__file__).startswith(venv + os.sep):
    sys.exit(f"node_env.sh: torch was replaced: {torch.__version__} at {torch.__file__} (the node's: {version})")
print(f"node_env.sh: {venv}: torch {torch.__version__} (the node's), deepspeed {deepspeed.__version__}, "
      f"transformers {transformers.__version__}, omegaconf {omegaconf.__version__}")
PY
