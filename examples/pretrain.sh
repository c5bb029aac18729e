#!/usr/bin/env bash
# Pretrain the XSA paper's sizes or a Mistral-shaped 7B with any attention variant, under the
# DeepSpeed launcher. One script; every setting is an environment variable:
#
#   MODEL=0.7b ATTENTION=xsa examples/pretrain.sh                         # one node, its 8 GPUs
#   MODEL=2.7b ATTENTION=focus HOSTFILE=examples/hostfile examples/pretrain.sh   # 4 nodes (ssh/pdsh)
#   sbatch examples/pretrain.slurm                                         # SLURM, no ssh needed
#
#   PLAN=1    MODEL=7b examples/pretrain.sh   # tools/plan.py for exactly this launch (memory, time)
#   DRY_RUN=1 MODEL=7b examples/pretrain.sh   # print the command, run nothing
#   SMOKE=1   MODEL=7b examples/pretrain.sh   # same recipe shrunk to run on a CPU in seconds
#
# MODEL      0.7b | 1.4b | 2.7b (XSA paper, Table 1) | 7b (Mistral-7B shape, Focus's from-scratch run)
# ATTENTION  standard | xsa | focus | focus+xsa
#
# Sizes (the table below). Paper sizes: FineWeb, GPT-2 tokenizer, 2048 tokens x 256 sequences
# (0.5M tokens) per batch, 200K iterations (~105B tokens), AdamW, 2K warmup, cosine to 10% of the
# peak LR, nanoGPT's RoPE/LayerNorm/GELU model with tied embeddings and no linear biases.
# 7b: 32 layers, d 4096, 32 heads in 8 KV groups, SwiGLU 14336, RMSNorm, RoPE, untied, no
# biases, a 32K-piece tokenizer, 2B tokens (3815 iterations of 0.5M tokens).
# Node counts, TP/SP, ZeRO stage and micro-batch fit 80 GB GPUs with room to spare: see
# `PLAN=1 MODEL=... examples/pretrain.sh` and docs/recipes.md.
#
# Overrides (all optional): LAYERS HIDDEN HEADS KV_CHANNELS KV_GROUPS FFN FOCUS_GROUPS NODES GPUS_PER_NODE HOSTFILE TP SP ZERO DS_CONFIG MBS GBS SEQ
# TRAIN_ITERS LR MIN_LR WARMUP SEED DATA_PATH SPLIT TOKENIZER_TYPE TOKENIZER_MODEL DATA_CACHE
# RUN_NAME RUN_DIR CKPT TB LABEL (compare_runs.py's group name, default "$MODEL $ATTENTION")
# SAVE_INTERVAL EVAL_INTERVAL EVAL_ITERS LOG_INTERVAL VOCAB_SIZE
# LAUNCHER (deepspeed | torchrun | python) LAUNCHER_ARGS NODE_RANK MASTER_ADDR MASTER_PORT
# PYTHON EXTRA_ARGS; arguments given to this script are appended to pretrain_gpt.py's.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="${MODEL:-0.7b}"
ATTENTION="${ATTENTION:-standard}"
PYTHON="${PYTHON:-python}"

die() { echo "pretrain.sh: error: $*" >&2; exit 2; }

case "$ATTENTION" in
  standard|xsa|focus|focus+xsa) ;;
  *) die "ATTENTION=$ATTENTION: choose standard, xsa, focus or focus+xsa" ;;
esac

# ------------------------------------------------------------------------------------------------
# The table. d_* are defaults; the environment overrides any of them below.
# GB/GPU: tools/plan.py's estimate on 80 GB GPUs (72 GB usable), standard .. focus+xsa; days: the
# whole run at 40% MFU on H100s. Every choice is the cheapest that fits with room (< 70% of 80 GB):
# TP 1 and ZeRO-1 wherever they fit (no tensor-parallel traffic; ZeRO-1 reduces gradients once per
# step, ZeRO-2 at every micro-batch), TP 2 + SP inside a node for 7b. docs/recipes.md has the rest.
#
#        layers hidden heads kv_ch  lr    nodes TP SP  ZeRO MBS  GB/GPU       days
# 0.7b   24     1536   6     256    5e-4  1     1  -   1    8    32.2 .. 37.6  1.9
# 1.4b   24     2048   24    128    4e-4  2     1  -   1    4    27.9 .. 33.9  1.9
# 2.7b   32     2560   24    128    3e-4  4     1  -   1    4    42.3 .. 49.9  1.7
# 7b     32     4096   32    128    3e-4  2     2  on  1    2    32.6 .. 34.3  0.16 (2B tokens)
case "$MODEL" in
  0.7b) d_layers=24 d_hidden=1536 d_heads=6  d_kv=256 d_lr=5e-4 d_nodes=1 d_tp=1 d_zero=1 d_mbs=8 ;;
  1.4b) d_layers=24 d_hidden=2048 d_heads=24 d_kv=128 d_lr=4e-4 d_nodes=2 d_tp=1 d_zero=1 d_mbs=4 ;;
  2.7b) d_layers=32 d_hidden=2560 d_heads=24 d_kv=128 d_lr=3e-4 d_nodes=4 d_tp=1 d_zero=1 d_mbs=4 ;;
  7b)   d_layers=32 d_hidden=4096 d_heads=32 d_kv=128 d_lr=3e-4 d_nodes=2 d_tp=2 d_zero=1 d_mbs=2 ;;
  *) die "MODEL=$MODEL: choose 0.7b, 1.4b, 2.7b or 7b" ;;
esac
d_min_lr=$(awk "BEGIN { print $d_lr / 10 }")  # 10% of the peak
d_gpus=8 d_seq=2048 d_gbs=256 d_groups="" d_ffn=""
if [[ "$MODEL" == 7b ]]; then
  d_iters=3815 d_warmup=380 d_groups=8 d_ffn=14336 d_focus_groups=4  # K=4 as in Focus's 7B run
  d_tokenizer_type=GPTSentencePieceTokenizer d_tokenizer=data/fineweb-sp32k-tokenizer.model
  d_data=data/fineweb-sp32k_text_document d_vocab=32000
else
  d_iters=200000 d_warmup=2000 d_focus_groups=8
  d_tokenizer_type=HuggingFaceTokenizer d_tokenizer=data/gpt2/tokenizer.json
  d_data=data/fineweb-gpt2_text_document d_vocab=50257
fi
d_launcher=deepspeed d_save_interval=1000 d_eval_interval=1000 d_eval_iters=20 d_log_interval=10

if [[ "${SMOKE:-0}" == 1 ]]; then
  # The same recipe, shrunk: 2 layers, width 64, 64 tokens, 3 iterations, one CPU process, the
  # embedded corpus unless DATA_PATH is set. What stays: the architecture family (head count vs
  # width, GQA, SwiGLU, norms, positions, tying), the attention variant and the DeepSpeed config.
  d_layers=2 d_hidden=64 d_seq=64 d_mbs=2 d_gbs=4 d_iters=3 d_warmup=1 d_lr=1e-3 d_min_lr=1e-4
  case "$MODEL" in
    0.7b) d_heads=2 d_kv=32 ;;
    1.4b|2.7b) d_heads=4 d_kv=24 ;;  # heads x head size (96) != width, as in the paper
    7b) d_heads=4 d_kv=16 d_groups=2 d_ffn=176 ;;
  esac
  d_nodes=1 d_gpus=1 d_tp=1 d_launcher=python d_data="" d_tokenizer=""
  d_save_interval=3 d_eval_interval=3 d_eval_iters=1 d_log_interval=1 d_focus_groups=4
fi

NODES="${NODES:-$d_nodes}" GPUS_PER_NODE="${GPUS_PER_NODE:-$d_gpus}"
TP="${TP:-$d_tp}" ZERO="${ZERO:-$d_zero}"
SP="${SP:-$([[ $TP -gt 1 ]] && echo 1 || echo 0)}"  # sequence parallelism wherever TP > 1
MBS="${MBS:-$d_mbs}" GBS="${GBS:-$d_gbs}" SEQ="${SEQ:-$d_seq}"
TRAIN_ITERS="${TRAIN_ITERS:-$d_iters}" WARMUP="${WARMUP:-$d_warmup}"
LR="${LR:-$d_lr}" MIN_LR="${MIN_LR:-$d_min_lr}" SEED="${SEED:-1234}"
DATA_PATH="${DATA_PATH-$d_data}" TOKENIZER_TYPE="${TOKENIZER_TYPE:-$d_tokenizer_type}"
TOKENIZER_MODEL="${TOKENIZER_MODEL-$d_tokenizer}" VOCAB_SIZE="${VOCAB_SIZE:-$d_vocab}"
LAUNCHER="${LAUNCHER:-$d_launcher}" FOCUS_GROUPS="${FOCUS_GROUPS:-$d_focus_groups}"
SAVE_INTERVAL="${SAVE_INTERVAL:-$d_save_interval}" EVAL_INTERVAL="${EVAL_INTERVAL:-$d_eval_interval}"
EVAL_ITERS="${EVAL_ITERS:-$d_eval_iters}" LOG_INTERVAL="${LOG_INTERVAL:-$d_log_interval}"
DS_CONFIG="${DS_CONFIG:-$ROOT/examples/ds_zero${ZERO}_bf16.json}"
# a smoke run gets a folder of its own: the real recipe's stays for the real run
if [[ "${SMOKE:-0}" == 1 ]]; then smoke=-smoke; else smoke=""; fi
RUN_NAME="${RUN_NAME:-$MODEL-${ATTENTION/+/-}-seed$SEED$smoke}"
RUN_DIR="${RUN_DIR:-runs/$RUN_NAME}"
CKPT="${CKPT:-$RUN_DIR/checkpoints}" TB="${TB:-$RUN_DIR/tensorboard}"
# The dataset index cache must be one folder every rank of every node sees (rank 0 writes it):
# by default it sits next to the data, which all nodes read anyway.
if [[ -n "$DATA_PATH" ]]; then
  DATA_CACHE="${DATA_CACHE:-$(dirname "$DATA_PATH")/index-cache}"
  # tools/prepare_fineweb.py writes the split that makes its held-out shards the validation set.
  d_split=$(cat "$DATA_PATH.split" 2>/dev/null || echo 969,30,1)
  SPLIT="${SPLIT:-$d_split}"
fi

# ------------------------------------------------------------------------------------------------
ARGS=(
  --attention "$ATTENTION"
  --num-layers "${LAYERS:-$d_layers}" --hidden-size "${HIDDEN:-$d_hidden}"
  --num-attention-heads "${HEADS:-$d_heads}" --kv-channels "${KV_CHANNELS:-$d_kv}"
  --seq-length "$SEQ" --max-position-embeddings "$SEQ"
  --position-embedding-type rope --disable-bias-linear
  --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02
  --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS"
  --lr "$LR" --min-lr "$MIN_LR" --lr-warmup-iters "$WARMUP" --lr-decay-style cosine
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --seed "$SEED"
  --tensor-model-parallel-size "$TP" --deepspeed_config "$DS_CONFIG"
  --save "$CKPT" --load "$CKPT" --save-interval "$SAVE_INTERVAL" --tensorboard-dir "$TB"
  --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
  --exit-signal-handler
)
if [[ "$MODEL" == 7b ]]; then
  ARGS+=(--group-query-attention --num-query-groups "${KV_GROUPS:-$d_groups}"
         --ffn-hidden-size "${FFN:-$d_ffn}" --swiglu --normalization RMSNorm --rotary-base 10000
         --untie-embeddings-and-output-weights)
fi
[[ "$SP" == 1 ]] && ARGS+=(--sequence-parallel)
[[ "$ATTENTION" == focus* ]] && ARGS+=(--focus-groups "$FOCUS_GROUPS")
if [[ -n "$DATA_PATH" ]]; then
  ARGS+=(--data-path "$DATA_PATH" --split "$SPLIT" --tokenizer-type "$TOKENIZER_TYPE"
         --tokenizer-model "$TOKENIZER_MODEL" --data-cache-path "$DATA_CACHE")
elif [[ -n "${DATA_CACHE:-}" ]]; then
  ARGS+=(--data-cache-path "$DATA_CACHE")  # where the embedded corpus is cached
fi
# shellcheck disable=SC2206
ARGS+=(${EXTRA_ARGS:-} "$@")

if [[ "${PLAN:-0}" == 1 ]]; then
  # shellcheck disable=SC2086  # PLAN_ARGS holds several flags
  exec "$PYTHON" "$ROOT/tools/plan.py" "${ARGS[@]}" --nodes "$NODES" \
    --gpus-per-node "$GPUS_PER_NODE" --vocab-size "$VOCAB_SIZE" ${PLAN_ARGS:-}
fi

# ------------------------------------------------------------------------------------------------
# shellcheck disable=SC2206
case "$LAUNCHER" in
  deepspeed)
    CMD=(deepspeed)
    if [[ -n "${HOSTFILE:-}" ]]; then
      CMD+=(--hostfile "$HOSTFILE" --num_nodes "$NODES")
    elif [[ "$NODES" -gt 1 ]]; then
      die "NODES=$NODES needs HOSTFILE (one 'host slots=$GPUS_PER_NODE' line per node; see examples/hostfile)"
    fi
    CMD+=(--num_gpus "$GPUS_PER_NODE")
    # Without ssh (e.g. under srun): each node runs this script with its NODE_RANK.
    [[ -n "${NODE_RANK:-}" ]] && CMD+=(--no_ssh --node_rank "$NODE_RANK")
    [[ -n "${MASTER_ADDR:-}" ]] && CMD+=(--master_addr "$MASTER_ADDR")
    [[ -n "${MASTER_PORT:-}" ]] && CMD+=(--master_port "$MASTER_PORT")
    CMD+=(${LAUNCHER_ARGS:-} "$ROOT/pretrain_gpt.py") ;;
  torchrun)
    CMD=(torchrun --nnodes "$NODES" --nproc_per_node "$GPUS_PER_NODE" --node_rank "${NODE_RANK:-0}"
         --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}"
         ${LAUNCHER_ARGS:-} "$ROOT/pretrain_gpt.py") ;;
  python)
    [[ "$NODES" -eq 1 && "$GPUS_PER_NODE" -eq 1 ]] || \
      die "LAUNCHER=python runs one process: set NODES=1 GPUS_PER_NODE=1 (or use deepspeed)"
    CMD=("$PYTHON" "$ROOT/pretrain_gpt.py") ;;
  *) die "LAUNCHER=$LAUNCHER: choose deepspeed, torchrun or python" ;;
esac
CMD+=("${ARGS[@]}")

echo "# MODEL=$MODEL ATTENTION=$ATTENTION NODES=$NODES GPUS_PER_NODE=$GPUS_PER_NODE TP=$TP SP=$SP ZERO=$ZERO MBS=$MBS GBS=$GBS RUN_DIR=$RUN_DIR"
printf '%q ' "${CMD[@]}"; echo
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0

if [[ -n "$DATA_PATH" && ! -f "$DATA_PATH.idx" ]]; then
  die "DATA_PATH=$DATA_PATH: no $DATA_PATH.idx; make it with tools/prepare_fineweb.py (docs/recipes.md)"
fi
mkdir -p "$RUN_DIR"
if [[ "${NODE_RANK:-0}" == 0 ]]; then
  # What tools/compare_runs.py needs to put runs side by side (tokens = iteration x GBS x SEQ).
  cat > "$RUN_DIR/run.json" <<EOF
{"label": "${LABEL:-$MODEL $ATTENTION}", "model": "$MODEL", "attention": "$ATTENTION", "seed": $SEED,
 "seq_length": $SEQ, "global_batch_size": $GBS, "nodes": $NODES, "gpus_per_node": $GPUS_PER_NODE,
 "tensor_model_parallel_size": $TP, "zero_stage": $ZERO, "micro_batch_size": $MBS}
EOF
fi
exec "${CMD[@]}"
