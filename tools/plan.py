"""Plan a run before launching it: parameters, FLOPs per token, memory per GPU, time.

Takes pretrain_gpt.py's flags (paste the training command's flags) plus the cluster's:

    python tools/plan.py --num-layers 24 --hidden-size 1536 --num-attention-heads 6 \
        --kv-channels 256 --seq-length 2048 --micro-batch-size 8 --global-batch-size 256 \
        --train-iters 200000 --bf16 --zero-stage 1 --nodes 1 --gpus-per-node 8 \
        --gpu-memory-gb 80 --gpu H100 --target-days 7 [--json plan.json]

Prints the parameter counts (embedding / non-embedding), the memory per GPU for every TP size
(with and without sequence parallelism) and ZeRO stage, the chosen configuration's breakdown and
the tokens/s and MFU a target time needs. Exits 1 when the chosen configuration does not fit, with
the flags that would make it fit; 2 on invalid flags. The formulas are in megatron_focus/planner.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The planner computes; it never touches a device. This keeps DeepSpeed's accelerator probe quiet.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from megatron_focus.planner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
