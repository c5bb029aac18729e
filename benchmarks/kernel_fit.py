"""Whether each Triton kernel launch fits each GPU architecture: registers, spill bytes (and
spill instructions inside the kernel's loops, which decide the fit), shared memory against the
per-block limit, and 64-bit addressing, as ptxas and the SASS report them for the cubin Triton
builds for sm_80 (A100), sm_86 (A10, L4, L40S, RTX 30/40) and sm_90 (H100, H200), on any
machine, GPU or not (model/kernels/triton_fit.py). On a GPU, `--device` adds the driver's own
register and spill counts for the GPU's architecture, beside the prediction.

    python benchmarks/kernel_fit.py [--archs sm80 sm86 sm90] [--head-dims 64 128 256]
        [--gqa 1 8] [--dtypes bf16] [--gates log sigmoid] [--documents] [--tokens 4096]
        [--batch 2] [--kv-heads 2] [--device] [--json PATH] [--strict]

The launches are the launchers' own (triton_gate.Plan, triton_xsa.launch,
triton_sinkhorn.launches) on meta tensors laid out as Megatron lays them out (V a view of the
fused QKV output, K RoPE's new tensor). tests/model/test_kernel_fit.py runs it and holds every
row to zero spills. Not under TRITON_INTERPRET=1: the interpreter compiles nothing.
"""

import argparse
import dataclasses
import json
import os
import sys
import warnings

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--archs", nargs="+", help="sm80 sm86 sm90 (default: all; with --device, the GPU's)"
    )
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--gqa", nargs="+", type=int, default=[1, 8], help="query heads a kv head")
    p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    p.add_argument("--gates", nargs="+", default=["log", "sigmoid"], choices=["log", "sigmoid"])
    p.add_argument("--documents", action="store_true", help="packed documents (also without)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2, help="micro-batch")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--device", action="store_true", help="also the GPU driver's counts")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--strict", action="store_true", help="exit 1 unless every launch fits")
    p.add_argument(
        "--search",
        action="store_true",
        help="find each pass's tile instead: the first candidate (FlashAttention-2's shapes "
        "first) that fits at every GQA ratio given, with and without documents, and for a "
        "context-parallel chunk; prints triton_launch.py's table",
    )
    return p.parse_args()


# Tile candidates per pass, in order of preference: FlashAttention-2's shapes first.
CANDIDATES = {
    "forward": ("128x64x8x2", "128x32x8x2", "64x64x8x2", "64x32x8x2", "64x64x4x2", "64x32x4x2",
                "32x32x4x2", "16x32x4x1", "16x16x4x1"),
    "keys": ("32x128x8x2", "16x128x8x2", "32x64x8x2", "16x64x8x2", "32x64x4x2", "16x64x4x2",
             "16x32x8x2", "16x32x4x2", "16x32x4x1", "16x16x4x1"),
    "queries": ("128x32x8x2", "64x32x8x2", "64x16x8x2", "64x32x4x2", "64x16x4x2", "32x32x4x1",
                "32x16x4x2", "16x32x4x1", "16x16x4x1"),
}  # fmt: skip


def _fits_everywhere(arch, pass_, tile, args, dtype, gate, head_dim, chunk) -> bool:
    """Whether `tile` fits pass `pass_` at every GQA ratio, with and without documents."""
    from megatron_focus.model.kernels import triton_launch
    from megatron_focus.model.kernels.triton_fit import Shape, compile_for, gate_launches

    name = f"gate {pass_}" + (" (chunk)" if chunk else "")
    table = triton_launch.gate_tile
    triton_launch.gate_tile = lambda p, *rest, **kw: tile  # every pass: only `name` is read
    try:
        capability = (triton_launch.TARGETS[arch] // 10, triton_launch.TARGETS[arch] % 10)
        for rep in args.gqa:
            for documents in (False, True):
                shape = Shape(head_dim, rep, dtype, gate == "log", documents, args.kv_heads,
                              args.tokens, args.batch)  # fmt: skip
                launch = dict(gate_launches(shape, capability)).get(name)
                if launch is None or not compile_for(launch, arch).fits:
                    return False
        return True
    finally:
        triton_launch.gate_tile = table


def search(args) -> int:
    """Print, per architecture and gate, {head dim: (forward, keys, queries)} and the chunk
    tiles where the whole sequence's do not fit a chunk (triton_launch.py's two tables)."""
    from megatron_focus.model.kernels.triton_launch import _tile

    passes = ("forward", "keys", "queries")
    chunks = {}
    for arch in args.archs:
        for gate in args.gates:
            for dtype in args.dtypes:
                row = {}
                for head_dim in args.head_dims:
                    chosen = []
                    for pass_ in passes:
                        fit = [
                            c for c in CANDIDATES[pass_]
                            if _fits_everywhere(arch, pass_, _tile(c), args, DTYPES[dtype], gate,
                                                head_dim, chunk=False)
                        ][:1]  # fmt: skip
                        chosen.append(fit[0] if fit else None)
                        if fit and not _fits_everywhere(
                            arch, pass_, _tile(fit[0]), args, DTYPES[dtype], gate, head_dim, True
                        ):
                            chunks[(arch, gate, head_dim, pass_)] = next(
                                (c for c in CANDIDATES[pass_]
                                 if _fits_everywhere(arch, pass_, _tile(c), args, DTYPES[dtype],
                                                     gate, head_dim, True)), None,
                            )  # fmt: skip
                        print(f"{arch} {gate} {dtype} d{head_dim} {pass_}: {chosen[-1]}",
                              flush=True)  # fmt: skip
                    row[head_dim] = tuple(chosen)
                print(f"    ({arch!r}, {gate!r}): {{")
                for head_dim, tiles in row.items():
                    print(f"        {head_dim}: {tiles!r},")
                print("    },", flush=True)
    print("_CHUNK_TILES = {")
    for key, tile in chunks.items():
        print(f"    {key!r}: {tile!r},")
    print("}")
    return 0


def shapes(args):
    from megatron_focus.model.kernels.triton_fit import Shape

    for head_dim in args.head_dims:
        for rep in args.gqa:
            for dtype in args.dtypes:
                for gate in args.gates:
                    for documents in (False, True) if args.documents else (False,):
                        yield Shape(
                            head_dim, rep, DTYPES[dtype], gate == "log", documents,
                            args.kv_heads, args.tokens, args.batch,
                        )  # fmt: skip


def on_device(launch):
    """(registers, spills) of `launch` as the driver loads it on this GPU: its tensors made
    real (each view on a buffer as large as its strides reach)."""
    args = tuple(
        torch.empty(1 + sum((n - 1) * s for n, s in zip(a.shape, a.stride())), dtype=a.dtype,
                    device="cuda").as_strided(a.shape, a.stride())
        if isinstance(a, torch.Tensor) else a
        for a in launch.args
    )  # fmt: skip
    compiled = launch.kernel.warmup(*args, grid=launch.grid, **launch.constants, **launch.options)
    compiled._init_handles()
    return compiled.n_regs, compiled.n_spills


def main() -> int:
    args = parse()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: TRITON_INTERPRET=1: the interpreter compiles nothing; unset it")
        return 2
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    import triton

    if not hasattr(getattr(getattr(triton, "knobs", None), "nvidia", None), "dump_ptxas_log"):
        print(f"Triton {triton.__version__} cannot report ptxas here (3.9 can): nothing to fit")
        return 1 if args.strict else 0
    from megatron_focus.model.kernels import triton_launch
    from megatron_focus.model.kernels.triton_fit import all_launches, compile_for

    if args.search:
        args.archs = args.archs or list(triton_launch.TARGETS)
        return search(args)
    device_arch = None
    if args.device and torch.cuda.is_available():
        device_arch = triton_launch.arch(torch.cuda.get_device_capability())
    args.archs = args.archs or ([device_arch] if device_arch else list(triton_launch.TARGETS))
    rows, seen = [], set()
    header = f"{'arch':5} {'shape':28} {'kernel':25} {'regs':>4} {'spill':>6} {'in loops':>8}"
    header += f" {'shared':>15}"
    print(header + " 64-bit fits" + ("  device regs/spills" if device_arch else ""))
    for arch in args.archs:
        for shape in shapes(args):
            for name, launch in all_launches(shape, arch):
                key = (arch, name, str(launch.constants), str(launch.options), shape.dtype)
                if not name.startswith("gate") and key in seen:
                    continue  # XSA and the Sinkhorn do not change with the gate or GQA
                seen.add(key)
                fit = compile_for(launch, arch)
                row = dict(arch=arch, shape=str(shape), kernel=name, **dataclasses.asdict(fit))
                row.update(fits=fit.fits, constants=launch.constants, options=launch.options)
                line = (
                    f"{arch:5} {str(shape):28} {name:25} {fit.registers:4d} "
                    f"{fit.spill_stores:6d} {fit.loop_spills:8d} {fit.shared:7d}/{fit.limit:7d} "
                    f"{'yes' if fit.wide_addresses else 'NO':>6} {'yes' if fit.fits else 'NO':>4}"
                )
                if arch == device_arch:
                    row["device_registers"], row["device_spills"] = on_device(launch)
                    line += f"  {row['device_registers']}/{row['device_spills']}"
                print(line, flush=True)
                rows.append(row)
                if args.json:  # after every row
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1, default=str)
    misfits = [r for r in rows if not r["fits"]]
    print(f"{len(rows) - len(misfits)} of {len(rows)} launches fit")
    return 1 if args.strict and misfits else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
