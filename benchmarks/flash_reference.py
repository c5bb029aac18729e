"""A plain causal FlashAttention-2 in Triton: the yardstick the soft gate's kernels are held
to, compiled at the same tiles (benchmarks/kernel_sass.py counts both kernels' instructions per
pair; on a GPU, benchmarks/soft_gate_kernel.py times both beside PyTorch's SDPA).

FlashAttention-2's shape, as Triton's fused-attention tutorial lays it out: the forward walks the
off-diagonal key blocks with no mask, then the diagonal ones with the causal mask, in base-2
exponentials with the scale folded into one multiply-add; the backward computes delta, then dK
and dV per key block (the query heads sharing a key/value head one after another), then dQ per
query block. Inputs [b, heads, n, d] (k, v: [b, kv heads, n, d]), contiguous; n and d any (d
padded to a power of two).

    reference_attention(q, k, v, scale) -> out, with gradients for q, k, v
"""

import math

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(math.log2(math.e))


@triton.jit
def _tile(X, bh, m0, n, head_dim, BM: tl.constexpr, D: tl.constexpr):
    """(pointers, mask) of rows m0 .. m0 + BM of head `bh` of a contiguous [b * heads, n, d]."""
    rows = m0 + tl.arange(0, BM)
    dims = tl.arange(0, D)
    at = X + tl.cast(bh, tl.int64) * n * head_dim + rows[:, None] * head_dim + dims[None, :]
    return at, (rows[:, None] < n) & (dims[None, :] < head_dim)


@triton.jit
def _forward_step(acc, total, m_i, q, K, V, kv, start, rows, n, head_dim, qk_scale,
                  BN: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    k_at, k_ok = _tile(K, kv, start, n, head_dim, BN, D)
    v_at, _ = _tile(V, kv, start, n, head_dim, BN, D)
    k = tl.load(k_at, mask=k_ok, other=0.0)
    qk = tl.dot(q, tl.trans(k))
    if MASKED:
        cols = start + tl.arange(0, BN)
        qk = tl.where((cols[None, :] <= rows[:, None]) & (cols[None, :] < n), qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    total = total * alpha + tl.sum(p, 1)
    v = tl.load(v_at, mask=k_ok, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, total, m_new


@triton.jit
def _forward(Q, K, V, OUT, LSE, n, heads, kv_heads, head_dim, qk_scale,
             BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):  # fmt: skip
    m0 = tl.program_id(0) * BM
    bh = tl.program_id(1)
    kv = (bh // heads) * kv_heads + (bh % heads) // (heads // kv_heads)
    q_at, q_ok = _tile(Q, bh, m0, n, head_dim, BM, D)
    q = tl.load(q_at, mask=q_ok, other=0.0)
    rows = m0 + tl.arange(0, BM)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    total = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    for start in range(0, m0, BN):  # below the diagonal: no mask
        acc, total, m_i = _forward_step(acc, total, m_i, q, K, V, kv, start, rows, n, head_dim,
                                        qk_scale, BN, D, False)  # fmt: skip
    for start in range(m0, tl.minimum(m0 + BM, n), BN):
        acc, total, m_i = _forward_step(acc, total, m_i, q, K, V, kv, start, rows, n, head_dim,
                                        qk_scale, BN, D, True)  # fmt: skip
    total = tl.where(total == 0.0, 1.0, total)
    tl.store(_tile(OUT, bh, m0, n, head_dim, BM, D)[0],
             (acc / total[:, None]).to(OUT.dtype.element_ty), mask=q_ok)  # fmt: skip
    stats = LSE + tl.cast(bh, tl.int64) * n + rows
    tl.store(stats, m_i + tl.log2(total), mask=rows < n)


@triton.jit
def _delta(OUT, DO, DELTA, n, head_dim, BM: tl.constexpr, D: tl.constexpr):
    m0 = tl.program_id(0) * BM
    bh = tl.program_id(1)
    o_at, ok = _tile(OUT, bh, m0, n, head_dim, BM, D)
    do_at, _ = _tile(DO, bh, m0, n, head_dim, BM, D)
    o = tl.load(o_at, mask=ok, other=0.0).to(tl.float32)
    do = tl.load(do_at, mask=ok, other=0.0).to(tl.float32)
    rows = m0 + tl.arange(0, BM)
    tl.store(DELTA + tl.cast(bh, tl.int64) * n + rows, tl.sum(o * do, 1), mask=rows < n)


@triton.jit
def _query_rows(Q, DO, LSE, DELTA, bh, m0, n, head_dim, BM: tl.constexpr, D: tl.constexpr):
    """A block of queries' rows as both backward passes read them."""
    q_at, q_ok = _tile(Q, bh, m0, n, head_dim, BM, D)
    do_at, _ = _tile(DO, bh, m0, n, head_dim, BM, D)
    q = tl.load(q_at, mask=q_ok, other=0.0)
    do = tl.load(do_at, mask=q_ok, other=0.0)
    rows = m0 + tl.arange(0, BM)
    lse = tl.load(LSE + tl.cast(bh, tl.int64) * n + rows, mask=rows < n, other=0.0)
    delta = tl.load(DELTA + tl.cast(bh, tl.int64) * n + rows, mask=rows < n, other=0.0)
    return q, do, rows, lse, delta


@triton.jit
def _keys_step(dk, dv, k, v, Q, DO, LSE, DELTA, bh, m0, cols, n, head_dim, qk_scale,
               BM: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    q, do, rows, lse, delta = _query_rows(Q, DO, LSE, DELTA, bh, m0, n, head_dim, BM, D)
    qk = tl.dot(k, tl.trans(q))  # [keys, queries]
    p = tl.exp2(qk * qk_scale - lse[None, :])
    if MASKED:
        p = tl.where((cols[:, None] <= rows[None, :]) & (rows[None, :] < n), p, 0.0)
    dv += tl.dot(p.to(do.dtype), do)
    dp = tl.dot(v, tl.trans(do))
    ds = p * (dp - delta[None, :])
    dk += tl.dot(ds.to(q.dtype), q)
    return dk, dv


@triton.jit
def _backward_keys(Q, K, V, DO, LSE, DELTA, DK, DV, n, heads, kv_heads, head_dim, qk_scale,
                   scale, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):  # fmt: skip
    n0 = tl.program_id(0) * BN
    kv = tl.program_id(1)
    rep = heads // kv_heads
    k_at, k_ok = _tile(K, kv, n0, n, head_dim, BN, D)
    v_at, _ = _tile(V, kv, n0, n, head_dim, BN, D)
    k = tl.load(k_at, mask=k_ok, other=0.0)
    v = tl.load(v_at, mask=k_ok, other=0.0)
    cols = n0 + tl.arange(0, BN)
    dk = tl.zeros((BN, D), tl.float32)
    dv = tl.zeros((BN, D), tl.float32)
    for r in range(rep):
        bh = (kv // kv_heads) * heads + (kv % kv_heads) * rep + r
        for m0 in range(n0, n0 + BN, BM):  # the diagonal: masked
            dk, dv = _keys_step(dk, dv, k, v, Q, DO, LSE, DELTA, bh, m0, cols, n, head_dim,
                                qk_scale, BM, D, True)  # fmt: skip
        for m0 in range(n0 + BN, n, BM):  # below it: no mask
            dk, dv = _keys_step(dk, dv, k, v, Q, DO, LSE, DELTA, bh, m0, cols, n, head_dim,
                                qk_scale, BM, D, False)  # fmt: skip
    tl.store(_tile(DK, kv, n0, n, head_dim, BN, D)[0], (dk * scale).to(DK.dtype.element_ty),
             mask=k_ok)  # fmt: skip
    tl.store(_tile(DV, kv, n0, n, head_dim, BN, D)[0], dv.to(DV.dtype.element_ty), mask=k_ok)


@triton.jit
def _queries_step(dq, q, do, lse, delta, K, V, kv, start, rows, n, head_dim, qk_scale,
                  BN: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    k_at, k_ok = _tile(K, kv, start, n, head_dim, BN, D)
    v_at, _ = _tile(V, kv, start, n, head_dim, BN, D)
    k = tl.load(k_at, mask=k_ok, other=0.0)
    v = tl.load(v_at, mask=k_ok, other=0.0)
    qk = tl.dot(q, tl.trans(k))
    p = tl.exp2(qk * qk_scale - lse[:, None])
    if MASKED:
        cols = start + tl.arange(0, BN)
        p = tl.where((cols[None, :] <= rows[:, None]) & (cols[None, :] < n), p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k)


@triton.jit
def _backward_queries(Q, K, V, DO, LSE, DELTA, DQ, n, heads, kv_heads, head_dim, qk_scale,
                      scale, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):  # fmt: skip
    m0 = tl.program_id(0) * BM
    bh = tl.program_id(1)
    kv = (bh // heads) * kv_heads + (bh % heads) // (heads // kv_heads)
    q, do, rows, lse, delta = _query_rows(Q, DO, LSE, DELTA, bh, m0, n, head_dim, BM, D)
    dq = tl.zeros((BM, D), tl.float32)
    for start in range(0, m0, BN):
        dq = _queries_step(dq, q, do, lse, delta, K, V, kv, start, rows, n, head_dim, qk_scale,
                           BN, D, False)  # fmt: skip
    for start in range(m0, tl.minimum(m0 + BM, n), BN):
        dq = _queries_step(dq, q, do, lse, delta, K, V, kv, start, rows, n, head_dim, qk_scale,
                           BN, D, True)  # fmt: skip
    dq_at, dq_ok = _tile(DQ, bh, m0, n, head_dim, BM, D)
    tl.store(dq_at, (dq * scale).to(DQ.dtype.element_ty), mask=dq_ok)


class Plan:
    """The reference's launches for q [b, heads, n, d] and k, v [b, kv heads, n, d] at the gate's
    tiles: `tiles` maps "forward", "keys", "queries" to triton_launch.Tile (rows a multiple of
    keys in the forward and queries passes, keys of rows in the keys pass)."""

    def __init__(self, q, k, scale, tiles):
        self.b, self.heads, self.n, self.head_dim = q.shape
        self.kv_heads = k.shape[1]
        self.scale, self.qk_scale = float(scale), float(scale) * math.log2(math.e)
        self.tiles, self.D = tiles, max(16, triton.next_power_of_2(self.head_dim))
        for name in ("forward", "queries"):
            assert tiles[name].rows % tiles[name].keys == 0, (name, tiles[name])
        assert tiles["keys"].keys % tiles["keys"].rows == 0, tiles["keys"]

    def _launch(self, kernel, name, extent, heads, args):
        from megatron_focus.model.kernels.triton_launch import Launch

        tile = self.tiles[name]
        grid = (triton.cdiv(self.n, extent), self.b * heads)
        constants = dict(BM=tile.rows, BN=tile.keys, D=self.D)
        return Launch(kernel, grid, args, constants,
                      dict(num_warps=tile.warps, num_stages=tile.stages))  # fmt: skip

    def forward(self, q, k, v, out, lse):
        sizes = (self.n, self.heads, self.kv_heads, self.head_dim, self.qk_scale)
        tile = self.tiles["forward"]
        return self._launch(_forward, "forward", tile.rows, self.heads, (q, k, v, out, lse, *sizes))

    def delta(self, out, grad_out, delta):
        from megatron_focus.model.kernels.triton_launch import Launch

        rows = self.tiles["queries"].rows
        return Launch(_delta, (triton.cdiv(self.n, rows), self.b * self.heads),
                      (out, grad_out, delta, self.n, self.head_dim), dict(BM=rows, D=self.D),
                      dict(num_warps=4))  # fmt: skip

    def keys(self, q, k, v, grad_out, lse, delta, dk, dv):
        sizes = (self.n, self.heads, self.kv_heads, self.head_dim, self.qk_scale, self.scale)
        return self._launch(_backward_keys, "keys", self.tiles["keys"].keys, self.kv_heads,
                            (q, k, v, grad_out, lse, delta, dk, dv, *sizes))  # fmt: skip

    def queries(self, q, k, v, grad_out, lse, delta, dq):
        sizes = (self.n, self.heads, self.kv_heads, self.head_dim, self.qk_scale, self.scale)
        return self._launch(_backward_queries, "queries", self.tiles["queries"].rows, self.heads,
                            (q, k, v, grad_out, lse, delta, dq, *sizes))  # fmt: skip

    def launches(self, q, k, v):
        """Every launch of a forward and backward, on fresh outputs (what kernel_sass.py
        compiles)."""
        rows = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        return {
            "forward": self.forward(q, k, v, torch.empty_like(q), rows),
            "keys": self.keys(q, k, v, q, rows, rows, torch.empty_like(k), torch.empty_like(k)),
            "queries": self.queries(q, k, v, q, rows, rows, torch.empty_like(q)),
        }


class ReferenceAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, tiles):
        q, k, v = (t.contiguous() for t in (q, k, v))
        plan = Plan(q, k, scale, tiles)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        plan.forward(q, k, v, out, lse)()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan, grad_out = ctx.plan, grad_out.contiguous()
        delta = torch.empty_like(lse)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        plan.delta(out, grad_out, delta)()
        plan.keys(q, k, v, grad_out, lse, delta, dk, dv)()
        plan.queries(q, k, v, grad_out, lse, delta, dq)()
        return dq, dk, dv, None, None


def reference_attention(q, k, v, scale, tiles):
    """Causal softmax attention by the kernels above at `tiles` (see Plan)."""
    return ReferenceAttention.apply(q, k, v, scale, tiles)
