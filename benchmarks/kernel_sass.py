"""How much work the soft gate's kernels issue per attention pair, against a plain causal
FlashAttention-2 (benchmarks/flash_reference.py) compiled at the same tiles: a speed proxy that
needs no GPU. Each kernel is compiled for the architecture by Triton's own toolchain, its SASS
read with the wheel's cuobjdump, and the instructions of each loop counted by class (tensor-core
MMA, fp32, MUFU, conversions, integer/ALU, shared and global memory, shuffles, barriers),
times the warps, over the pairs one iteration covers.

Rows per pass (forward; keys: dK, dV, dg; queries: dQ, dg): the gate's wholly distant loop (no
mask: most pairs at long sequences) against the reference's off-diagonal loop (no mask), and the
gate's band loop (window and diagonal, masked) against the reference's diagonal loop; their
ratio; registers and spill bytes of both on each architecture.

    python benchmarks/kernel_sass.py [--arch sm90] [--shapes d128 d128-gqa4 d256]
        [--fit-archs sm80 sm86 sm90] [--kernel gate|sparse] [--json PATH] [--sass DIR]

(each pass at --arch's tiles, triton_launch.py's table; --fit-archs compiles those same launches
for other architectures, whose own tiles may differ.) `--kernel sparse`: sparse Focus's fused
kernel on a bucket part instead, its tiles inside every query's range ("distant") and its edge
tiles ("band") against the reference's off-diagonal loop and diagonal loop.

Targets (docs/benchmarks.md): the distant loop at most 1.5x the reference's instructions per
pair in the forward, 1.8x in each backward pass; no spills on sm_90 and sm_80.
"""

import argparse
import json
import os
import sys
import warnings

import torch

# shape name -> (head dim, query heads a key/value head)
SHAPES = {"d64": (64, 1), "d128": (128, 1), "d128-gqa4": (128, 4), "d256": (256, 1)}
PASSES = ("forward", "keys", "queries")
CLASSES = (
    "mma", "fp32", "mufu", "convert", "alu", "shared", "global", "local", "shuffle", "barrier"
)  # fmt: skip


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--arch", default="sm90", choices=["sm80", "sm86", "sm90"])
    p.add_argument("--shapes", nargs="+", default=["d128", "d128-gqa4", "d256"],
                   choices=list(SHAPES))  # fmt: skip
    p.add_argument(
        "--fit-archs",
        nargs="*",
        default=None,
        help="registers and spills of the same launches "
        "compiled for these architectures too (default: --arch alone)",
    )
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument(
        "--kernel",
        choices=("gate", "sparse"),
        default="gate",
        help="the soft gate's kernels, or sparse Focus's fused kernel (triton_sparse.py)",
    )
    p.add_argument("--json", metavar="PATH")
    p.add_argument(
        "--sass",
        metavar="DIR",
        help="also write each compiled kernel's SASS there (SHAPE-PASS-KERNEL.sass): the order "
        "of its loads, waits and MMAs, which the counts do not show",
    )
    return p.parse_args()


def _mma_loops(loops):
    """The loops that do the attention's work (an MMA in them or in a loop inside them),
    outermost first, in address order, each with the loops inside it."""
    tops = [loop for loop in loops if loop.depth == 0]
    tops = [
        loop for loop in tops
        if any(inner.counts.get("mma") for inner in loops
               if loop.start <= inner.start and inner.end <= loop.end)
    ]  # fmt: skip
    return [
        (top, [inner for inner in loops if inner.depth > 0 and top.start <= inner.start
               and inner.end <= top.end])
        for top in tops
    ]  # fmt: skip


def _per_pair(loop, inner, repeat, warps, pairs) -> dict:
    """Instructions per pair by class of one iteration of `loop` whose inner loops run `repeat`
    times each (the heads a key/value head serves)."""
    counts = dict(loop.counts)
    for nested in inner:
        for kind, count in nested.counts.items():
            counts[kind] = counts.get(kind, 0) + repeat * count
    return {kind: counts.get(kind, 0) * warps / pairs for kind in CLASSES}


def gate_and_reference(shape, capability):
    """{pass: (gate Launch, reference Launch, tile)} at `shape`, q, k, v laid out as Megatron
    lays them out for the gate, contiguous for the reference."""
    from flash_reference import Plan as ReferencePlan

    from megatron_focus.model.kernels import triton_gate
    from megatron_focus.model.kernels.triton_fit import megatron_qkv

    q, k, v = megatron_qkv(shape)
    g = torch.empty(shape.batch, shape.tokens, triton_gate.GROUPS_PADDED, device="meta",
                    dtype=shape.dtype)  # fmt: skip
    plan = triton_gate.Plan(q, k, v, g, None, window=128, gate_scale=1.0, scale=0.1, sink=0,
                            gate="log", capability=capability)  # fmt: skip
    forward, _, keys, queries = plan.launches(q, k, v, g, g)
    gate = dict(forward=forward, keys=keys, queries=queries)
    reference = ReferencePlan(*(t.contiguous() for t in (q, k)), 0.1, plan.tiles)
    ref = reference.launches(q.contiguous(), k.contiguous(), v.contiguous())
    return {name: (gate[name], ref[name], plan.tiles[name]) for name in PASSES}


def sparse_and_reference(shape, capability):
    """{pass: (sparse Launch, reference Launch, tile)}: sparse Focus's fused kernel on a bucket
    part (rows read through the routing's orders, merged with the parts before) at its own
    tiles, and the reference at the same tiles."""
    from flash_reference import Plan as ReferencePlan

    from megatron_focus.model.kernels import triton_launch
    from megatron_focus.model.kernels.triton_fit import megatron_qkv, sparse_launches

    q, k, v = megatron_qkv(shape)
    launches = dict(sparse_launches(shape, capability))
    tiles = {p: triton_launch.sparse_tile(p, capability, shape.head_dim, shape.dtype)
             for p in PASSES}  # fmt: skip
    reference = ReferencePlan(*(t.contiguous() for t in (q, k)), 0.1, tiles)
    ref = reference.launches(q.contiguous(), k.contiguous(), v.contiguous())
    return {p: (launches[f"sparse buckets {p}"], ref[p], tiles[p]) for p in PASSES}


def rows_of(name, shape_name, pass_, launch, tile, rep) -> dict:
    """The distant (or off-diagonal) and band (or diagonal) loops' instructions per pair; for
    the sparse kernel, its tiles inside every query's range (no mask: "distant") and its edge
    tiles ("band")."""
    from megatron_focus.model.kernels.triton_fit import sass_loops, sass_of

    sass = sass_of(launch, ARGS.arch)
    if ARGS.sass:
        os.makedirs(ARGS.sass, exist_ok=True)
        with open(os.path.join(ARGS.sass, f"{shape_name}-{pass_}-{name}.sass"), "w") as f:
            f.write(sass)
    loops = _mma_loops(sass_loops(sass))
    warps = launch.options["num_warps"]
    pairs = tile.rows * tile.keys
    if name == "sparse":  # edge, inner, edge tiles (the keys pass: inside its loop over heads)
        heads = 1
        if pass_ == "keys":
            _, inner = loops[0]
            cost = {"distant": (inner[1], []), "band": (inner[0], [])}
        else:
            cost = {"distant": loops[1], "band": loops[0]}
    elif name == "gate":
        heads = rep if pass_ == "keys" else 1  # the keys pass takes the heads one by one
        distant, band = (loops[1], loops[0]) if pass_ == "keys" else (loops[1], loops[2])
        cost = {"distant": distant, "band": band}
    else:  # the reference's keys pass loops over heads outside its two query-block loops
        heads = 1
        if pass_ == "keys":  # (one diagonal step, BM = BN, is no loop: unrolled)
            top, inner = loops[0]
            cost = {"distant": (inner[-1], []), "band": (inner[0] if len(inner) > 1 else top, [])}
        else:
            cost = {"distant": loops[0], "band": loops[-1]}
    return {
        run: _per_pair(loop, inner, heads, warps, pairs * heads)
        for run, (loop, inner) in cost.items()
    }


def main() -> int:
    global ARGS
    ARGS = args = parse()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: TRITON_INTERPRET=1: the interpreter compiles nothing; unset it")
        return 2
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    from megatron_focus.model.kernels.triton_fit import Shape, compile_for
    from megatron_focus.model.kernels.triton_launch import TARGETS

    capability = (TARGETS[args.arch] // 10, TARGETS[args.arch] % 10)
    args.fit_archs = args.fit_archs or [args.arch]
    results = []
    print(f"instructions per pair on {args.arch}, by class: " + " ".join(CLASSES))
    for shape_name in args.shapes:
        head_dim, rep = SHAPES[shape_name]
        shape = Shape(head_dim, rep, tokens=args.tokens)
        pairs = gate_and_reference if args.kernel == "gate" else sparse_and_reference
        for pass_, (gate, reference, tile) in pairs(shape, capability).items():
            tile_text = f"{tile.rows}x{tile.keys}x{tile.warps}x{tile.stages}"
            ours = rows_of(args.kernel, shape_name, pass_, gate, tile, rep)
            theirs = rows_of("reference", shape_name, pass_, reference, tile, rep)
            fits = {
                arch: {kind: compile_for(launch, arch) for kind, launch in
                       (("gate", gate), ("reference", reference))}
                for arch in args.fit_archs
            }  # fmt: skip
            for run in ("distant", "band"):
                total = sum(ours[run].values())
                ratio = total / sum(theirs[run].values())
                line = " ".join(f"{ours[run][kind]:5.2f}" for kind in CLASSES)
                print(
                    f"{shape_name:10} {pass_:8} {tile_text:12} {run:8} {args.kernel} {line} = "
                    f"{total:5.2f}  ref {sum(theirs[run].values()):5.2f}  x{ratio:.2f}"
                )
            fit_text = "  ".join(
                f"{arch} {f['gate'].registers}r/{f['gate'].spill_stores}s "
                f"(ref {f['reference'].registers}r/{f['reference'].spill_stores}s)"
                for arch, f in fits.items()
            )
            print(f"{'':10} {pass_:8} {'':12} fit: {fit_text}", flush=True)
            results.append(
                dict(shape=shape_name, pass_=pass_, tile=tile_text, gate=ours,
                     reference=theirs, ratio={run: sum(ours[run].values())
                                              / sum(theirs[run].values()) for run in ours},
                     fit={arch: {kind: fit.__dict__ for kind, fit in f.items()}
                          for arch, f in fits.items()})
            )  # fmt: skip
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]
    sys.exit(main())
