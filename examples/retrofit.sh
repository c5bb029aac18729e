#!/usr/bin/env bash
# Retrofit Focus onto a released model, as the Focus paper does: import it, train only the
# routers (W_g and C of every layer, all else frozen), then measure. examples/retrofit_gpt2.sh
# and examples/retrofit_mistral_7b.sh set MODEL and run this.
#
# MODEL=gpt2          GPT-2 124M; K = 4, d_g = 16: 148,224 trained parameters; PG-19, sequence
#                     1024, 4000 steps (the paper's Tables 1-3). One process or one node.
# MODEL=mistral-7b    Mistral-7B-Instruct-v0.2 (no sliding window: v0.1's is refused); K = 2,
#                     2000 steps (the paper's Table 4), sequence 2048, bf16, 8 GPUs, ZeRO-1.
# The paper gives neither batch size nor learning rate for the routers: ours are below (GBS, LR).
#
# What you bring (nothing is downloaded here):
#   HF_DIR  the model as `save_pretrained` writes it, with its tokenizer.json, e.g.
#           `hf download gpt2 --local-dir gpt2`
#   PG19    a copy of PG-19 with `train/` and `validation/` folders of .parquet or .jsonl files
#           holding a `text` field (e.g. the `deepmind/pg19` dataset)
#
#   HF_DIR=gpt2 PG19=pg19 examples/retrofit_gpt2.sh        # every step, skipping those done
#   STEPS="eval export" HF_DIR=gpt2 PG19=pg19 examples/retrofit_gpt2.sh
#   SMOKE=1 examples/retrofit_gpt2.sh    # all steps on a tiny GPT-2 built from a config and the
#                                        # embedded corpus, one CPU process, about a minute
#
# Steps (STEPS, default all, in this order):
#   import  tools/convert_from_hf.py --attention focus: the base model, without routers
#   data    tools/preprocess_data.py: PG-19 train and validation, in the model's tokenizer
#   train   pretrain_gpt.py --retrofit: validation at iteration 0 (the base with fresh routers),
#           then every EVAL_INTERVAL in soft and sparse modes; resumes if interrupted. Checkpoints
#           hold only the routers and name the base (add --save-full via EXTRA_ARGS for whole ones)
#   eval    tools/eval_ppl.py on PG-19 validation: the base model, then the retrofit in soft mode
#           and sparse mode for top-k = 1..K (perplexity, pairs kept, attention time)
#   export  tools/convert_to_hf.py; then lm-evaluation-harness on HellaSwag, ARC-Easy, PIQA and
#           LAMBADA if `lm_eval` is installed (else the command is printed)
#
# Overrides: RUN_DIR DATA_DIR DATA_CACHE (SMOKE's embedded corpus) GBS MBS LR TRAIN_ITERS SEQ FOCUS_GROUPS FOCUS_WINDOW EVAL_ITERS
# EVAL_INTERVAL LAUNCHER (python | deepspeed) GPUS ZERO PYTHON EXTRA_ARGS (to pretrain_gpt.py)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
MODEL="${MODEL:-gpt2}"
die() { echo "retrofit.sh: error: $*" >&2; exit 2; }

case "$MODEL" in
  gpt2)
    d_groups=4 d_iters=4000 d_seq=1024 d_gbs=32 d_mbs=8 d_lr=1e-3 d_launcher=python d_gpus=1
    d_zero=1 d_ds_config="" ;;
  mistral-7b)
    d_groups=2 d_iters=2000 d_seq=2048 d_gbs=64 d_mbs=1 d_lr=1e-3 d_launcher=deepspeed d_gpus=8
    d_zero=1 d_ds_config="$ROOT/examples/ds_zero1_bf16.json" ;;
  *) die "MODEL=$MODEL: choose gpt2 or mistral-7b" ;;
esac
d_window=128 d_eval_iters=50 d_eval_interval=500
if [[ "${SMOKE:-0}" == 1 ]]; then
  # The same steps, shrunk to a CPU minute: a 2-layer GPT-2 from a config, the embedded corpus.
  d_iters=6 d_seq=64 d_gbs=4 d_mbs=2 d_launcher=python d_gpus=1 d_ds_config="" d_window=16
  d_eval_iters=2 d_eval_interval=3
fi
# a smoke run gets a folder of its own: the real recipe's stays for the real run
if [[ "${SMOKE:-0}" == 1 ]]; then smoke=-smoke; else smoke=""; fi
RUN_DIR="${RUN_DIR:-runs/retrofit-$MODEL$smoke}"
DATA_DIR="${DATA_DIR:-$RUN_DIR/data}"
TRAIN_ITERS="${TRAIN_ITERS:-$d_iters}" SEQ="${SEQ:-$d_seq}" GBS="${GBS:-$d_gbs}"
MBS="${MBS:-$d_mbs}" LR="${LR:-$d_lr}" FOCUS_GROUPS="${FOCUS_GROUPS:-$d_groups}"
FOCUS_WINDOW="${FOCUS_WINDOW:-$d_window}" EVAL_ITERS="${EVAL_ITERS:-$d_eval_iters}"
EVAL_INTERVAL="${EVAL_INTERVAL:-$d_eval_interval}" LAUNCHER="${LAUNCHER:-$d_launcher}"
GPUS="${GPUS:-$d_gpus}" ZERO="${ZERO:-$d_zero}" DS_CONFIG="${DS_CONFIG:-$d_ds_config}"
STEPS="${STEPS:-import data train eval export}"
BASE="$RUN_DIR/base" CKPT="$RUN_DIR/checkpoints" HF_OUT="$RUN_DIR/hf"
mkdir -p "$RUN_DIR"

if [[ "${SMOKE:-0}" == 1 ]]; then
  HF_DIR="$RUN_DIR/tiny-gpt2"
  # A GPT-2 of the embedded tokenizer's vocabulary, written as a release would be (random weights).
  "$PYTHON" - "$HF_DIR" <<'EOF'
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config(vocab_size=4096, n_positions=64, n_embd=64, n_layer=2,
                           n_head=4, bos_token_id=0, eos_token_id=0)).save_pretrained(sys.argv[1])
EOF
  DATA=()  # the embedded corpus and its tokenizer, cached in DATA_CACHE if set
  [[ -n "${DATA_CACHE:-}" ]] && DATA=(--data-cache-path "$DATA_CACHE")
  EVAL_DATA=("${DATA[@]}")
else
  [[ -n "${HF_DIR:-}" && -f "$HF_DIR/config.json" ]] || die "HF_DIR: a save_pretrained folder (config.json) is needed"
  [[ -f "$HF_DIR/tokenizer.json" ]] || die "$HF_DIR/tokenizer.json is missing"
  [[ -n "${PG19:-}" ]] || die "PG19: the folder with train/ and validation/ is needed"
  TOKENIZER=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$HF_DIR/tokenizer.json")
  # In-run validation: a slice of PG-19 train; the final evaluation: PG-19 validation, whole.
  DATA=(--data-path "$DATA_DIR/pg19-train_text_document" --split 998,2,0 "${TOKENIZER[@]}"
        --data-cache-path "$DATA_DIR/index-cache")
  EVAL_DATA=(--data-path "$DATA_DIR/pg19-validation_text_document" --split 0,100,0 "${TOKENIZER[@]}"
             --data-cache-path "$DATA_DIR/index-cache")
fi

step() { [[ " $STEPS " == *" $1 "* ]]; }

if step import && [[ ! -f "$BASE/latest" ]]; then
  "$PYTHON" "$ROOT/tools/convert_from_hf.py" --hf-dir "$HF_DIR" --save "$BASE" \
    --attention focus --flags-file "$RUN_DIR/model_flags"
fi
[[ -f "$RUN_DIR/model_flags" ]] || die "no $RUN_DIR/model_flags: run the import step first"
mapfile -t MODEL_FLAGS < "$RUN_DIR/model_flags"  # the model's shape, --attention focus --retrofit

if step data && [[ "${SMOKE:-0}" != 1 ]]; then
  mkdir -p "$DATA_DIR"
  for split in train validation; do
    if [[ ! -f "$DATA_DIR/pg19-${split}_text_document.idx" ]]; then
      "$PYTHON" "$ROOT/tools/preprocess_data.py" --input "$PG19/$split/*" \
        --output-prefix "$DATA_DIR/pg19-$split" "${TOKENIZER[@]}" --append-eod --workers "$(nproc)"
    fi
  done
fi

if step train; then
  LOAD="$BASE"
  [[ -f "$CKPT/latest" ]] && LOAD="$CKPT"  # resume the retrofit, not restart it
  ARGS=("${MODEL_FLAGS[@]}" --load "$LOAD" --save "$CKPT" --tensorboard-dir "$RUN_DIR/tensorboard"
        --focus-groups "$FOCUS_GROUPS" --focus-dim 16 --focus-window "$FOCUS_WINDOW"
        --seq-length "$SEQ" --micro-batch-size "$MBS" --global-batch-size "$GBS"
        --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$(awk "BEGIN { print $LR / 10 }")"
        --lr-warmup-iters "$((TRAIN_ITERS / 20))" --lr-decay-style cosine --weight-decay 0
        --hidden-dropout 0 --attention-dropout 0 --zero-stage "$ZERO"
        --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS" --save-interval "$EVAL_INTERVAL"
        --log-interval 10 --exit-signal-handler "${DATA[@]}")
  [[ -n "$DS_CONFIG" ]] && ARGS+=(--deepspeed_config "$DS_CONFIG")
  # shellcheck disable=SC2206
  ARGS+=(${EXTRA_ARGS:-})
  case "$LAUNCHER" in
    python) "$PYTHON" "$ROOT/pretrain_gpt.py" "${ARGS[@]}" ;;
    deepspeed) deepspeed --num_gpus "$GPUS" "$ROOT/pretrain_gpt.py" "${ARGS[@]}" ;;
    *) die "LAUNCHER=$LAUNCHER: choose python or deepspeed" ;;
  esac
fi

if step eval; then
  for what in base checkpoints; do
    "$PYTHON" "$ROOT/tools/eval_ppl.py" --load "$RUN_DIR/$what" --seq-length "$SEQ" \
      --micro-batch-size "$MBS" --eval-iters "$EVAL_ITERS" "${EVAL_DATA[@]}" \
      --json "$RUN_DIR/eval-$what.json"
  done
fi

if step export; then
  "$PYTHON" "$ROOT/tools/convert_to_hf.py" --load "$CKPT" --save-dir "$HF_OUT" --overwrite
  TASKS=hellaswag,arc_easy,piqa,lambada_openai
  LM_EVAL=(lm_eval --model hf --model_args "pretrained=$HF_OUT,trust_remote_code=True"
           --tasks "$TASKS" --batch-size 8 --output_path "$RUN_DIR/lm-eval")
  if [[ "${SMOKE:-0}" != 1 ]] && command -v lm_eval >/dev/null; then
    "${LM_EVAL[@]}"
    # The base model's scores, for the comparison (the paper: unchanged by the retrofit).
    lm_eval --model hf --model_args "pretrained=$HF_DIR" --tasks "$TASKS" --batch-size 8 \
      --output_path "$RUN_DIR/lm-eval-base"
  else
    echo "downstream tasks (pip install lm-eval):"
    printf '  %q' "${LM_EVAL[@]}"; echo
  fi
fi
