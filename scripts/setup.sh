#!/usr/bin/env bash
# Create .venv and install specserve into it. Usage: scripts/setup.sh [--test]
# PyTorch: on a machine with an NVIDIA GPU pip's default (CUDA) build is used; elsewhere the
# CPU build 2.13.0 (installed first, so the package's `torch>=2.4` range keeps it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/pip install -q torch 2>&1 | grep -v "is ignored" || true
  else
    .venv/bin/pip install -q torch==2.13.0 2>&1 | grep -v "is ignored" || true
  fi
fi
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
.venv/bin/pip install -q -e ".${extra}" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import specserve, torch; print('specserve', specserve.__version__, 'torch', torch.__version__)"
