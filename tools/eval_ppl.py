"""Perplexity of a checkpoint on the validation split, at one or several context lengths; for
Focus, the effect of top-k.

For a Focus model, one row for the soft gate (how it trained) and one per top-k = 1..K in sparse
mode (the hard rule, run by the sparse dispatch): loss, perplexity, the share of causal pairs kept
(mean over layers), the share of the dense attention's probability mass those pairs hold (the
kept mass: mean over layers, each layer's in --json; it measures the routing: a router that puts
queries with the keys they attend to keeps much of it in few pairs), and the time per token of
the model's forward and of the attention inside it (microseconds, after an untimed warm-up
forward) — the paper's "effect of top-k" table, with the price of each top-k, measured on this
model. Other models get one row. `--seq-lengths 1024 2048
4096 8192` repeats it at each length (the paper's long-context table: PPL and forward time per
token by length for each mode); RoPE models go beyond their training length, models with learned
positions up to their position table.

    python tools/eval_ppl.py --load CKPT [--data-path PREFIX --tokenizer-type T --tokenizer-model M]
        [--eval-iters 20 --micro-batch-size 4] [--seq-lengths 1024 4096] [--json out.json]

Without --data-path it reads the embedded corpus (the default of pretrain_gpt.py). The model is
rebuilt from the checkpoint's own settings and merged to one process, whatever its TP size.
Without --seq-lengths it evaluates at --seq-length (capped at a learned position table), and
without that at the checkpoint's own length (its --max-position-embeddings, which a run sets
to its --seq-length unless given).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_focus import cli  # noqa: E402
from megatron_focus.config.flags import build_parser  # noqa: E402


def parse() -> tuple[argparse.Namespace, argparse.Namespace]:
    p = cli.Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True)
    p.add_argument("--iteration", type=int, default=None, help="default: the latest")
    p.add_argument(
        "--seq-lengths",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="context lengths to evaluate at (default: --seq-length, else the checkpoint's)",
    )
    p.add_argument("--json", metavar="PATH")
    opts, rest = p.parse_known_args()
    if opts.seq_lengths and min(opts.seq_lengths) < 2:
        p.error("--seq-lengths must be at least 2")
    args = build_parser().parse_args(rest)  # data and evaluation flags, as pretrain_gpt.py's;
    # the model comes from the checkpoint
    return opts, args


def main() -> None:
    opts, args = parse()
    from megatron_focus.evaluation.perplexity import run  # after parsing: --help stays fast

    run(opts, args)


if __name__ == "__main__":
    cli.run(main)
