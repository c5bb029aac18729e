#!/usr/bin/env bash
# The four attention variants on the embedded corpus with several seeds, on a CPU, then one plot
# and one final-loss table (mean +- std over seeds). About 15 minutes on 2 cores with the defaults.
#
#   examples/study_cpu.sh                       # SEEDS="1 2" ITERS=100 OUT=runs/study
#   SEEDS="1 2 3" ITERS=300 examples/study_cpu.sh
#   EXTRA_ARGS="--num-layers 2 ..." SEQ_LENGTH=64   # any pretrain_gpt.py flags (the test shrinks it)
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${SEEDS:-"1 2"}
ITERS=${ITERS:-100}
OUT=${OUT:-runs/study}
SEQ_LENGTH=${SEQ_LENGTH:-256}
VARIANTS="standard xsa focus focus+xsa"
runs=()
mkdir -p "$OUT"
for attention in $VARIANTS; do
  for seed in $SEEDS; do
    dir="$OUT/${attention/+/-}-seed$seed"
    python pretrain_gpt.py --attention "$attention" --seed "$seed" --train-iters "$ITERS" \
      --log-interval 5 --eval-interval 25 --eval-iters 4 --focus-groups 4 --focus-window 64 \
      --seq-length "$SEQ_LENGTH" ${EXTRA_ARGS:-} --tensorboard-dir "$dir/tensorboard" >"$dir.log" 2>&1 || { tail -20 "$dir.log"; exit 1; }
    runs+=("$attention=$dir/tensorboard")
  done
done
python tools/compare_runs.py "${runs[@]}" --seq-length "$SEQ_LENGTH" --out "${STUDY_OUT:-docs/study}" \
  --json "${STUDY_OUT:-docs/study}.json"
