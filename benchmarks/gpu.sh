#!/usr/bin/env bash
# The checks a CUDA machine runs, in one go (under 10 minutes on one GPU): the CUDA tests, then compiled against
# eager decode steps on the device. Results under ${OUT:-gpu-results}/.
#   bash benchmarks/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || { echo "no CUDA device (nvidia-smi failed)"; exit 1; }
[ -x .venv/bin/python ] || scripts/setup.sh --test > "$OUT/setup.log" 2>&1
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), torch.__version__; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/torch.txt"
timeout 300 .venv/bin/pytest -q -n 0 tests/gpu 2>&1 | tee "$OUT/tests_gpu.txt"
tests=${PIPESTATUS[0]}
timeout 360 .venv/bin/python benchmarks/decode_step.py --device cuda --model demo --dtype float32 --dtype bfloat16 \
    --config NGRAM --config EAGLE3 --config DFLASH --rounds 3 > "$OUT/decode_step_cuda.json" 2> "$OUT/decode_step_cuda.log"
bench=$?
echo "tests/gpu exit $tests, decode_step exit $bench; results in $OUT/"
exit $(( tests != 0 || bench != 0 ))
