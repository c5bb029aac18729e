"""Passkey retrieval accuracy by context length x depth, for a native checkpoint or an HF export,
in each Focus mode (megatron_focus/evaluation/passkey.py has the task).

    python tools/eval_passkey.py --load CKPT --lengths 1024 2048 4096 --depths 0 0.25 0.5 0.75 1
        [--trials 5] [--top-k 1 2] [--json out.json]
    python tools/eval_passkey.py --hf HF_DIR ...       # an export (tools/convert_to_hf.py)

A Focus model is evaluated with the soft gate and in sparse mode at each `--top-k` (default: 1
and 2); other models once. Greedy decoding, full forward per new token (no cache), so a native
checkpoint and its export answer alike. Models with learned positions take lengths up to their
position table.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_focus import cli  # noqa: E402
from megatron_focus.config.flags import add_unsafe_checkpoints_flag  # noqa: E402


def parse() -> argparse.Namespace:
    p = cli.Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", help="a native checkpoint folder (pretrain_gpt.py --save)")
    source.add_argument("--hf", help="a Hugging Face model folder")
    p.add_argument("--iteration", type=int, default=None, help="--load: default the latest")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=5, help="passkeys per length and depth")
    p.add_argument(
        "--top-k",
        type=int,
        nargs="+",
        default=[1, 2],
        help="Focus: the sparse mode's top-k values to evaluate",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="--hf: run the model code the folder ships (exports of Focus, XSA and "
        "other custom models need it)",
    )
    add_unsafe_checkpoints_flag(p)
    p.add_argument("--json", metavar="PATH")
    opts = p.parse_args()
    if opts.trials < 1 or min(opts.lengths) < 1:
        p.error("--trials and --lengths must be positive")
    if any(not 0 <= d <= 1 for d in opts.depths):
        p.error("--depths are shares of the filler, between 0 and 1")
    return opts


def main() -> None:
    opts = parse()
    from megatron_focus.evaluation.passkey_runner import run  # after parsing: --help stays fast

    run(opts)


if __name__ == "__main__":
    cli.run(main)
