#!/usr/bin/env bash
# The GPU check in one command of at most 10 minutes (all parts within a 540 s deadline, so the
# summary is written even when a part runs out of time), the most important part first; JSON per
# part (written as it goes) and a summary table under $OUT (default gpu-results/):
#   environment  torch within setup.py's range and Triton importable, or the session stops
#   correct    a RoPE (and a QK-norm) GQA 4:1 model in bf16 on the fused kernels against the
#              chunked gate: loss and gradients (tests/test_gpu.py)
#   kernels    the fused soft gate, a plain FlashAttention-2 in Triton at the gate's tiles, XSA
#              and the Sinkhorn against SDPA (flash): forward, and forward + backward, medians
#              of interleaved repeats, at the 0.7B recipe's layer (6 heads of 256) and 32x128
#              GQA 4 (targets: the gate at most 1.5x and 1.3x SDPA forward + backward)
#   sparse     sparse Focus (the fused kernel, and the parts it replaces) against dense causal
#              attention at 4K, 8K and 32K tokens, 32x128, bf16
#   recipe     step time, tokens/s, MFU and peak memory of standard, xsa, focus and focus+xsa
#              at the 0.7B recipe's shape (steady iterations; target: focus at most 1.15x)
#   fit        each kernel as the driver loads it on this GPU (registers, spills) beside the
#              CPU compile's prediction (benchmarks/kernel_fit.py --device)
#   profile    where sparse Focus's time goes at 8K and 32K, kernel by kernel, by device time
#              (host time beside it), the fused kernel's and the parts' path's
#   tiles      the fused sparse kernel's forward at 32K tokens with other tiles than
#              triton_launch.py's table (three pipeline stages; 128 keys a step) beside the
#              table's, in one run: what the table should say on this GPU
#   generate   the exported model in sparse mode against the standard one: prefill (the prompt
#              in one call, so that Focus's takes the fused sparse kernel) and decoding at 4K
#              and 32K tokens of context, bf16 (benchmarks/focus_generate.py)
#   tests      the rest of tests/test_gpu.py and the HF model's attention backends
#   graphs     the same models with a StaticCache, each decoding step one CUDA graph
#              (torch.compile "reduce-overhead"), beside their eager steps, at 8K tokens
#   sparse-train  a sparse training step (forward + backward) against dense and soft at 4K and
#              8K tokens, 32x128, bf16, with and without its CUDA graphs
#   tiles-train   the same at 8K tokens with the backward passes' tiles at three stages
#   e2e-*      the product end to end on CUDA (benchmarks/end_to_end.py), if time is left
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

# part NAME SECONDS COMMAND...: runs COMMAND under its limit (cut to what is left before the
# deadline; skipped when under 20 s are left), its output into the log, and records its exit
# status and time in parts.tsv. A rehearsal on a shared 2-core CPU gets three times as long (its
# speed varies that much from run to run) and no deadline.
DEADLINE=$(($(date +%s) + 540))
part() {
    local name=$1 limit=$2 start rc left
    shift 2
    if [ "$REHEARSAL" = 1 ]; then
        limit=$((limit * 3))
    else
        left=$((DEADLINE - $(date +%s)))
        if [ "$left" -lt 20 ]; then
            printf '%s\tskipped\t0\n' "$name" >> "$OUT/parts.tsv"
            return
        fi
        [ "$limit" -gt "$left" ] && limit=$left
    fi
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
    FIT=(--head-dims 64 --gqa 1 --gates log)
    E2E=(--tiny --iters 4)
    SPARSE=(--seq-lengths 1024 --groups 4 --top-k 1 --shapes 2x32 --repeats 1)
    SPARSE_TRAIN=(--seq-lengths 512 --groups 4 --top-k 1 --shapes 2x32 --repeats 1)
    PROFILE=(--seq-lengths 512 --groups 4 --top-k 1 --shapes 2x32 --repeats 1)
    RECIPE=(--smoke --iters 3 --warmup 1)
    GENERATE=(--tiny --device cpu)
    GRAPHS=(--tiny --device cpu --top-k 1 --static)
    TILES=(--seq-lengths 128 --groups 4 --top-k 1 --shapes 2x32 --repeats 1
           --tiles forward=32x32x4x3)
    TILES_TRAIN=(--seq-lengths 128 --groups 4 --top-k 1 --shapes 2x32 --repeats 1 --train
                 --tiles keys=16x32x4x3)
else
    KERNELS=()
    FIT=(--device --gqa 1 4 --gates log)
    E2E=(--iters 30)
    SPARSE=(--dtype bf16 --groups 8 --top-k 1 2 --shapes 32x128 --seq-lengths 4096 8192 32768)
    SPARSE_TRAIN=(--dtype bf16 --groups 8 --top-k 1 --shapes 32x128 --seq-lengths 4096 8192)
    PROFILE=(--dtype bf16 --groups 8 --top-k 1 --shapes 32x128 --seq-lengths 8192 32768 --repeats 1)
    RECIPE=(--model 0.7b --iters 5 --warmup 3)
    GENERATE=(--device cuda --dtype bf16 --contexts 4096 32768 --prefill-chunk 32768)
    GRAPHS=(--device cuda --dtype bf16 --contexts 8192 --prefill-chunk 8192 --top-k 1 --static)
    TILES=(--dtype bf16 --groups 8 --top-k 1 --shapes 32x128 --seq-lengths 32768
           --tiles forward=128x64x8x3 forward=128x128x8x2)
    TILES_TRAIN=(--dtype bf16 --groups 8 --top-k 1 --shapes 32x128 --seq-lengths 8192 --train
                 --tiles keys=16x128x8x3 queries=128x32x8x3)
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
part correct 120 python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" tests/test_gpu.py \
    -k "rope_gqa_model_on_the_fused_kernels"
part kernels 100 python3 benchmarks/soft_gate_kernel.py "${KERNELS[@]}" --json "$OUT/kernels.json"
part sparse 90 python3 benchmarks/focus_sparse_speed.py "${SPARSE[@]}" --json "$OUT/sparse.json"
part recipe 160 python3 benchmarks/recipe_speed.py --variants standard xsa focus focus+xsa \
    "${RECIPE[@]}" --json "$OUT/recipe.json"
# the compiler, not the interpreter: without TRITON_INTERPRET
part fit 90 env -u TRITON_INTERPRET python3 benchmarks/kernel_fit.py "${FIT[@]}" \
    --json "$OUT/fit.json"
part profile 45 python3 benchmarks/focus_sparse_speed.py "${PROFILE[@]}" --profile
part tiles 60 python3 benchmarks/focus_sparse_speed.py "${TILES[@]}" --json "$OUT/tiles.json"
part generate 40 python3 benchmarks/focus_generate.py "${GENERATE[@]}" --json "$OUT/generate.json"
# -o addopts="": in this process, one GPU; pytest-xdist need not be there
part tests 120 python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" tests/test_gpu.py \
    -k "not rope_gqa_model_on_the_fused_kernels" \
    "tests/hf/test_hf.py::test_attention_backends_compute_what_eager_computes"
part graphs 120 python3 benchmarks/focus_generate.py "${GRAPHS[@]}" --json "$OUT/graphs.json"
part sparse-train 60 python3 benchmarks/focus_sparse_speed.py "${SPARSE_TRAIN[@]}" --train \
    --json "$OUT/sparse-train.json"
part tiles-train 60 python3 benchmarks/focus_sparse_speed.py "${TILES_TRAIN[@]}" \
    --json "$OUT/tiles-train.json"
part e2e-focus-xsa 100 python3 benchmarks/end_to_end.py --attention focus+xsa "${E2E[@]}" \
    --json "$OUT/e2e-focus-xsa.json"

python3 benchmarks/session_summary.py "$OUT" | tee "$OUT/summary.txt"
