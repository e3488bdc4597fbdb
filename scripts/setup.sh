#!/usr/bin/env bash
# Create .venv and install tpcache whole (the server extra: torch, Ray, the model readers)
# with its test tools, saying what it does as it goes. (A router host that needs only the
# network client installs the plain package: `pip install .`, no torch, no Ray.)
#
# torch is pinned to 2.13.0. Which build:
#   - a torch 2.13.0 already in .venv is kept (any build);
#   - no GPU (`nvidia-smi -L` fails) or TPCACHE_TORCH=cpu: the CPU build. PyPI's torch
#     wheel for Linux is the CUDA build (GBs of nvidia-* wheels), so PyTorch's CPU index
#     is added as an extra index: its 2.13.0+cpu sorts above PyPI's 2.13.0 and wins. The
#     index is added, not put in place of the configured ones, so a mirror or a local
#     wheel folder in pip's configuration still serves. If the CPU index cannot be reached
#     within 5 s (an offline machine), the pinned spec goes to the configured indexes
#     alone, with a warning;
#   - a GPU, or TPCACHE_TORCH=cuda: the pinned spec from the configured indexes (CUDA);
#   - TPCACHE_TORCH=skip: torch is not touched (install your own build first: without
#     one, setup stops rather than let the server extra pull an unpinned torch).
# The extras are then installed with the torch that is there as a constraint, so pip
# never replaces it (nor installs another torch) to satisfy them.
# TPCACHE_TORCH_CPU_INDEX replaces PyTorch's CPU index (a mirror of it).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
CPU_INDEX=${TPCACHE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

say() { echo "setup: $*"; }
pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }

if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $("$PY" --version 2>&1)"
    "$PY" -m venv .venv
fi

mode=${TPCACHE_TORCH:-auto}
case "$mode" in
auto) if nvidia-smi -L >/dev/null 2>&1; then mode=cuda; else mode=cpu; fi ;;
cpu | cuda | skip) ;;
*)
    echo "setup: TPCACHE_TORCH must be cpu, cuda or skip, got '$mode'" >&2
    exit 2
    ;;
esac

have=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))' \
    2>/dev/null || true)
if [ "$mode" = skip ]; then
    say "TPCACHE_TORCH=skip: leaving torch as it is (${have:-not installed})"
elif [ "${have%%+*}" = "$TORCH_VERSION" ]; then
    say "torch $have is already installed"
elif [ "$mode" = cuda ]; then
    say "installing torch $TORCH_VERSION (a GPU is present: the default build, with CUDA)..."
    pip_install "torch==$TORCH_VERSION"
elif .venv/bin/python -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=5)" \
    >/dev/null 2>&1; then
    say "installing torch $TORCH_VERSION (CPU build, from $CPU_INDEX)..."
    if ! pip_install --extra-index-url "$CPU_INDEX" "torch==$TORCH_VERSION"; then
        say "that failed; installing torch==$TORCH_VERSION from the configured indexes..."
        pip_install "torch==$TORCH_VERSION"
    fi
else
    say "warning: $CPU_INDEX cannot be reached; installing torch==$TORCH_VERSION from the" \
        "configured indexes (on PyPI that is the CUDA build)..."
    pip_install "torch==$TORCH_VERSION"
fi

have=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))' \
    2>/dev/null || true)
if [ -z "$have" ]; then
    echo "setup: no torch in .venv (TPCACHE_TORCH=skip): install a torch build first" >&2
    exit 2
fi
pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
echo "torch==$have" >"$pins"
say "installing tpcache (editable, with the server extra) and its test tools..."
pip_install -c "$pins" -e '.[server,dev,plot]'
say "torch $(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))');" \
    "done in $((SECONDS - started)) s"
