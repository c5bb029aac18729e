"""Focus's soft gate as one fused attention kernel in Triton, forward and backward.

Why not FlexAttention: a score_mod's captured tensor gets its gradient by an atomic scatter per
score element (about 1.6e9 per layer backward at the 0.7B recipe's shape), and the affinity
g_i . g_j is recomputed for every head. Here, in FlashAttention-2's shape:

* a program owns a block of queries of one sequence and one key/value head, with every query head
  that shares that key/value head stacked along the rows (GQA: keys and values are loaded once
  for all of them); the affinity of a (query block, key block) tile is one small dot product,
  shared by those heads;
* forward: an online softmax over the causal key blocks (those before the query's document are
  skipped), storing the output and the natural log-sum-exp;
* backward: one pass per key block for dK, dV and the key side of dg, one pass per query block
  for dQ and the query side of dg, each accumulated in registers and written once: no atomics.
  The per-head sums of dg are per key/value head and added up outside (a [b, heads_kv, n, K]
  tensor, small).

Scores, for query i and key j (positions), window w, sinks s, the query's document start f:
causal iff f <= j <= i; distant iff causal and i - j >= w and j >= f + s; on a distant pair the
log gate adds lambda * log(max(g_i . g_j, tiny)), the paper's gate multiplies the logit by
sigmoid(lambda g_i . g_j) (focus_gate.py has the rule and its reasons).

Triton compiles these kernels for a GPU. With TRITON_INTERPRET=1 set before Triton is imported (the
tests do, and the GPU session's CPU rehearsal), they run under Triton's interpreter on CPU tensors
instead (numpy, one program after another): how the tests check them exactly as written.
"""

import functools

import torch
import triton
import triton.language as tl

from megatron_focus.model.flex import TINY_AFFINITY


@triton.jit
def _heads(x, REP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """A [BM, BN] tile repeated for the REP stacked query heads: [REP * BM, BN]."""
    return tl.reshape(tl.broadcast_to(x[None, :, :], (REP, BM, BN)), (REP * BM, BN))


@triton.jit
def _head_sum(x, REP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """[REP * BM, BN] summed over the stacked heads: [BM, BN]."""
    return tl.sum(tl.reshape(x, (REP, BM, BN)), axis=0)


@triton.jit
def _scores(
    q,
    k,
    g_q,
    g_k,
    rows,
    first,
    cols,
    n,
    scale,
    gate_scale,
    window,
    sink,
    REP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    LOG_GATE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """(scores [REP*BM, BN] with -inf off the causal pairs, raw scaled q.k, affinity [BM, BN],
    distant [BM, BN]) of query positions `rows` (document starts `first`) and keys `cols`."""
    raw = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    affinity = tl.dot(g_q, tl.trans(g_k), input_precision="ieee")
    i = rows[:, None]
    j = cols[None, :]
    causal = (j <= i) & (j >= first[:, None]) & (j < n)
    distant = causal & (i - j >= window) & (j >= first[:, None] + sink)
    if LOG_GATE:
        bias = tl.where(distant, gate_scale * tl.log(tl.maximum(affinity, TINY)), 0.0)
        bias = tl.where(causal, bias, float("-inf"))
        scores = raw + _heads(bias, REP, BM, BN)
    else:
        factor = tl.where(distant, tl.sigmoid(gate_scale * affinity), 1.0)
        scores = tl.where(
            _heads(causal, REP, BM, BN), raw * _heads(factor, REP, BM, BN), float("-inf")
        )
    return scores, raw, affinity, distant


@triton.jit
def _query_block(
    Q,
    G,
    DOCS,
    b,
    kv_head,
    m0,
    n,
    rep,
    groups,
    head_dim,
    sq_b,
    sq_h,
    sq_n,
    REP: tl.constexpr,
    BM: tl.constexpr,
    D: tl.constexpr,
    KP: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """What a program holds of its query block: stacked rows' (head, position, validity), the
    block's positions, document starts and assignments [BM, KP], and q [REP*BM, D]."""
    r = tl.arange(0, REP * BM)
    head = kv_head * rep + r // BM
    pos = m0 + r % BM
    row_ok = (r // BM < rep) & (pos < n)
    dims = tl.arange(0, D)
    q = tl.load(
        Q + b * sq_b + head[:, None] * sq_h + pos[:, None] * sq_n + dims[None, :],
        mask=row_ok[:, None] & (dims[None, :] < head_dim),
        other=0.0,
    )
    rows = m0 + tl.arange(0, BM)
    g_q = _assignments(G, b, rows, n, groups, KP)
    if HAS_DOCS:
        first = tl.load(DOCS + b * n + rows, mask=rows < n, other=0)
    else:
        first = tl.zeros((BM,), dtype=tl.int32)
    return head, pos, row_ok, rows, first, g_q, q


@triton.jit
def _assignments(G, b, positions, n, groups, KP: tl.constexpr):
    """g [len(positions), KP] (zero past the K groups and past n) of sequence b."""
    k = tl.arange(0, KP)
    return tl.load(
        G + (b * n + positions[:, None]) * groups + k[None, :],
        mask=(positions[:, None] < n) & (k[None, :] < groups),
        other=0.0,
    )


@triton.jit
def _key_block(K, V, b, kv_head, cols, n, head_dim, sk_b, sk_h, sk_n, D: tl.constexpr):
    dims = tl.arange(0, D)
    offsets = b * sk_b + kv_head * sk_h + cols[:, None] * sk_n + dims[None, :]
    mask = (cols[:, None] < n) & (dims[None, :] < head_dim)
    return tl.load(K + offsets, mask=mask, other=0.0), tl.load(V + offsets, mask=mask, other=0.0)


@triton.jit
def _rows_of(X, b, head, pos, row_ok, n, heads):
    """A [b, heads, n] float32 row statistic (log-sum-exp, delta) for the stacked rows."""
    return tl.load(X + (b * heads + head) * n + pos, mask=row_ok, other=0.0)


@triton.jit
def _first_key(DOCS, b, m0, n, BN: tl.constexpr, HAS_DOCS: tl.constexpr):
    """The first key block a query block reads: 0, or its first document's."""
    if HAS_DOCS:
        return (tl.load(DOCS + b * n + m0) // BN) * BN
    return 0


@triton.jit
def _forward(
    Q,
    K,
    V,
    G,
    DOCS,
    OUT,
    LSE,
    n,
    heads,
    kv_heads,
    rep,
    groups,
    head_dim,
    sq_b,
    sq_h,
    sq_n,
    sk_b,
    sk_h,
    sk_n,
    scale,
    gate_scale,
    window,
    sink,
    REP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    D: tl.constexpr,
    KP: tl.constexpr,
    LOG_GATE: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    m0 = tl.program_id(0) * BM
    b = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    head, pos, row_ok, rows, first, g_q, q = _query_block(
        Q, G, DOCS, b, kv_head, m0, n, rep, groups, head_dim, sq_b, sq_h, sq_n,
        REP, BM, D, KP, HAS_DOCS,
    )  # fmt: skip
    running_max = tl.full((REP * BM,), float("-inf"), tl.float32)
    total = tl.zeros((REP * BM,), tl.float32)
    acc = tl.zeros((REP * BM, D), tl.float32)
    for start in range(_first_key(DOCS, b, m0, n, BN, HAS_DOCS), tl.minimum(m0 + BM, n), BN):
        cols = start + tl.arange(0, BN)
        k, v = _key_block(K, V, b, kv_head, cols, n, head_dim, sk_b, sk_h, sk_n, D)
        g_k = _assignments(G, b, cols, n, groups, KP)
        scores, _, _, _ = _scores(
            q, k, g_q, g_k, rows, first, cols, n, scale, gate_scale, window, sink,
            REP, BM, BN, LOG_GATE, PRECISION,
        )  # fmt: skip
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no key yet: all zero
        p = tl.exp(scores - shift[:, None])
        alpha = tl.exp(running_max - shift)
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
    total = tl.where(total == 0.0, 1.0, total)
    dims = tl.arange(0, D)
    tl.store(
        OUT + ((b * heads + head[:, None]) * n + pos[:, None]) * head_dim + dims[None, :],
        (acc / total[:, None]).to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & (dims[None, :] < head_dim),
    )
    tl.store(LSE + (b * heads + head) * n + pos, running_max + tl.log(total), mask=row_ok)


@triton.jit
def _score_grads(
    scores,
    raw,
    affinity,
    distant,
    lse,
    delta,
    do,
    v,
    gate_scale,
    REP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    LOG_GATE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """(probabilities [REP*BM, BN], d raw score [REP*BM, BN], d affinity [BM, BN] summed over
    the heads) of a tile: dS = P * (dO V^T - delta), then through the gate."""
    p = tl.exp(scores - lse[:, None])
    dscores = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
    if LOG_GATE:
        draw = dscores
        daffinity = _head_sum(dscores, REP, BM, BN) * gate_scale / affinity
        daffinity = tl.where(distant & (affinity > TINY), daffinity, 0.0)
    else:
        factor = tl.sigmoid(gate_scale * affinity)
        draw = dscores * _heads(tl.where(distant, factor, 1.0), REP, BM, BN)
        dfactor = _head_sum(dscores * raw, REP, BM, BN)
        daffinity = tl.where(distant, dfactor * gate_scale * factor * (1.0 - factor), 0.0)
    return p, draw, daffinity


@triton.jit
def _backward_keys(
    Q,
    K,
    V,
    G,
    DOCS,
    QUERY_END,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    DG_K,
    n,
    heads,
    kv_heads,
    rep,
    groups,
    head_dim,
    sq_b,
    sq_h,
    sq_n,
    sk_b,
    sk_h,
    sk_n,
    scale,
    gate_scale,
    window,
    sink,
    REP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    D: tl.constexpr,
    KP: tl.constexpr,
    LOG_GATE: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dK, dV and the key side of dg for one key block, over the query blocks that see it."""
    n0 = tl.program_id(0) * BN
    b = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    cols = n0 + tl.arange(0, BN)
    k, v = _key_block(K, V, b, kv_head, cols, n, head_dim, sk_b, sk_h, sk_n, D)
    g_k = _assignments(G, b, cols, n, groups, KP)
    dk = tl.zeros((BN, D), tl.float32)
    dv = tl.zeros((BN, D), tl.float32)
    dg_k = tl.zeros((BN, KP), tl.float32)
    end = n
    if HAS_DOCS:
        end = tl.load(QUERY_END + b * tl.num_programs(0) + tl.program_id(0))
    for m0 in range((n0 // BM) * BM, end, BM):
        head, pos, row_ok, rows, first, g_q, q = _query_block(
            Q, G, DOCS, b, kv_head, m0, n, rep, groups, head_dim, sq_b, sq_h, sq_n,
            REP, BM, D, KP, HAS_DOCS,
        )  # fmt: skip
        dims = tl.arange(0, D)
        do = tl.load(
            DO + ((b * heads + head[:, None]) * n + pos[:, None]) * head_dim + dims[None, :],
            mask=row_ok[:, None] & (dims[None, :] < head_dim),
            other=0.0,
        )
        scores, raw, affinity, distant = _scores(
            q, k, g_q, g_k, rows, first, cols, n, scale, gate_scale, window, sink,
            REP, BM, BN, LOG_GATE, PRECISION,
        )  # fmt: skip
        scores = tl.where(row_ok[:, None], scores, float("-inf"))
        lse = _rows_of(LSE, b, head, pos, row_ok, n, heads)
        delta = _rows_of(DELTA, b, head, pos, row_ok, n, heads)
        p, draw, daffinity = _score_grads(
            scores, raw, affinity, distant, lse, delta, do, v, gate_scale,
            REP, BM, BN, LOG_GATE, PRECISION,
        )  # fmt: skip
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
        dk += tl.dot(tl.trans(draw).to(q.dtype), q, input_precision=PRECISION)
        dg_k += tl.dot(tl.trans(daffinity), g_q, input_precision="ieee")
    dims = tl.arange(0, D)
    out = ((b * kv_heads + kv_head) * n + cols[:, None]) * head_dim + dims[None, :]
    mask = (cols[:, None] < n) & (dims[None, :] < head_dim)
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=mask)
    _store_dg(DG_K, dg_k, b, kv_head, kv_heads, cols, n, groups, KP)


@triton.jit
def _store_dg(DG, dg, b, kv_head, kv_heads, positions, n, groups, KP: tl.constexpr):
    k = tl.arange(0, KP)
    tl.store(
        DG + ((b * kv_heads + kv_head) * n + positions[:, None]) * groups + k[None, :],
        dg,
        mask=(positions[:, None] < n) & (k[None, :] < groups),
    )


@triton.jit
def _backward_queries(
    Q,
    K,
    V,
    G,
    DOCS,
    DO,
    LSE,
    DELTA,
    DQ,
    DG_Q,
    n,
    heads,
    kv_heads,
    rep,
    groups,
    head_dim,
    sq_b,
    sq_h,
    sq_n,
    sk_b,
    sk_h,
    sk_n,
    scale,
    gate_scale,
    window,
    sink,
    REP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    D: tl.constexpr,
    KP: tl.constexpr,
    LOG_GATE: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dQ and the query side of dg for one query block, over its causal key blocks."""
    m0 = tl.program_id(0) * BM
    b = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    head, pos, row_ok, rows, first, g_q, q = _query_block(
        Q, G, DOCS, b, kv_head, m0, n, rep, groups, head_dim, sq_b, sq_h, sq_n,
        REP, BM, D, KP, HAS_DOCS,
    )  # fmt: skip
    dims = tl.arange(0, D)
    rows_out = ((b * heads + head[:, None]) * n + pos[:, None]) * head_dim + dims[None, :]
    rows_mask = row_ok[:, None] & (dims[None, :] < head_dim)
    do = tl.load(DO + rows_out, mask=rows_mask, other=0.0)
    lse = _rows_of(LSE, b, head, pos, row_ok, n, heads)
    delta = _rows_of(DELTA, b, head, pos, row_ok, n, heads)
    dq = tl.zeros((REP * BM, D), tl.float32)
    dg_q = tl.zeros((BM, KP), tl.float32)
    for start in range(_first_key(DOCS, b, m0, n, BN, HAS_DOCS), tl.minimum(m0 + BM, n), BN):
        cols = start + tl.arange(0, BN)
        k, v = _key_block(K, V, b, kv_head, cols, n, head_dim, sk_b, sk_h, sk_n, D)
        g_k = _assignments(G, b, cols, n, groups, KP)
        scores, raw, affinity, distant = _scores(
            q, k, g_q, g_k, rows, first, cols, n, scale, gate_scale, window, sink,
            REP, BM, BN, LOG_GATE, PRECISION,
        )  # fmt: skip
        scores = tl.where(row_ok[:, None], scores, float("-inf"))
        _, draw, daffinity = _score_grads(
            scores, raw, affinity, distant, lse, delta, do, v, gate_scale,
            REP, BM, BN, LOG_GATE, PRECISION,
        )  # fmt: skip
        dq += tl.dot(draw.to(k.dtype), k, input_precision=PRECISION)
        dg_q += tl.dot(daffinity, g_k, input_precision="ieee")
    tl.store(DQ + rows_out, (dq * scale).to(DQ.dtype.element_ty), mask=rows_mask)
    _store_dg(DG_Q, dg_q, b, kv_head, kv_heads, rows, n, groups, KP)


TINY = tl.constexpr(TINY_AFFINITY)


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(x))


@functools.lru_cache(maxsize=None)
def _launch_shape(head_dim: int, rep: int, groups: int, on_gpu: bool):
    """Block sizes and launch options. Stacked rows (heads sharing a key/value head x queries)
    stay within what one program's registers hold; the interpreter takes small blocks, so that
    small test inputs still cross block edges."""
    d, rep_p, kp = _pow2(head_dim), triton.next_power_of_2(rep), _pow2(groups)
    if not on_gpu:
        return dict(REP=rep_p, BM=16, BN=16, D=d, KP=kp), {}
    rows = 128 if d <= 128 else 64
    block_m = max(16, rows // rep_p)
    block_n = 64 if d <= 128 else 32
    return dict(REP=rep_p, BM=block_m, BN=block_n, D=d, KP=kp), dict(
        num_warps=4 if d <= 64 else 8, num_stages=2
    )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class TritonSoftFocus(torch.autograd.Function):
    """Soft-gate causal Focus attention (dropout 0) by the kernels above.

    q [b, h, n, d], k/v [b, h_kv, n, d] (any strides), log_g [b, n, K], doc_start [b, n] or None
    -> [b, h, n, d]; gradients for q, k, v and log_g.
    """

    @staticmethod
    def forward(ctx, q, k, v, log_g, window, gate_scale, scale, sink, doc_start, gate):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        g = log_g.float().exp().contiguous()
        b, heads, n, head_dim = q.shape
        kv_heads = k.shape[1]
        meta, options = _launch_shape(head_dim, heads // kv_heads, g.shape[-1], q.is_cuda)
        docs = doc_start.to(torch.int32).contiguous() if doc_start is not None else g
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(b, heads, n, device=q.device, dtype=torch.float32)
        # what every launch, forward and backward, takes after its tensors
        scalars = _sizes(q, k, g) + _strides(q, k)
        scalars += (float(scale), float(gate_scale), int(window), int(sink))
        settings = dict(**meta, **options, **_flags(q, gate, doc_start))
        _forward[(triton.cdiv(n, meta["BM"]), b * kv_heads)](
            q, k, v, g, docs, out, lse, *scalars, **settings
        )
        ctx.save_for_backward(q, k, v, g, out, lse)
        ctx.launch = (docs, doc_start, scalars, settings)
        ctx.log_g_dtype = log_g.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, g, out, lse = ctx.saved_tensors
        docs, doc_start, scalars, settings = ctx.launch
        b, _, n, _ = q.shape
        kv_heads = k.shape[1]
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)
        query_end = _query_ends(doc_start, n, settings["BN"]) if doc_start is not None else g
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
        dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
        dg_q = torch.empty(b, kv_heads, n, g.shape[-1], device=g.device, dtype=torch.float32)
        dg_k = torch.empty_like(dg_q)
        _backward_keys[(triton.cdiv(n, settings["BN"]), b * kv_heads)](
            q, k, v, g, docs, query_end, grad_out, lse, delta, dk, dv, dg_k, *scalars, **settings
        )
        _backward_queries[(triton.cdiv(n, settings["BM"]), b * kv_heads)](
            q, k, v, g, docs, grad_out, lse, delta, dq, dg_q, *scalars, **settings
        )
        dlog_g = (dg_q.sum(1) + dg_k.sum(1)) * g
        return dq, dk, dv, dlog_g.to(ctx.log_g_dtype), None, None, None, None, None, None


def _sizes(q, k, g):
    b, heads, n, head_dim = q.shape
    return n, heads, k.shape[1], heads // k.shape[1], g.shape[-1], head_dim


def _strides(q, k):
    return q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2)


def _flags(q, gate: str, doc_start) -> dict:
    return dict(
        LOG_GATE=gate == "log",
        HAS_DOCS=doc_start is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def _query_ends(doc_start: torch.Tensor, n: int, block_n: int) -> torch.Tensor:
    """Per sequence and key block, one past the last query that reads a key of the block: the
    queries whose document starts at or before the block's last key (starts are nondecreasing)."""
    last_key = (
        torch.clamp(
            torch.arange(1, triton.cdiv(n, block_n) + 1, device=doc_start.device) * block_n, max=n
        )
        - 1
    )
    return torch.searchsorted(
        doc_start.contiguous(), last_key.expand(doc_start.shape[0], -1).contiguous(), right=True
    ).to(torch.int32)


def triton_soft_focus(q, k, v, log_g, *, window, gate_scale, scale, gate="log", sink=0,
                      doc_start=None):  # fmt: skip
    """Soft-gate causal Focus attention, fused: the signature of flex.flex_soft_focus."""
    return TritonSoftFocus.apply(q, k, v, log_g, window, gate_scale, scale, sink, doc_start, gate)
