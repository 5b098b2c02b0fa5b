#!/usr/bin/env bash
# The GPU check in one command, on a GPU node with or without network (docs/hpz.md#the-gpu-check):
#
#     bash benchmarks/gpu_check.sh --out DIR [--quick] [--sections race,stall,...] [--dry-run]
#
# Python: the checkout's .venv if it has DeepSpeed (`make setup`) and ZT_WHEELHOUSE is unset; otherwise an offline
# environment over the node's own torch ($ZT_PYTHON, default python3), made once from the carried wheelhouse
# (tools/node_env.sh): $ZT_WHEELHOUSE, default wheelhouse/pyXY for that python's version, in $ZT_NODE_VENV (default
# /tmp/zerotrain-node-venv). The checkout is put on PYTHONPATH, so
# nothing needs installing. Every argument goes to benchmarks/gpu_check.py.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
venv_py=$repo/.venv/bin/python
if [ -z "${ZT_WHEELHOUSE:-}" ] && [ -x "$venv_py" ] && "$venv_py" -c 'import deepspeed' 2>/dev/null; then
    py=$venv_py
else
    node_py=${ZT_PYTHON:-python3}
    tag=$("$node_py" -c 'import sys; print(f"py{sys.version_info.major}{sys.version_info.minor}")')
    venv=${ZT_NODE_VENV:-/tmp/zerotrain-node-venv}
    bash "$repo/tools/node_env.sh" "${ZT_WHEELHOUSE:-$repo/wheelhouse/$tag}" "$venv" "$node_py"
    py=$venv/bin/python
fi
cd "$repo"
exec "$py" benchmarks/gpu_check.py "$@"
