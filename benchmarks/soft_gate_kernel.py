"""The soft gate's kernels against standard attention, one layer's attention: forward, and
forward + backward, time (CUDA events, device time only; medians of interleaved repeats, so a
drift of the GPU's clock touches every row alike) and peak memory, side by side in one process.

Rows: SDPA causal (flash on a GPU: the standard model's attention), a plain causal
FlashAttention-2 in Triton at the gate's own tiles (benchmarks/flash_reference.py: what the gate
would cost with its gate taken out), the fused Triton soft gate, FlexAttention's soft gate, and,
as shares of SDPA, XSA's projection and the causal Sinkhorn (10 iterations) alone, the Sinkhorn
also as PyTorch runs it. Each shape is measured apart and its JSON written at once, so a failure
(an error, an out-of-memory) costs only that row. Shapes: the 0.7B recipe's layer (6 heads of
256) and 32 heads of 128 with GQA 4 (a Llama shape; also 32x128 without), q, k, v laid out as
the model lays them out.

    python benchmarks/soft_gate_kernel.py [--seq-length 2048 --batch 4 --groups 8]
        [--repeats 10] [--json out.json] [--strict]

Targets on an H100/H200 (issue: Focus trains at FlashAttention's pace): the gate's forward +
backward at most 1.3x SDPA at 32x128 GQA 4, 1.5x at 6x256. Without a GPU it rehearses the same
calls at tiny sizes with the Triton kernels interpreted (TRITON_INTERPRET=1), so the script is
exercised by CI.
"""

import argparse
import json
import os
import statistics
import traceback

import torch
import torch.nn.functional as F

from megatron_focus import platform

from timing import timed

# heads, head dim, key/value heads
SHAPES = {"0.7b": (6, 256, 6), "32x128": (32, 128, 32), "32x128-gqa4": (32, 128, 8)}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--groups", type=int, default=8, help="Focus's K")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--shapes", nargs="+", default=["0.7b", "32x128-gqa4"], choices=list(SHAPES))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="CPU rehearsal sizes")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--strict", action="store_true", help="exit 1 if any row failed")
    return p.parse_args()


def interleaved_ms(fns: dict, repeats: int) -> dict:
    """name -> median device time of fns[name]() in ms (CUDA events; wall clock on the CPU),
    the calls interleaved repeat by repeat; a call that fails is left out, its error kept."""
    times, errors = {name: [] for name in fns}, {}
    for repeat in range(repeats + 1):  # the first: warm-up (compilation, autotuning)
        for name, fn in fns.items():
            if name in errors:
                continue
            try:
                took = timed(fn).device * 1e3
            except Exception:  # noqa: BLE001 -- kept as the row's error, the others still run
                errors[name] = traceback.format_exc(limit=3)
                continue
            if repeat:
                times[name].append(took)
    return {name: statistics.median(t) for name, t in times.items() if t}, errors


def peak_mib(fn) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def calls(opts, heads: int, head_dim: int, kv_heads: int) -> dict:
    """name -> (forward, forward + backward) of one layer's attention (or XSA, or the Sinkhorn,
    alone; forward None where only the pair is timed), on q, k, v laid out as Megatron's
    SelfAttention hands them over (views of one fused QKV output, K a new tensor as RoPE's)."""
    from flash_reference import reference_attention

    from megatron_focus.model.focus.sinkhorn import causal_sinkhorn
    from megatron_focus.model.kernels import triton_launch
    from megatron_focus.model.kernels.flex import flex_soft_focus
    from megatron_focus.model.kernels.triton_gate import triton_soft_focus
    from megatron_focus.model.kernels.triton_sinkhorn import triton_causal_sinkhorn
    from megatron_focus.model.kernels.triton_xsa import triton_exclusive_projection

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    shape = (opts.batch, heads, opts.seq_length, head_dim)
    rep, s, b = heads // kv_heads, opts.seq_length, opts.batch
    qkv = torch.randn(s, b, kv_heads, (rep + 2) * head_dim, device=device, dtype=dtype)
    q, k, v = torch.split(qkv.requires_grad_(), [rep * head_dim, head_dim, head_dim], dim=-1)
    q, k, v = (t.reshape(s, b, -1, head_dim).permute(1, 2, 0, 3) for t in (q, k.contiguous(), v))
    scores = torch.randn(opts.batch, opts.seq_length, opts.groups, device=device) * 3
    log_g = causal_sinkhorn(scores, 3).requires_grad_()
    scores.requires_grad_()
    dout = torch.randn(shape, device=device, dtype=dtype)
    soft = dict(window=opts.window, gate_scale=1.0, scale=head_dim**-0.5)

    capability = triton_launch.capability_of(q)
    tiles = {
        p: triton_launch.gate_tile(p, capability, head_dim, dtype)
        for p in triton_launch.GATE_PASSES
    }

    def both(out):
        """(forward without autograd's graph, forward + backward)."""

        def forward():
            with torch.no_grad():
                out()

        return forward, lambda: torch.autograd.backward(out(), dout)

    table = {
        "sdpa causal": both(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)
        ),
        "flash reference": both(lambda: reference_attention(q, k, v, head_dim**-0.5, tiles)),
        "triton soft gate": both(lambda: triton_soft_focus(q, k, v, log_g, **soft)),
        "xsa (alone)": both(lambda: triton_exclusive_projection(q, v)),
        "sinkhorn (alone)": (
            None,
            lambda: torch.autograd.backward(
                triton_causal_sinkhorn(scores, 10), torch.ones_like(scores)
            ),
        ),
        "sinkhorn, pytorch": (
            None,
            lambda: torch.autograd.backward(causal_sinkhorn(scores, 10), torch.ones_like(scores)),
        ),
    }
    if device == "cuda":  # FlexAttention has no CPU backward
        table["flex soft gate"] = both(lambda: flex_soft_focus(q, k, v, log_g, **soft))
    return table


def main() -> None:
    opts = parse()
    if opts.tiny:
        opts.seq_length, opts.batch, opts.repeats, opts.groups = 40, 1, 1, 4
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("without a GPU, run with TRITON_INTERPRET=1 (the Triton interpreter)")
    platform.setup()
    results = []
    print(
        f"{'shape':>8} {'kernel':>18} {'ms fwd':>8} {'ms fwd+bwd':>11} {'x sdpa':>7} "
        f"{'x ref':>6} {'peak MiB':>9}"
    )
    for name in opts.shapes:
        heads, head_dim, kv_heads = SHAPES[name]
        if opts.tiny:
            heads, head_dim, kv_heads = 4, 16, 4 * kv_heads // heads
        try:
            table = calls(opts, heads, head_dim, kv_heads)
        except Exception:  # noqa: BLE001 -- a shape that cannot be built is one failed row
            results.append({"shape": name, "error": traceback.format_exc(limit=3)})
            continue
        forward, forward_errors = interleaved_ms(
            {kernel: pair[0] for kernel, pair in table.items() if pair[0] is not None},
            opts.repeats,
        )
        both, errors = interleaved_ms({kernel: pair[1] for kernel, pair in table.items()},
                                      opts.repeats)  # fmt: skip
        sdpa, reference = both.get("sdpa causal"), both.get("flash reference")
        for kernel, (_, pair) in table.items():
            row = dict(shape=name, heads=heads, head_dim=head_dim, kv_heads=kv_heads, kernel=kernel)
            if kernel in errors or kernel in forward_errors:
                row["error"] = errors.get(kernel) or forward_errors[kernel]
                print(f"{name:>8} {kernel:>18} failed: {row['error'].splitlines()[-1]}")
            else:
                row.update(ms=both[kernel], ms_forward=forward.get(kernel))
                row["peak_mib"] = peak_mib(pair)
                row["x_sdpa"] = row["ms"] / sdpa if sdpa else None
                row["x_reference"] = row["ms"] / reference if reference else None
                cells = [
                    f"{row['ms_forward']:.2f}" if row["ms_forward"] else "-",
                    f"{row['ms']:.2f}",
                    f"{row['x_sdpa']:.2f}" if row["x_sdpa"] else "-",
                    f"{row['x_reference']:.2f}" if row["x_reference"] else "-",
                ]
                print(
                    f"{name:>8} {kernel:>18} {cells[0]:>8} {cells[1]:>11} {cells[2]:>7} "
                    f"{cells[3]:>6} {row['peak_mib']:>9.0f}"
                )
            results.append(row)
        if opts.json:  # after every shape: a later failure loses nothing measured
            with open(opts.json, "w") as f:
                json.dump({"config": vars(opts), "results": results}, f, indent=2)
    if opts.strict and any("error" in row for row in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
