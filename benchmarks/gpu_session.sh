#!/usr/bin/env bash
# A lent GPU's checks in one run (~9 minutes on an H200), results under $OUT (default gpu-results/):
# the GPU tests (FlexAttention paths against the chunked path and dense references), sparse Focus
# against dense causal attention up to 1M tokens (bf16), and the training step of each variant.
#   here, with network:  benchmarks/gpu_wheels.sh
#   device:              run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
# Each part has its own time limit, so one that hangs or fails leaves the others' results.
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then  # the machine's own torch stays; only what it lacks is installed
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__)"; date -u; } | tee "$OUT/machine.txt"

timeout 180 python3 -m pytest -q -rs tests/test_gpu.py 2>&1 | tee "$OUT/tests.txt"
timeout 160 python3 benchmarks/focus_sparse_speed.py --dtype bf16 --groups 8 --top-k 1 2 \
    --seq-lengths 4096 16384 65536 262144 1048576 --json "$OUT/sparse.json" 2>&1 | tee "$OUT/sparse.txt"
timeout 190 python3 benchmarks/variant_overhead.py --variants standard xsa focus focus+xsa \
    --seq-lengths 2048 4096 8192 --num-layers 4 --hidden-size 1024 --num-attention-heads 16 \
    --micro-batch-size 1 --bf16 --iters 10 --warmup 3 --hidden-dropout 0 --attention-dropout 0 \
    --json "$OUT/overhead.json" 2>&1 | tee "$OUT/overhead.txt"
