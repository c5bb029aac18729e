"""XSA's Triton kernel (model/kernels/triton_xsa.py) under Triton's interpreter on CPU tensors,
against the PyTorch projection (xsa.exclusive_projection, itself tested against SPEC's formula):
values and gradients, GQA ratios, lengths off the block, values below eps, half precision."""

import pytest
import torch
from interpreted import gpu_launch_shapes, skip_unless_kernels_run
from launches import count_launches

from megatron_focus.model.kernels import kernels
from megatron_focus.model.xsa import XSAMixin, exclusive_projection

skip_unless_kernels_run()
triton_xsa = pytest.importorskip("megatron_focus.model.kernels.triton_xsa")


@pytest.mark.parametrize(
    "b, heads, kv_heads, n, d, gpu_blocks",
    [
        (2, 4, 4, 37, 16, False),
        (1, 6, 2, 20, 24, False),
        (2, 3, 1, 16, 8, False),
        (1, 2, 2, 1, 64, False),
        (1, 4, 2, 150, 128, True),  # a GPU's 64-token blocks
    ],
)
def test_kernel_equals_the_pytorch_projection(b, heads, kv_heads, n, d, gpu_blocks, monkeypatch):
    if gpu_blocks:
        gpu_launch_shapes(monkeypatch, triton_xsa)
    gen = torch.Generator().manual_seed(n * d)
    y = torch.randn(b, heads, n, d, generator=gen).requires_grad_()
    v = torch.randn(b, kv_heads, n, d, generator=gen)
    v[:, :, 0] *= 1e-8  # a value vector under eps: its norm's gradient is cut, as in PyTorch
    v.requires_grad_()
    z = triton_xsa.triton_exclusive_projection(y, v)
    wide = [t.detach().double().requires_grad_() for t in (y, v)]
    want = exclusive_projection(*wide)  # in float64
    torch.testing.assert_close(z.double(), want, rtol=1e-5, atol=1e-5)
    dz = torch.randn(z.shape, generator=gen)
    got = torch.autograd.grad(z, (y, v), dz)
    ref = torch.autograd.grad(want, wide, dz.double())
    for ours, theirs in zip(got, ref):  # token 0's dv is ~1/eps^2 large: float32 error to scale
        atol = 1e-5 + 1e-7 * theirs.abs().max().item()
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("gpu_blocks", [False, True])
def test_kernel_reads_each_input_by_its_own_strides(gpu_blocks, monkeypatch):
    """v a view of Megatron's fused QKV output [s, b, kv, (rep + 2) d], y and dz permuted views
    of [s, b, heads, d] (GQA 4:1): the PyTorch projection's values and gradients."""
    if gpu_blocks:
        gpu_launch_shapes(monkeypatch, triton_xsa)
    gen = torch.Generator().manual_seed(3)
    s, b, kv, rep, d = 70, 2, 2, 4, 32
    v = torch.randn(s, b, kv, (rep + 2) * d, generator=gen)[..., -d:].permute(1, 2, 0, 3)
    y = torch.randn(s, b, kv * rep, d, generator=gen).permute(1, 2, 0, 3)
    y, v = y.requires_grad_(), v.requires_grad_()
    z = triton_xsa.triton_exclusive_projection(y, v)
    want = exclusive_projection(y, v)
    torch.testing.assert_close(z, want, rtol=1e-5, atol=1e-5)
    dz = torch.randn(s, b, kv * rep, d, generator=gen).permute(1, 2, 0, 3)
    for ours, theirs in zip(
        torch.autograd.grad(z, (y, v), dz), torch.autograd.grad(want, (y, v), dz)
    ):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_half_precision_in_and_out_fp32_inside():
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(1, 4, 40, 32, generator=gen).half().requires_grad_()
    v = torch.randn(1, 2, 40, 32, generator=gen).half().requires_grad_()
    z = triton_xsa.triton_exclusive_projection(y, v)
    assert z.dtype == torch.float16
    torch.testing.assert_close(z, exclusive_projection(y, v), rtol=2e-3, atol=2e-3)
    dz = torch.randn(z.shape, generator=gen).half()
    got = torch.autograd.grad(z, (y, v), dz)
    want = torch.autograd.grad(exclusive_projection(y, v), (y, v), dz)
    for ours, theirs in zip(got, want):
        assert ours.dtype == torch.float16
        torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=2e-3)


class _Identity:
    def project(self, y, v):
        return y


class _XSA(XSAMixin, _Identity):
    """XSA on an attention whose output is its input."""


def _project_forward_backward(y, v, dz, layer=None):
    (layer or _XSA()).project(y, v).backward(dz)


def test_a_gpu_launches_at_most_four_kernels_for_xsa(monkeypatch):
    """Forward and backward of one layer's projection, the kernel a GPU chooses (PyTorch's ops
    launch about 30)."""
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(2, 4, 48, 32, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 48, 32, generator=gen, requires_grad=True)
    dz = torch.randn(2, 4, 48, 32, generator=gen)
    with count_launches() as eager:
        _project_forward_backward(y, v, dz)
    monkeypatch.setattr(kernels, "has_triton", lambda: True)
    assert kernels.xsa(torch.device("cuda")).name == "triton"
    gpu = _XSA()
    gpu.xsa = kernels.xsa(torch.device("cuda"))
    fused_kernels = (triton_xsa._forward, triton_xsa._backward)
    y.grad = v.grad = None
    with count_launches(fused_kernels) as fused:
        _project_forward_backward(y, v, dz, gpu)
    assert len(fused) <= 4, fused
    assert fused.count("_forward") == fused.count("_backward") == 1
    assert len(eager) > 4 * len(fused), eager  # what the fused kernels replace
