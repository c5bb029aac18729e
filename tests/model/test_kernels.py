"""model/kernels/kernels.py: the guarded private and version-specific torch calls, on this torch."""

import pytest
import torch

from megatron_focus.model.focus.focus_sparse import sparse_focus_attention
from megatron_focus.model.focus.groups import Routing
from megatron_focus.model.kernels import kernels

from reference import assignments, dense_hard_rule


@pytest.mark.parametrize(
    "causal, mask_kind, kv_heads",
    [
        (True, None, 4),
        (False, None, 2),
        (False, "pairs", 4),
        (True, "keys", 1),
    ],
)
def test_explicit_fallback_equals_the_cpu_flash_kernel(causal, mask_kind, kv_heads):
    """Where this torch has the private op, the fallback computes what it computes, empty rows
    (every key masked) included."""
    if not kernels.has_cpu_flash_with_lse():
        pytest.skip("this torch has no CPU flash kernel with log-sum-exp: the fallback runs")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 16, generator=gen)
    k, v = (torch.randn(2, kv_heads, 40, 16, generator=gen) for _ in range(2))
    mask = None
    if mask_kind == "pairs":
        mask = torch.where(torch.rand(2, 1, 40, 40, generator=gen) < 0.3, float("-inf"), 0.0)
        mask[:, :, 5] = float("-inf")  # a query with no key left
    elif mask_kind == "keys":
        mask = torch.where(torch.rand(2, 1, 1, 40, generator=gen) < 0.3, float("-inf"), 0.0)
    fused = kernels.cpu_attention_with_lse(q, k, v, 0.25, causal, mask)
    explicit = kernels.explicit_attention_with_lse(q, k, v, 0.25, causal, mask)
    for got, want in zip(explicit, fused):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sparse_dispatch_on_the_fallback_equals_the_dense_rule(monkeypatch):
    monkeypatch.setattr(kernels, "_CPU_FLASH", None)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 300, 16, generator=gen)
    k, v = (torch.randn(1, 2, 300, 16, generator=gen) for _ in range(2))
    log_g = assignments(1, 300, 4, gen)
    out = sparse_focus_attention(q, k, v, Routing.of(log_g), window=16, top_k=2, scale=0.25)
    torch.testing.assert_close(
        out, dense_hard_rule(q, k, v, log_g, 16, 2, 0.25), rtol=1e-5, atol=1e-5
    )
