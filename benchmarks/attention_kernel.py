"""How PyTorch's fused attention kernel spends time on short sequences: what sparse Focus's buckets
are made of. A fixed number of tokens split into sequences of length L, each attended causally
and non-causally; "causal / full" near 1 means causal mode skips no work at that length;
"us per causal pair" against the one long sequence shows how much less efficient short sequences
are (the ideal speedup of sparse Focus counts pairs, as if it were the same). On the CPU,
"strips / causal" times causal attention as the sparse path's slot 0 makes it for short buckets:
strips of 64 queries against the keys up to their last, the diagonal block masked.

    python benchmarks/attention_kernel.py [--tokens 16384 --lengths 256 512 768 1024 2048]
        [--heads 4 --head-dim 64 --repeats 5] [--json out.json]
"""

import argparse
import functools
import json
import statistics

import torch
import torch.nn.functional as F

from megatron_focus import platform
from megatron_focus.model.focus import focus_sparse

from timing import seconds


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--tokens", type=int, default=16384, help="total tokens, also the long sequence")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 768, 1024, 2048, 4096])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="PATH")
    return p.parse_args()


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(seconds(fn) for _ in range(repeats))


def measure(opts, length: int) -> dict:
    device = "cuda" if platform.has_cuda() else "cpu"
    x = torch.randn(opts.tokens // length, opts.heads, length, opts.head_dim, device=device)
    causal = median_seconds(
        lambda: F.scaled_dot_product_attention(x, x, x, is_causal=True), opts.repeats
    )
    full = median_seconds(lambda: F.scaled_dot_product_attention(x, x, x), opts.repeats)
    pairs = x.shape[0] * opts.heads * length * (length + 1) / 2
    strips = float("nan")
    if device == "cpu":
        places = torch.arange(length)  # place r's keys: places [0, r], by strips as slot 0's
        blocks = functools.partial(
            focus_sparse._range_blocks,
            torch.zeros_like(places),
            places + 1,
            x.dtype,
            focus_sparse._STRIP,
        )
        strips = median_seconds(
            lambda: focus_sparse._ranges_attention(x, x, x, blocks, opts.head_dim**-0.5),
            opts.repeats,
        )
    return {
        "length": length,
        "sequences": x.shape[0],
        "causal_ms": causal * 1e3,
        "full_ms": full * 1e3,
        "causal_over_full": causal / full,
        "strips_over_causal": strips / causal,
        "us_per_million_causal_pairs": causal * 1e6 / (pairs / 1e6),
    }


def main() -> None:
    opts = parse()
    torch.set_grad_enabled(False)
    lengths = sorted(set(opts.lengths) | {opts.tokens})
    print(
        f"{opts.tokens} tokens, {opts.heads} heads of {opts.head_dim}, fp32, "
        f"{'cuda' if platform.has_cuda() else f'cpu, {torch.get_num_threads()} threads'}"
    )
    print(
        f"{'length':>7}{'seqs':>6}{'causal ms':>11}{'full ms':>10}{'causal/full':>12}"
        f"{'us/M pairs':>12}{'strips/causal':>15}"
    )
    rows = []
    for length in lengths:
        r = measure(opts, length)
        rows.append(r)
        print(
            f"{length:>7}{r['sequences']:>6}{r['causal_ms']:>11.1f}{r['full_ms']:>10.1f}"
            f"{r['causal_over_full']:>12.2f}{r['us_per_million_causal_pairs']:>12.0f}"
            f"{r['strips_over_causal']:>15.2f}",
            flush=True,
        )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"config": vars(opts), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
