"""XSA's projection (xsa.exclusive_projection) as one Triton kernel forward and one backward.

Why: in PyTorch the projection is about a dozen elementwise and reduction kernels each way and
keeps fp32 copies of y and v for the backward. Here a program holds a block of tokens of one
sequence and one key/value head: it loads the value rows once, runs over the query heads that
share them, and computes in fp32 registers; inputs and outputs stay in their dtype and the
backward keeps only y and v (which attention keeps anyway).

Per head and token, with c = (y . v) / m and m = max(||v||^2, eps^2):

    z  = y - c v
    dy = dz - ((dz . v) / m) v
    dv = -c dz - ((dz . v) / m) (y - 2 c v [||v||^2 > eps^2]),  summed over the heads sharing v

As triton_gate.py, compiled for a GPU, or run by Triton's interpreter on CPU tensors under
TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rows(X, b, head, heads, tokens, n, dims, head_dim):
    """Offsets and mask of rows `tokens` of head `head` in a contiguous [b, heads, n, d]."""
    offsets = ((b * heads + head) * n + tokens[:, None]) * head_dim + dims[None, :]
    return X + offsets, (tokens[:, None] < n) & (dims[None, :] < head_dim)


@triton.jit
def _value_block(V, n, kv_heads, head_dim, BT: tl.constexpr, D: tl.constexpr):
    """A program's sequence, key/value head, tokens, dims, its values [BT, D] in fp32, their
    mask and squared norms."""
    b = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    dims = tl.arange(0, D)
    v_at, mask = _rows(V, b, kv_head, kv_heads, tokens, n, dims, head_dim)
    v = tl.load(v_at, mask=mask, other=0.0).to(tl.float32)
    return b, kv_head, tokens, dims, v, mask, tl.sum(v * v, axis=1)


@triton.jit
def _forward(
    Y, V, Z, n, heads, kv_heads, head_dim, min_sq, BT: tl.constexpr, D: tl.constexpr
):  # fmt: skip
    b, kv_head, tokens, dims, v, mask, squared = _value_block(V, n, kv_heads, head_dim, BT, D)
    inverse = 1.0 / tl.maximum(squared, min_sq)
    rep = heads // kv_heads
    for r in range(rep):
        y_at, _ = _rows(Y, b, kv_head * rep + r, heads, tokens, n, dims, head_dim)
        y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
        along = tl.sum(y * v, axis=1) * inverse
        z_at, _ = _rows(Z, b, kv_head * rep + r, heads, tokens, n, dims, head_dim)
        tl.store(z_at, (y - along[:, None] * v).to(Z.dtype.element_ty), mask=mask)


@triton.jit
def _backward(
    Y, V, DZ, DY, DV, n, heads, kv_heads, head_dim, min_sq, BT: tl.constexpr, D: tl.constexpr
):  # fmt: skip
    b, kv_head, tokens, dims, v, mask, squared = _value_block(V, n, kv_heads, head_dim, BT, D)
    inverse = 1.0 / tl.maximum(squared, min_sq)
    through_norm = tl.where(squared > min_sq, 2.0, 0.0)  # m's gradient reaches v above eps only
    dv = tl.zeros((BT, D), tl.float32)
    rep = heads // kv_heads
    for r in range(rep):
        head = kv_head * rep + r
        y_at, _ = _rows(Y, b, head, heads, tokens, n, dims, head_dim)
        dz_at, _ = _rows(DZ, b, head, heads, tokens, n, dims, head_dim)
        y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
        dz = tl.load(dz_at, mask=mask, other=0.0).to(tl.float32)
        along = tl.sum(y * v, axis=1) * inverse  # c
        back = tl.sum(dz * v, axis=1) * inverse  # (dz . v) / m
        dy_at, _ = _rows(DY, b, head, heads, tokens, n, dims, head_dim)
        tl.store(dy_at, (dz - back[:, None] * v).to(DY.dtype.element_ty), mask=mask)
        dv += -along[:, None] * dz - back[:, None] * (y - (through_norm * along)[:, None] * v)
    dv_at, _ = _rows(DV, b, kv_head, kv_heads, tokens, n, dims, head_dim)
    tl.store(dv_at, dv.to(DV.dtype.element_ty), mask=mask)


def _launch_shape(head_dim: int, on_gpu: bool) -> dict:
    """Tokens per program (the interpreter takes small blocks, so small inputs cross them)."""
    return dict(BT=64 if on_gpu else 16, D=max(16, triton.next_power_of_2(head_dim)))


def _launch(kernel, y, v, *tensors, eps: float):
    b, heads, n, head_dim = y.shape
    meta = _launch_shape(head_dim, y.is_cuda)
    grid = (triton.cdiv(n, meta["BT"]), b * v.shape[1])
    kernel[grid](y, v, *tensors, n, heads, v.shape[1], head_dim, eps * eps, **meta)


class TritonExclusiveProjection(torch.autograd.Function):
    """y [b, heads, n, d] minus its component along v [b, heads_kv, n, d], per head."""

    @staticmethod
    def forward(ctx, y, v, eps):
        y, v = y.contiguous(), v.contiguous()
        z = torch.empty_like(y)
        _launch(_forward, y, v, z, eps=eps)
        ctx.save_for_backward(y, v)
        ctx.eps = eps
        return z

    @staticmethod
    def backward(ctx, dz):
        y, v = ctx.saved_tensors
        dy, dv = torch.empty_like(y), torch.empty_like(v)
        _launch(_backward, y, v, dz.contiguous(), dy, dv, eps=ctx.eps)
        return dy, dv, None


def triton_exclusive_projection(y: torch.Tensor, v: torch.Tensor, eps: float = 1e-6):
    return TritonExclusiveProjection.apply(y, v, eps)
