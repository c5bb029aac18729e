"""Kernels one layer launches per training step (forward + backward), PyTorch's ops against the
fused Triton kernels a GPU chooses: XSA's projection and a Focus layer's router (projection,
scores, causal Sinkhorn, group ranking); and sparse Focus attention on a GPU's kernels, its
routing eager against compiled into one region. A count does not depend on the device: without
a GPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1) and are counted the
same.

    TRITON_INTERPRET=1 python benchmarks/launch_counts.py [--iters 10] [--json out.json]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from launches import (  # noqa: E402  (the tests' counter: tests/launches.py)
    count_launches,
    gpu_sparse_attention_launches,
)

from megatron_focus import platform  # noqa: E402
from megatron_focus.model.gpt import build_model  # noqa: E402
from megatron_focus.model.kernels import kernels, triton_sinkhorn, triton_xsa  # noqa: E402
from megatron_focus.training.arguments import parse_args  # noqa: E402

CUDA = torch.device("cuda")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--iters", type=int, default=10, help="Sinkhorn iterations")
    p.add_argument("--json", metavar="PATH")
    return p.parse_args()


def router_step(opts, sinkhorn: kernels.Kernel) -> list:
    argv = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4"]
    argv += ["--seq-length", "40", "--attention", "focus", "--focus-groups", "4"]
    argv += ["--focus-sinkhorn-iters", str(opts.iters)]
    platform.manual_seed(0)
    router = build_model(parse_args(argv), 256).decoder.layers[0].self_attention
    router = router.core_attention.router
    router.sinkhorn = sinkhorn
    hidden = torch.randn(40, 2, 64, requires_grad=True)
    cotangent = torch.ones(2, 40, 4)
    with count_launches((triton_sinkhorn._forward, triton_sinkhorn._backward)) as launches:
        router(hidden).log_g.backward(cotangent)
    return launches


def xsa_step(projection: kernels.Kernel) -> list:
    y = torch.randn(2, 4, 40, 32, requires_grad=True)
    v = torch.randn(2, 2, 40, 32, requires_grad=True)
    dz = torch.randn_like(y)
    with count_launches((triton_xsa._forward, triton_xsa._backward)) as launches:
        projection(y, v).backward(dz)
    return launches


def main() -> None:
    opts = parse()
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("without a GPU, run with TRITON_INTERPRET=1 (the Triton interpreter)")
    platform.init_distributed(1)
    cpu = torch.device("cpu")  # the kernels PyTorch's ops run; CUDA's: the fused ones
    rows = [
        {
            "operation": "xsa",
            "pytorch": len(xsa_step(kernels.xsa(cpu))),
            "fused": xsa_step(kernels.xsa(CUDA)),
        },
        {
            "operation": f"router, {opts.iters} Sinkhorn iterations",
            "pytorch": len(router_step(opts, kernels.sinkhorn(cpu))),
            "fused": router_step(opts, kernels.sinkhorn(CUDA)),
        },
    ]
    rows += [
        {
            "operation": f"sparse attention, top-{top_k}",
            "pytorch": len(gpu_sparse_attention_launches(top_k, compiled_routing=False)),
            "fused": gpu_sparse_attention_launches(top_k, compiled_routing=True),
        }
        for top_k in (1, 2)
    ]
    print(f"{'one layer, forward + backward':<34}{'PyTorch':>8}{'fused':>7}  fused launches")
    for row in rows:
        row["launches"], row["fused"] = row["fused"], len(row["fused"])
        named = " ".join(row["launches"]) if row["fused"] <= 12 else "(in --json)"
        print(f"{row['operation']:<34}{row['pytorch']:>8}{row['fused']:>7}  {named}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"config": vars(opts), "rows": rows}, f, indent=2)
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
