#!/usr/bin/env bash
# The GPU check in one command (under 9 minutes on one H200), each part under its own time limit
# so that one that hangs or fails leaves the others' results, the decisive measurements first and
# the end-to-end runs last; JSON per part (written as it goes) and a summary table under $OUT
# (default gpu-results/):
#   environment  torch within setup.py's range and Triton importable, or the session stops
#   kernels    first, the decisive one: the fused Triton soft gate and XSA against SDPA (flash) and
#              FlexAttention, forward + backward, at the 0.7B recipe's layer and 32 heads of 128
#              (benchmarks/soft_gate_kernel.py: device time, peak memory, a JSON row at a time)
#   tests      tests/test_gpu.py: FlexAttention soft gate and sparse dispatch against the chunked
#              and dense references (fp32, bf16, both gates), memory growth, a model step;
#              the HF model's attention backends (sdpa, flex_attention) against eager
#   e2e-*      the product end to end on CUDA (benchmarks/end_to_end.py): deepspeed --num_gpus 1
#              pretrain_gpt.py --bf16, --save, a resume that continues the same losses,
#              tools/eval_ppl.py (soft and sparse rows), tools/convert_to_hf.py and generate;
#              focus+xsa, and standard (flash-attn when installed, SDPA otherwise)
#   sparse     sparse Focus against dense causal attention, bf16, 4K..1M tokens
#   sparse-train  its training step against dense and the soft gate's, at 4 heads of 64, 32 of
#              128 and the 0.7B recipe's 6 of 256 (device time by CUDA events, host time apart)
#   overhead   the training step of each variant against standard, hidden 1024, bf16
#   recipe     the 0.7B recipe's shape on one GPU, standard and focus+xsa: tokens/s, TFLOP/s,
#              MFU, peak memory
#
# On a machine without network, first `bash benchmarks/gpu_wheels.sh` where there is network,
# and carry .whl/: what the machine lacks is installed from it, its own torch is kept.
# GPU_SESSION_REHEARSAL=1 runs exactly these steps with tiny sizes on the CPU (CI does, under the
# oldest supported torch), so the script cannot rot between GPU sessions.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
REHEARSAL=${GPU_SESSION_REHEARSAL:-0}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/session.log"
: > "$LOG"
: > "$OUT/parts.tsv"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PYTHONPATH" PATH="/tmp/site/bin:$PATH"
fi

# part NAME SECONDS COMMAND...: runs COMMAND under its limit, its output into the log, and
# records its exit status and time in parts.tsv. The limits are the GPU session's; a rehearsal
# on a shared 2-core CPU gets three times as long (its speed varies that much from run to run).
part() {
    local name=$1 limit=$2 start rc
    shift 2
    [ "$REHEARSAL" = 1 ] && limit=$((limit * 3))
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    start=$(date +%s)
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - start))" >> "$OUT/parts.tsv"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
      || echo "no GPU (rehearsal: $REHEARSAL)"
  python3 -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__)"
  date -u; } | tee -a "$LOG"

if [ "$REHEARSAL" = 1 ]; then  # the same steps, sized for a CPU
    KERNELS=(--tiny)
    export TRITON_INTERPRET=1  # the GPU branches' Triton kernels, interpreted on the CPU
    E2E=(--tiny --iters 4)
    SPARSE=(--seq-lengths 1024 2048 --groups 4 --top-k 1 2 --repeats 1)
    SPARSE_TRAIN=(--seq-lengths 1024 --groups 4 --top-k 1 --shapes 2x32 6x16 --repeats 1)
    OVERHEAD=(--seq-lengths 256 --num-layers 1 --hidden-size 64 --num-attention-heads 4
              --micro-batch-size 1 --iters 2 --warmup 1)
    RECIPE=(--smoke --iters 3 --warmup 1)
else
    KERNELS=()
    E2E=(--iters 30)
    SPARSE=(--dtype bf16 --groups 4 8 --top-k 1 2
            --seq-lengths 1024 4096 16384 32768 65536 262144 1048576)
    SPARSE_TRAIN=(--dtype bf16 --groups 8 --top-k 1 --shapes 4x64 32x128 6x256
                  --seq-lengths 4096 32768)
    OVERHEAD=(--seq-lengths 2048 8192 --num-layers 4 --hidden-size 1024
              --num-attention-heads 16 --micro-batch-size 1 --bf16 --iters 10 --warmup 3)
    RECIPE=(--model 0.7b --iters 8 --warmup 3)
fi

# the image's torch within setup.py's range, and Triton for the fused kernels: else stop here
part environment 60 python3 -c "
import torch
major, minor = (int(x) for x in torch.__version__.split('.')[:2])
assert (2, 11) <= (major, minor) < (2, 16), f'torch {torch.__version__}: setup.py takes 2.11-2.15'
import triton
print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda)"
if ! tail -1 "$OUT/parts.tsv" | grep -qP '\t0\t'; then
    python3 benchmarks/session_summary.py "$OUT" | tee "$OUT/summary.txt"
    exit 1
fi
part kernels 90 python3 benchmarks/soft_gate_kernel.py "${KERNELS[@]}" --json "$OUT/kernels.json"
part overhead 80 python3 benchmarks/variant_overhead.py --variants standard xsa focus focus+xsa \
    --hidden-dropout 0 --attention-dropout 0 "${OVERHEAD[@]}" --json "$OUT/overhead.json"
part recipe 80 python3 benchmarks/recipe_speed.py --variants standard focus+xsa "${RECIPE[@]}" \
    --json "$OUT/recipe.json"
# -o addopts="": in this process, one GPU; pytest-xdist need not be there
part tests 180 python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" tests/test_gpu.py \
    "tests/hf/test_hf.py::test_attention_backends_compute_what_eager_computes"
part sparse 80 python3 benchmarks/focus_sparse_speed.py "${SPARSE[@]}" --json "$OUT/sparse.json"
part sparse-train 80 python3 benchmarks/focus_sparse_speed.py --train "${SPARSE_TRAIN[@]}" \
    --json "$OUT/sparse-train.json"
part e2e-focus-xsa 100 python3 benchmarks/end_to_end.py --attention focus+xsa "${E2E[@]}" \
    --json "$OUT/e2e-focus-xsa.json"
part e2e-standard 60 python3 benchmarks/end_to_end.py --attention standard "${E2E[@]}" \
    --json "$OUT/e2e-standard.json"

python3 benchmarks/session_summary.py "$OUT" | tee "$OUT/summary.txt"
