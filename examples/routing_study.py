"""Does the learned router earn its keep on text? Issue 49's language-modelling study.

Tiny models trained on the embedded corpus (pretrain_gpt.py's default data: stdlib docstrings,
~458K tokens) at one --seq-length, one per variant and seed with the same data and budget, then
scored by `tools/eval_ppl.py` on the validation split: loss and perplexity, and for Focus each
mode (soft, sparse top-1..K) with the share of causal pairs kept and the kept mass (the share of
the dense attention's probability those pairs hold). Variants, as in mqar_study.py:

  standard      full causal attention
  window        sliding-window attention over Focus's local window alone (--window-size w-1,0)
  focus         Focus with its learned router
  focus-random  the control: a router that never learns (--focus-router random)
  focus-distilled  a router trained by distillation from the dense attention after a dense
                warm-up of a fifth of the budget (docs/routing.md)

(any other mqar_study.py variant is accepted too: focus+xsa, focus+xsa-random, ...). Prints one
table (mean over seeds, [min, max] when several), writes JSON and a plot of the validation loss.

    python examples/routing_study.py --out runs/routing-1k --seq-length 1024 \\
        --json routing-1k.json --plot routing-1k.png
    python examples/routing_study.py --out runs/routing-4k --seq-length 4096 \\
        --json routing-4k.json --plot routing-4k.png

Each step trains on 8192 tokens (--micro-batch-size defaults to 8192 // --seq-length). Time on
2 CPU cores, from one timing run (Focus, 1024 tokens, 8 sequences a step: 2.8 s a step when it
had both cores, 11-19 s while another job shared them): 150 steps of Focus take about 8 minutes,
standard and window less, and evaluation and start-up about a minute per model, so the default
study at 1024 tokens with one seed takes about 30-35 minutes. At 4096 tokens the attention costs
four times as much per token and the study perhaps 50-70 minutes (estimated, not timed). The
validation split is ~14K tokens (3% of the corpus): at 4096 tokens, 3 sequences, evaluated
repeatedly by --eval-iters; the loss differences it can show are coarse.

`--tiny` is a seconds-long smoke run (one layer, 3 steps of 64 tokens).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mqar_study as study  # noqa: E402

TINY = {
    "seq_length": 64,
    "iters": 3,
    "layers": 1,
    "hidden": 32,
    "heads": 2,
    "focus_window": 8,
    "micro_batch_size": 2,
    "eval_iters": 1,
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", required=True, help="folder for the runs (checkpoints, reports)")
    p.add_argument("--variants", nargs="+", default=["standard", "window", "focus", "focus-random"])
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--iters", type=int, default=150)
    study.add_model_args(p)
    p.add_argument("--tiny", action="store_true", help="a smoke run: tiny model, few steps")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    p.set_defaults(
        micro_batch_size=None,  # 8192 tokens a step
        focus_window=64,
        eval_iters=4,
        # what mqar_study's runs read and a corpus study does not use
        task="corpus",
        short_seq_length=None,
        init_from=None,
        mqar_min_distance=None,
    )
    opts = p.parse_args()
    if opts.tiny:  # its sizes, where no flag gave one
        p.set_defaults(**TINY)
        opts = p.parse_args()
    if opts.micro_batch_size is None:
        opts.micro_batch_size = max(1, 8192 // opts.seq_length)
    for name in opts.variants:
        study.variant_flags(name, opts)  # unknown names fail before any training
    return opts


def main() -> None:
    opts = parse()
    results = study.run_all(opts)
    summary = study.summarise(results)
    settings = (
        f"embedded corpus, seq {opts.seq_length}, {opts.iters} steps of "
        f"{opts.micro_batch_size} sequences, seeds {opts.seeds}; "
        f"Focus window {opts.focus_window}, K {opts.focus_groups}"
    )
    print(settings)
    print(study.table(summary, ["loss", "ppl"]))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"settings": vars(opts), "summary": summary, "runs": results}, f, indent=1)
    if opts.plot:
        study.plot(summary, opts.plot, settings, metric="loss")


if __name__ == "__main__":
    main()
