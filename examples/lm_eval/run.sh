#!/usr/bin/env bash
# lm-evaluation-harness on a native checkpoint, with local tasks (nothing is downloaded):
#
#   pip install -e ".[hf,eval]" -c constraints/cpu.txt
#   bash examples/lm_eval/run.sh CHECKPOINT_DIR [OUT_DIR] [extra lm-eval arguments...]
#
# Exports the checkpoint (tools/convert_to_hf.py), then runs examples/lm_eval/tasks
# (docstrings_ppl: perplexity on held-out prose; docstrings_cloze: four-way next-words choice)
# through lm-eval's `hf` model, as any HF model is evaluated. A Focus model is evaluated once per
# rule, chosen by model arguments: the soft gate, then the sparse top-1 and top-2 rules. lm-eval
# runs under examples/lm_eval/timed.py, which times the model's forwards; results go to
# OUT_DIR/results/<rule>/ as lm-eval writes them, with the rule's timing.json. lm-eval's tables
# are printed, then one table of every rule's metrics and time per token (summary.py). Run from
# the repository root (the task files name their data relative to it).
set -euo pipefail
CKPT=${1:?usage: run.sh CHECKPOINT_DIR [OUT_DIR] [lm-eval arguments...]}
OUT=${2:-runs/lm-eval}
shift $(($# < 2 ? $# : 2))
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

python tools/convert_to_hf.py --load "$CKPT" --save-dir "$OUT/hf" --overwrite
if grep -q '"focus' "$OUT/hf/config.json"; then
    RULES=(soft sparse-top1 sparse-top2)
else
    RULES=(dense)
fi
for rule in "${RULES[@]}"; do
    model_args="pretrained=$OUT/hf,trust_remote_code=True,dtype=float32"
    case $rule in
        soft) model_args+=",focus_attention_mode=soft" ;;
        sparse-top*) model_args+=",focus_attention_mode=sparse,focus_top_k=${rule#sparse-top}" ;;
    esac
    echo "=== $rule"
    python examples/lm_eval/timed.py --timing "$OUT/results/$rule/timing.json" \
        run --model hf --model_args "$model_args" \
        --tasks docstrings_ppl docstrings_cloze --include_path examples/lm_eval/tasks \
        --device cpu --batch_size 8 --output_path "$OUT/results/$rule" "$@"
done
echo "=== every rule"
python examples/lm_eval/summary.py "$OUT/results" "${RULES[@]}"
