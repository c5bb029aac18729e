"""The plain causal FlashAttention-2 the soft gate is measured against (benchmarks/
flash_reference.py), run by Triton's interpreter: outputs and gradients equal PyTorch's causal
SDPA, GQA included, at lengths that are no multiple of its blocks."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from interpreted import skip_unless_kernels_run

from megatron_focus.model.kernels.triton_launch import Tile

skip_unless_kernels_run()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
reference_attention = pytest.importorskip("flash_reference").reference_attention

TILES = {"forward": Tile(32, 16, 4, 1), "keys": Tile(16, 32, 4, 1), "queries": Tile(32, 16, 4, 1)}


@pytest.mark.parametrize("heads, kv_heads, n, d", [(4, 2, 70, 16), (2, 2, 64, 32), (3, 1, 33, 8)])
def test_reference_kernel_equals_causal_sdpa(heads, kv_heads, n, d):
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(2, heads, n, d, generator=gen).requires_grad_()
    k, v = (torch.randn(2, kv_heads, n, d, generator=gen).requires_grad_() for _ in range(2))
    out = reference_attention(q, k, v, d**-0.5, TILES)
    rep = heads // kv_heads
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True,
        scale=d**-0.5,
    )  # fmt: skip
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    cotangent = torch.randn(out.shape, generator=gen)
    ours = torch.autograd.grad(out, (q, k, v), cotangent)
    theirs = torch.autograd.grad(want, (q, k, v), cotangent)
    for name, got, ref in zip("qkv", ours, theirs):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=name)
