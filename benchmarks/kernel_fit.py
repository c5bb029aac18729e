"""Whether each Triton kernel launch fits each GPU architecture: registers, spill bytes, shared
memory against the per-block limit, and 64-bit addressing, as ptxas reports them for the cubin
Triton builds for sm_80 (A100), sm_86 (A10, L4, L40S, RTX 30/40) and sm_90 (H100, H200), on any
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
    return p.parse_args()


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

    device_arch = None
    if args.device and torch.cuda.is_available():
        device_arch = triton_launch.arch(torch.cuda.get_device_capability())
    args.archs = args.archs or ([device_arch] if device_arch else list(triton_launch.TARGETS))
    rows, seen = [], set()
    header = f"{'arch':5} {'shape':28} {'kernel':25} {'regs':>4} {'spill':>6} {'shared':>15}"
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
                    f"{fit.spill_stores:6d} {fit.shared:7d}/{fit.limit:7d} "
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
