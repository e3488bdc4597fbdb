#!/usr/bin/env bash
# Create .venv and install tpcache with its test tools. On a machine without a GPU the
# CPU wheel of torch 2.13.0 is pinned (an unpinned torch pulls a multi-GB CUDA build);
# set TPCACHE_TORCH=skip to keep a torch that is already installed in the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
torch_spec="torch==2.13.0"
if [ "${TPCACHE_TORCH:-}" = "skip" ]; then torch_spec=""; fi
.venv/bin/python -m pip install -q --disable-pip-version-check $torch_spec -e '.[dev,plot]'
