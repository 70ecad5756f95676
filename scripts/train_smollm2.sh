#!/usr/bin/env bash
# The smollm2 drafters in one go: prompts, the target's own answers (greedy and T 0.7), the feature caches, EAGLE-3
# and DFlash training chosen on the validation prompts, each drafter exported in bf16. Every step resumes: rerun
# the same command to go on. The knobs (environment) fit it to a machine; benchmarks/gpu.sh `train` sets them for
# one CUDA GPU, the defaults are this repository's CPU settings (docs/training.md).
#   bash scripts/train_smollm2.sh
# PY: the Python to run (default .venv/bin/python, else python3 with src/ on the path); TARGET: `smollm2` or the
# GGUF's path; DEVICE: cpu|cuda; WORK: where data, caches and runs go (default .); MINUTES_DATA, MINUTES_EAGLE3,
# MINUTES_DFLASH: each step's time limit (MINUTES_DATA=0: no new answers); PROMPTS, BATCH, STEPS_EAGLE3,
# STEPS_DFLASH, TRAIN_BATCH, ANCHORS, WARMUP: sizes; SAMPLED=0 skips the T 0.7 answers; KINDS="eagle3 dflash" (or one).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"; fi
fi
TARGET=${TARGET:-smollm2}
DEVICE=${DEVICE:-cpu}
WORK=${WORK:-.}
PROMPTS=${PROMPTS:-2158}
BATCH=${BATCH:-64}
TRAIN_BATCH=${TRAIN_BATCH:-8}
STEPS_EAGLE3=${STEPS_EAGLE3:-2000}
STEPS_DFLASH=${STEPS_DFLASH:-2000}
MINUTES_DATA=${MINUTES_DATA:-60}
MINUTES_EAGLE3=${MINUTES_EAGLE3:-60}
MINUTES_DFLASH=${MINUTES_DFLASH:-60}
SAMPLED=${SAMPLED:-1}
KINDS=${KINDS:-eagle3 dflash}
ANCHORS=${ANCHORS:-64}  # DFlash blocks per sequence and step
WARMUP=${WARMUP:-20}  # warm-up steps of the learning rate
EAGER=(); [ "$DEVICE" = cuda ] || EAGER=(--enforce-eager)  # CPU: no compile per batch size
run() { echo "+ $*" >&2; "$PY" -m specserve.cli "$@"; }

mkdir -p "$WORK/runs/smollm2" "$WORK/train_runs"
prompts=$WORK/runs/smollm2/chat_prompts.jsonl
[ -s "$prompts" ] || "$PY" -m specserve.train.chat_prompts --split train --count "$PROMPTS" --out "$prompts"
data=("$WORK/data/smollm2/chat-greedy")
[ "$MINUTES_DATA" = 0 ] && prepare() { :; } || prepare() { run train prepare "$@"; }  # 0: train on the data as it is
prepare --target "$TARGET" --prompts "$prompts" --out "${data[0]}" --temperature 0 --max-new-tokens 128 \
    --batch-size "$BATCH" --shard-size 64 --device "$DEVICE" "${EAGER[@]}" --max-minutes "$MINUTES_DATA"
if [ "$SAMPLED" = 1 ]; then
  data+=("$WORK/data/smollm2/chat-t07")
  prepare --target "$TARGET" --prompts "$prompts" --out "${data[1]}" --temperature 0.7 --seed 1 \
      --max-new-tokens 128 --batch-size "$BATCH" --shard-size 64 --device "$DEVICE" "${EAGER[@]}" \
      --max-minutes "$MINUTES_DATA"
fi
evals=(--eval-every 100 --eval-suite data/smollm2/chat_prompts.val.jsonl --eval-prompts 10 --eval-max-new-tokens 64)
common=(--target "$TARGET" --data "${data[@]}" --batch-size "$TRAIN_BATCH" --max-len 512 --device "$DEVICE"
        --save-every 50 --checkpoint-dtype bfloat16 "${evals[@]}")
train() {  # kind, export format, minutes, args...: resume the run where one exists
  local kind=$1 format=$2 minutes=$3 out=$WORK/train_runs/smollm2-$1; shift 3
  local again=(); [ -f "$out/checkpoint.pt" ] && again=(--resume)
  run train "$kind" "${common[@]}" --out "$out" --feature-cache "$WORK/runs/smollm2/fc-$kind" --max-minutes "$minutes" \
      "${again[@]}" "$@"
  local chosen=$out/best; [ -f "$chosen/config.json" ] || chosen=$out/drafter
  run train export --drafter "$chosen" --target "$TARGET" --out "$out/export" --format "$format" --dtype bfloat16
}
for kind in $KINDS; do
  case $kind in
    eagle3) train eagle3 sglang "$MINUTES_EAGLE3" --steps "$STEPS_EAGLE3" --draft-vocab-size 8192 --ttt-steps 5 --lr 6e-4 \
                --warmup-steps "$WARMUP" ;;
    # the mask token: SmolLM2 has no <|mask|>; id 16, <empty_output>, is a special token chat never uses
    dflash) train dflash dflash "$MINUTES_DFLASH" --steps "$STEPS_DFLASH" --block-size 16 --anchors-per-seq "$ANCHORS" \
                --mask-token-id 16 --lr 6e-4 --warmup-steps "$WARMUP" ;;
    *) echo "KINDS: eagle3 or dflash, got $kind" >&2; exit 2 ;;
  esac
done
echo "done: $(for k in $KINDS; do printf '%s ' "$WORK/train_runs/smollm2-$k/export"; done)" >&2
