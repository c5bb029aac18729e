"""XSA's projection (xsa.exclusive_projection) as one Triton kernel forward and one backward.

Why: in PyTorch the projection is about a dozen elementwise and reduction kernels each way and
keeps fp32 copies of y and v for the backward. Here a program holds a block of tokens of one
sequence and one key/value head: it loads the value rows once, runs over the query heads that
share them, and computes in fp32 registers; inputs and outputs stay in their dtype and the
backward keeps only y and v (which attention keeps anyway). y, v and dz are read by their own
strides (v is a view of Megatron's fused QKV output), from a 64-bit base per tile.

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

from megatron_focus.model.kernels import triton_launch
from megatron_focus.model.kernels.triton_launch import Launch


@triton.jit
def _rows(X, b, head, t0, s_b, s_h, s_n, n, head_dim, BT: tl.constexpr, D: tl.constexpr):
    """(pointers, mask) of tokens t0 .. t0 + BT of one head of a [b, heads, n, d] tensor."""
    tokens = tl.arange(0, BT)
    dims = tl.arange(0, D)
    wide = tl.int64
    base = X + tl.cast(b, wide) * s_b + tl.cast(head, wide) * s_h + tl.cast(t0, wide) * s_n
    at = base + tokens[:, None] * s_n + dims[None, :]
    return at, (t0 + tokens[:, None] < n) & (dims[None, :] < head_dim)


@triton.jit
def _value_block(V, n, kv_heads, head_dim, sv_b, sv_h, sv_n, BT: tl.constexpr, D: tl.constexpr):
    """A program's sequence, key/value head, first token, its values [BT, D] in fp32, their
    mask and squared norms."""
    b = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    t0 = tl.program_id(0) * BT
    v_at, mask = _rows(V, b, kv_head, t0, sv_b, sv_h, sv_n, n, head_dim, BT, D)
    v = tl.load(v_at, mask=mask, other=0.0).to(tl.float32)
    return b, kv_head, t0, v, mask, tl.sum(v * v, axis=1)


@triton.jit
def _forward(
    Y, V, Z, n, heads, kv_heads, head_dim, min_sq,
    sy_b, sy_h, sy_n, sv_b, sv_h, sv_n, sz_b, sz_h, sz_n,
    BT: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    b, kv_head, t0, v, mask, squared = _value_block(
        V, n, kv_heads, head_dim, sv_b, sv_h, sv_n, BT, D
    )
    inverse = 1.0 / tl.maximum(squared, min_sq)
    rep = heads // kv_heads
    for r in range(rep):
        head = kv_head * rep + r
        y_at, _ = _rows(Y, b, head, t0, sy_b, sy_h, sy_n, n, head_dim, BT, D)
        y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
        along = tl.sum(y * v, axis=1) * inverse
        z_at, _ = _rows(Z, b, head, t0, sz_b, sz_h, sz_n, n, head_dim, BT, D)
        tl.store(z_at, (y - along[:, None] * v).to(Z.dtype.element_ty), mask=mask)


@triton.jit
def _backward(
    Y, V, DZ, DY, DV, n, heads, kv_heads, head_dim, min_sq,
    sy_b, sy_h, sy_n, sv_b, sv_h, sv_n, sz_b, sz_h, sz_n, sdy_b, sdy_h, sdy_n,
    sdv_b, sdv_h, sdv_n,
    BT: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    b, kv_head, t0, v, mask, squared = _value_block(
        V, n, kv_heads, head_dim, sv_b, sv_h, sv_n, BT, D
    )
    inverse = 1.0 / tl.maximum(squared, min_sq)
    through_norm = tl.where(squared > min_sq, 2.0, 0.0)  # m's gradient reaches v above eps only
    dv = tl.zeros((BT, D), tl.float32)
    rep = heads // kv_heads
    for r in range(rep):
        head = kv_head * rep + r
        y_at, _ = _rows(Y, b, head, t0, sy_b, sy_h, sy_n, n, head_dim, BT, D)
        dz_at, _ = _rows(DZ, b, head, t0, sz_b, sz_h, sz_n, n, head_dim, BT, D)
        y = tl.load(y_at, mask=mask, other=0.0).to(tl.float32)
        dz = tl.load(dz_at, mask=mask, other=0.0).to(tl.float32)
        along = tl.sum(y * v, axis=1) * inverse  # c
        back = tl.sum(dz * v, axis=1) * inverse  # (dz . v) / m
        dy_at, _ = _rows(DY, b, head, t0, sdy_b, sdy_h, sdy_n, n, head_dim, BT, D)
        tl.store(dy_at, (dz - back[:, None] * v).to(DY.dtype.element_ty), mask=mask)
        dv += -along[:, None] * dz - back[:, None] * (y - (through_norm * along)[:, None] * v)
    dv_at, _ = _rows(DV, b, kv_head, t0, sdv_b, sdv_h, sdv_n, n, head_dim, BT, D)
    tl.store(dv_at, dv.to(DV.dtype.element_ty), mask=mask)


def _strides(*tensors) -> tuple:
    return tuple(s for t in tensors for s in t.stride()[:3])


def launch(kernel, y, v, *tensors, eps: float, capability) -> Launch:
    """One launch of `kernel` over y [b, heads, n, d], v [b, heads_kv, n, d] and the pass's
    other [b, ., n, d] tensors, each by its strides."""
    b, heads, n, head_dim = y.shape
    tile = triton_launch.xsa_tile(capability, head_dim)
    for name, t in zip(("y", "v") + ("t",) * len(tensors), (y, v) + tensors):
        triton_launch.check_tile_offsets(f"XSA's {name}", t.stride()[2:3], (tile.rows,))
    return Launch(
        kernel,
        (triton.cdiv(n, tile.rows), b * v.shape[1]),
        (y, v, *tensors, n, heads, v.shape[1], head_dim, eps * eps, *_strides(y, v, *tensors)),
        dict(BT=tile.rows, D=triton_launch.padded(head_dim)),
        dict(num_warps=tile.warps, num_stages=tile.stages),
    )


class TritonExclusiveProjection(torch.autograd.Function):
    """y [b, heads, n, d] minus its component along v [b, heads_kv, n, d], per head."""

    @staticmethod
    def forward(ctx, y, v, eps):
        y, v = triton_launch.last_dim_contiguous(y), triton_launch.last_dim_contiguous(v)
        z = torch.empty(y.shape, device=y.device, dtype=y.dtype)
        capability = triton_launch.capability_of(y)
        launch(_forward, y, v, z, eps=eps, capability=capability)()
        ctx.save_for_backward(y, v)
        ctx.eps, ctx.capability = eps, capability
        return z

    @staticmethod
    def backward(ctx, dz):
        y, v = ctx.saved_tensors
        dy = torch.empty(y.shape, device=y.device, dtype=y.dtype)
        dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
        dz = triton_launch.last_dim_contiguous(dz)
        launch(_backward, y, v, dz, dy, dv, eps=ctx.eps, capability=ctx.capability)()
        return dy, dv, None


def triton_exclusive_projection(y: torch.Tensor, v: torch.Tensor, eps: float = 1e-6):
    return TritonExclusiveProjection.apply(y, v, eps)
