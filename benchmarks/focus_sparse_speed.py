"""Sparse Focus attention (forward, inference) against dense causal attention, side by side;
with --train, a training step of each (forward + backward of q, k, v) and of the soft gate.

Both use the same kernel family: PyTorch's fused CPU attention (`scaled_dot_product_attention`
with `is_causal=True` for dense; the same flash kernel inside the packed bucket call for Focus).
Focus's time includes its routing (top-k, the stable sort, packing) and the local window part.
Assignments come from the causal Sinkhorn on random scores, so groups are balanced as in a
trained model. q, k, v are laid out as the model hands them to both (permuted views of Megatron's
[s, b, heads, d]). "ideal" is dense pairs / kept pairs; "of ideal" is measured speedup / ideal.
With --train, "over kept" is (sparse step / dense step) / kept share: 1 when a sparse step costs
what its kept pairs cost; the soft step is the chunked (CPU) or fused (GPU) soft gate, its
assignments trained too. Times are device time (CUDA events on a GPU; wall clock on the CPU),
"host ms" the sparse call's host time apart (until it returns: on a GPU, launching its kernels).
On a GPU the sparse call is the fused kernel (triton_sparse.py) where it has tiles, and the JSON
holds the parts' path it replaces beside it ("parts_ms"); where its forward measured under 1 ms
a repeated shape replays CUDA graphs (graphs.py: the call, or in training its forward and its
backward), and "no graph ms" is the same call without them. With --tiles, the fused kernel
(interpreted on the CPU) is also timed with one pass's tile replaced, each candidate beside the
table's tiles in the same interleaved repeats, both without graphs: what a GPU's own timings
say of triton_launch.py's sparse table.

    python benchmarks/focus_sparse_speed.py [--seq-lengths 1024 4096 16384] [--groups 4 8]
        [--top-k 1 2] [--shapes 4x64 32x128 6x256] [--window 128] [--dtype bf16] [--profile]
        [--train] [--tiles forward=128x64x8x3 keys=32x128x8x2 ...] [--json out.json] [--strict]
"""

import argparse
import contextlib
import functools
import itertools
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from megatron_focus import platform
from megatron_focus.model.focus import focus_sparse
from megatron_focus.model.focus.focus import group_stats
from megatron_focus.model.focus.focus_gate import focus_attention
from megatron_focus.model.focus.focus_sparse import sparse_focus_attention
from megatron_focus.model.focus.groups import Routing
from megatron_focus.model.focus.sinkhorn import causal_sinkhorn
from megatron_focus.model.kernels import graphs, kernels, triton_launch

from timing import timed


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--seq-lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768]
    )
    p.add_argument("--groups", type=int, nargs="+", default=[4, 8])
    p.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--shapes",
        type=shape,
        nargs="+",
        default=[(4, 64)],
        metavar="HEADSxDIM",
        help="attention heads x head dim, e.g. 32x128 (Llama 7B) or 6x256 (the 0.7B recipe)",
    )
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--profile",
        action="store_true",
        help="also print where the sparse call's time goes (torch.profiler, 3 calls; on a GPU "
        "by device time, kernel by kernel, host time beside it, for the fused kernel and the "
        "parts' path; on the CPU by host time and input shape)",
    )
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16 is for GPUs (the CPU's flash kernel is fastest in fp32)",
    )
    p.add_argument(
        "--train",
        action="store_true",
        help="time training steps (forward + backward): dense, soft gate and sparse",
    )
    p.add_argument(
        "--tiles",
        nargs="+",
        type=tile_choice,
        default=[],
        metavar="PASS=TILE",
        help="also time the fused kernel with this pass's tile (forward, keys or queries; rows x "
        "keys x warps x stages, as triton_launch.py's table) beside the table's, without graphs",
    )
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--strict", action="store_true", help="exit 1 if any --tiles failed")
    args = p.parse_args()
    if not args.train and any(not choice.startswith("forward=") for choice in args.tiles):
        p.error("--tiles keys=... and queries=... are backward passes: time them with --train")
    return args


def tile_choice(text: str) -> str:
    pass_, _, tile = text.partition("=")
    sizes = tile.split("x")
    if pass_ not in triton_launch.SPARSE_PASSES or len(sizes) != 4 or not all(
        size.isdigit() and int(size) > 0 for size in sizes
    ):  # fmt: skip
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected PASS=ROWSxKEYSxWARPSxSTAGES, PASS one of "
            f"{', '.join(triton_launch.SPARSE_PASSES)}, e.g. forward=128x64x8x3"
        )
    return text


@contextlib.contextmanager
def tile_replaced(choice: str):
    """The fused kernel's tiles as triton_launch.py's table has them, but one pass's (`choice`,
    PASS=TILE) replaced where the table has a tile."""
    pass_, _, text = choice.partition("=")
    table = triton_launch.sparse_tile

    def replaced(p, capability, head_dim, dtype):
        chosen = table(p, capability, head_dim, dtype)
        return triton_launch._tile(text) if p == pass_ and chosen else chosen

    triton_launch.sparse_tile = replaced
    try:
        yield
    finally:
        triton_launch.sparse_tile = table


def without_graphs(call):
    """`call()` with the sparse path's CUDA graphs off: what they save."""
    kept = focus_sparse._GRAPHS
    focus_sparse._GRAPHS = graphs.Graphs(capacity=0)
    try:
        return call()
    finally:
        focus_sparse._GRAPHS = kept


def tiled(choice: str, call):
    with tile_replaced(choice):
        return without_graphs(call)


def shape(text: str) -> tuple:
    heads, _, dim = text.partition("x")
    if not (heads.isdigit() and dim.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected HEADSxDIM, e.g. 32x128")
    return int(heads), int(dim)


def profile(call, title: str):
    """Where a call's time goes, 3 calls: on a GPU by device time (each kernel, the routing's
    compiled region's among them), its host time beside it; on the CPU by host time."""
    cuda = platform.has_cuda()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(3):
            call()
        if cuda:
            torch.cuda.synchronize()
    print(f"--- {title}: by {'device' if cuda else 'host'} time")
    print(
        prof.key_averages(group_by_input_shape=not cuda).table(
            sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
            row_limit=15,
            max_shapes_column_width=60,
        )
    )


def measure(opts, heads: int, head_dim: int, n: int, groups: int, top_k: int) -> dict:
    device = "cuda" if platform.has_cuda() else "cpu"
    gen = torch.Generator().manual_seed(n + groups)
    dtype = torch.bfloat16 if opts.dtype == "bf16" else torch.float32
    # As the model's core attention hands them: [b, heads, n, d] views of Megatron's
    # [n, b, heads, d].
    q, k, v = (
        torch.randn(n, 1, heads, head_dim, generator=gen)
        .to(device, dtype)
        .requires_grad_(opts.train)
        .permute(1, 2, 0, 3)
        for _ in range(3)
    )
    log_g = causal_sinkhorn(torch.randn(1, n, groups, generator=gen) * 3, 10).to(device)
    routing = Routing.of(log_g.requires_grad_(opts.train))
    scale = head_dim**-0.5
    d_out = torch.randn_like(q)

    def step(attend):  # the call, with its backward when training
        def run():
            out = attend()
            if opts.train:
                out.backward(d_out)

        return run

    # the model's choice (on a GPU the fused kernel, triton_sparse.py), and beside it on a GPU
    # the parts' path it replaces
    chosen = kernels.sparse(torch.device(device), head_dim, dtype)
    by_kernel = {"sparse": chosen}
    if chosen.fused:
        by_kernel["parts"] = kernels.lse_attention(torch.device(device))
    calls = {
        "dense": step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale))
    }
    for name, kernel in by_kernel.items():
        calls[name] = step(
            functools.partial(
                sparse_focus_attention,
                q,
                k,
                v,
                routing,
                window=opts.window,
                top_k=top_k,
                scale=scale,
                kernel=kernel,
            )  # fmt: skip
        )
    if chosen.fused:  # the same call without CUDA graphs
        calls["eager"] = step(functools.partial(without_graphs, calls["sparse"]))
    if opts.tiles:  # the fused kernel at the table's tiles, and at each candidate's
        fused = functools.partial(
            sparse_focus_attention, q, k, v, routing, window=opts.window, top_k=top_k,
            scale=scale, kernel=kernels.TRITON_SPARSE,
        )  # fmt: skip
        calls["tiles table"] = step(functools.partial(without_graphs, fused))
        for choice in opts.tiles:
            calls[f"tiles {choice}"] = step(functools.partial(tiled, choice, fused))
    if opts.train:
        soft_gate = kernels.soft_gate("auto", torch.device(device))
        calls["soft"] = step(
            lambda: focus_attention(
                q,
                k,
                v,
                routing,
                window=opts.window,
                gate_scale=1.0,
                top_k=None,
                chunk_size=128,
                scale=scale,
                kernel=soft_gate,
            )
        )
    failed = {}  # tiles (or "table") -> why they were not timed
    with torch.set_grad_enabled(opts.train):
        for name, fn in list(calls.items()):  # warm-up (a candidate tile may fail to compile)
            tiles = name.removeprefix("tiles ")
            try:
                if tiles != name and "table" in failed:
                    raise RuntimeError("the table's tiles failed")
                fn()
            except Exception as error:  # noqa: BLE001 -- said in the row, the rest still timed
                if tiles == name:
                    raise
                said = (str(error).splitlines() or [""])[0][:160]
                failed[tiles] = f"{type(error).__name__}: {said}"
                del calls[name]
        times = {name: [] for name in calls}
        for rep in range(opts.repeats):  # alternate the order against drift
            order = list(calls.items())
            for name, fn in order if rep % 2 == 0 else order[::-1]:
                times[name].append(timed(fn))
        if opts.profile:  # each part's host time: the calls without graphs
            for name in by_kernel:
                call = calls["eager"] if name == "sparse" and "eager" in calls else calls[name]
                profile(call, f"{name} ({by_kernel[name].name}), n {n}, top-{top_k}")
    with torch.no_grad():
        kept = float(group_stats(routing, top_k, opts.window)["pairs-kept"])
    speedup = statistics.median(
        d.device / s.device for d, s in zip(times["dense"], times["sparse"])
    )
    return {
        "heads": heads,
        "head_dim": head_dim,
        "n": n,
        "groups": groups,
        "top_k": top_k,
        "kernel": chosen.name,
        **{
            f"{name}{suffix}_ms": statistics.median(getattr(t, clock) for t in ts) * 1e3
            for name, ts in times.items()
            for suffix, clock in (("", "device"), ("_host", "host"))
        },
        **{
            f"tiles {choice}_vs_table": statistics.median(
                t.device / b.device for t, b in zip(times[f"tiles {choice}"], times["tiles table"])
            )
            for choice in opts.tiles
            if f"tiles {choice}" in times
        },
        "tiles_failed": failed,
        "pairs_kept": kept,
        "speedup": speedup,
        "ideal_speedup": 1 / kept,
        "of_ideal": speedup * kept,
        "over_kept": 1 / (speedup * kept),
    }


def main() -> int:
    opts = parse()
    where = (
        torch.cuda.get_device_name()
        if platform.has_cuda()
        else f"cpu, {torch.get_num_threads()} threads"
    )
    print(
        f"{where}; window {opts.window}, batch 1, {opts.dtype}, "
        f"{'training step' if opts.train else 'forward'}"
    )
    soft = f"{'soft ms':>10}" if opts.train else ""
    no_graph = f"{'no graph':>10}" if platform.has_cuda() else ""
    last = f"{'over kept':>10}" if opts.train else f"{'of ideal':>9}"
    print(
        f"{'shape':>7}{'n':>8}{'K':>3}{'top-k':>6}{'dense ms':>10}{soft}{'focus ms':>10}{no_graph}"
        f"{'host ms':>9}{'kept':>7}"
        f"{'speedup':>9}{'ideal':>7}{last}"
    )
    rows = []
    for (heads, head_dim), n, groups, top_k in itertools.product(
        opts.shapes, opts.seq_lengths, opts.groups, opts.top_k
    ):
        r = measure(opts, heads, head_dim, n, groups, top_k)
        rows.append(r)
        soft = f"{r['soft_ms']:>10.1f}" if opts.train else ""
        eager = f"{r.get('eager_ms', float('nan')):>10.1f}" if no_graph else ""
        last = f"{r['over_kept']:>9.2f}x" if opts.train else f"{r['of_ideal']:>8.0%}"
        print(
            f"{f'{heads}x{head_dim}':>7}{n:>8}{groups:>3}{top_k:>6}{r['dense_ms']:>10.1f}{soft}"
            f"{r['sparse_ms']:>10.1f}{eager}{r['sparse_host_ms']:>9.1f}{r['pairs_kept']:>7.3f}"
            f"{r['speedup']:>8.2f}x{r['ideal_speedup']:>6.1f}x{last}",
            flush=True,
        )
        for tiles, error in r["tiles_failed"].items():
            print(f"{'':>7}  {tiles}: failed ({error})", flush=True)
        for choice in opts.tiles:
            if f"tiles {choice}_vs_table" not in r:
                continue
            ratio = r[f"tiles {choice}_vs_table"]
            print(f"{'':>7}  {choice}: {r[f'tiles {choice}_ms']:.2f} ms, {ratio:.2f}x the "
                  f"table's tiles ({r['tiles table_ms']:.2f} ms)", flush=True)  # fmt: skip
        if opts.json:  # after every row: a run cut short keeps what it measured
            with open(opts.json, "w") as f:
                json.dump({"config": {**vars(opts), "device": where}, "results": rows}, f, indent=2)
    return 1 if opts.strict and any(r["tiles_failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
