"""Focus's soft gate as one fused attention kernel in Triton, forward and backward.

Why not FlexAttention: a score_mod's captured tensor gets its gradient by an atomic scatter per
score element (about 1.6e9 per layer backward at the 0.7B recipe's shape), and the affinity
g_i . g_j is recomputed for every head. Here, in FlashAttention-2's shape:

* forward: a program owns a block of queries of one sequence and one key/value head, with every
  query head that shares that key/value head stacked along the rows (GQA: keys and values are
  loaded once for all of them); the affinity of a (query block, key block) tile is one small dot
  product, shared by those heads; an online softmax over the causal key blocks (those before the
  query's document are skipped) stores the output and the natural log-sum-exp;
* backward: `delta` (the rows' dO . O) by a small kernel, then one pass per key block for dK, dV
  and the key side of dg (each query block's affinity computed once, the heads sharing the key
  block taken one after another), and one pass per query block for dQ and the query side of dg,
  each accumulated in registers and written once: no atomics. The per-head sums of dg are per
  key/value head and added up outside (a [b, heads_kv, n, K] tensor, small). Each pass has tiles
  of its own (triton_launch.py's table, per GPU architecture).

The affinity and dg run over the K groups unpadded, K fp32 FMAs a pair on CUDA cores (a dot
product pads K to 16, and tf32x3 on tensor cores, for fp32 accuracy, costs the keys pass its
registers: spills on A100 where this fits).

Scores, for query i and key j (positions), window w, sinks s, the query's document start f:
causal iff f <= j <= i; distant iff causal and i - j >= w and j >= f + s; on a distant pair the
log gate adds lambda * log(max(g_i . g_j, tiny)), the paper's gate multiplies the logit by
sigmoid(lambda g_i . g_j) (focus_gate.py has the rule and its reasons).

Context parallelism: the queries may be a chunk inside the sequence, positions [offset, offset +
n_q), against the n = offset + n_q keys before them; positions decide every pair, the chunk's own
rows address the query-side tensors (q, out, the row statistics, dq, the queries' dg). A chunk
compiles apart (CHUNK), so the whole sequence's kernels keep the registers they fit in.

Addressing: every tensor is read by its own strides (Megatron hands V as a view of the fused QKV
output, and K, after RoPE, as a new tensor), from a 64-bit base per tile plus 32-bit offsets
inside the tile (triton_launch.check_tile_offsets refuses a layout where those would wrap).

Triton compiles these kernels for a GPU. With TRITON_INTERPRET=1 set before Triton is imported (the
tests do, and the GPU session's CPU rehearsal), they run under Triton's interpreter on CPU tensors
instead (numpy, one program after another): how the tests check them exactly as written.
"""

import torch
import triton
import triton.language as tl

from megatron_focus.model.kernels import triton_launch
from megatron_focus.model.kernels.flex import TINY_AFFINITY
from megatron_focus.model.kernels.triton_launch import Launch

TINY = tl.constexpr(TINY_AFFINITY)


@triton.jit
def _heads(x, REP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """A [BM, BN] tile repeated for the REP stacked query heads: [REP * BM, BN]."""
    return tl.reshape(tl.broadcast_to(x[None, :, :], (REP, BM, BN)), (REP * BM, BN))


@triton.jit
def _head_sum(x, REP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """[REP * BM, BN] summed over the stacked heads: [BM, BN]."""
    return tl.sum(tl.reshape(x, (REP, BM, BN)), axis=0)


@triton.jit
def _base(X, b, head, row, s_b, s_h, s_n):
    """X's element (b, head, row, 0), addressed in 64 bits."""
    wide = tl.int64
    return X + tl.cast(b, wide) * s_b + tl.cast(head, wide) * s_h + tl.cast(row, wide) * s_n


@triton.jit
def _stacked(m0, rep, n, REP: tl.constexpr, BM: tl.constexpr):
    """Stacked rows of a query block: each row's head (from the block's first), position in the
    block, and validity."""
    r = tl.arange(0, REP * BM)
    return r // BM, r % BM, (r // BM < rep) & (m0 + r % BM < n)


@triton.jit
def _stacked_tile(X, b, head0, m0, s_b, s_h, s_n, head, row, ok, head_dim, D: tl.constexpr):
    """(pointers, mask) of a stacked [REP * BM, D] tile of a [b, heads, n, d] tensor."""
    dims = tl.arange(0, D)
    at = _base(X, b, head0, m0, s_b, s_h, s_n) + head[:, None] * s_h + row[:, None] * s_n
    return at + dims[None, :], ok[:, None] & (dims[None, :] < head_dim)


@triton.jit
def _rows_tile(X, b, head, m0, n, s_b, s_h, s_n, head_dim, BM: tl.constexpr, D: tl.constexpr):
    """(pointers, mask) of rows m0 .. m0 + BM of one head of a [b, heads, n, d] tensor."""
    rows = tl.arange(0, BM)
    dims = tl.arange(0, D)
    at = _base(X, b, head, m0, s_b, s_h, s_n) + rows[:, None] * s_n + dims[None, :]
    return at, (m0 + rows[:, None] < n) & (dims[None, :] < head_dim)


@triton.jit
def _row_stats(X, b, head, m0, n, heads, offsets, ok):
    """Rows of a contiguous [b, heads, n] float32 statistic (log-sum-exp, delta)."""
    return tl.load(_base(X, b, head, m0, heads * n, n, 1) + offsets, mask=ok, other=0.0)


@triton.jit
def _column(G, b, m0, n, groups: tl.constexpr, k, BM: tl.constexpr):
    """g[:, k] [BM] of positions m0 .. m0 + BM (zero past n) of sequence b."""
    rows = tl.arange(0, BM)
    at = _base(G, b, 0, m0, n * groups, 0, groups) + rows * groups + k
    return tl.load(at, mask=m0 + rows < n, other=0.0)


@triton.jit
def _affinity(G, b, m0, n0, n, groups: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """g_i . g_j [BM, BN] of positions i in m0 .. m0 + BM and j in n0 .. n0 + BN: K fp32 FMAs
    a pair (K is small: a dot product would pad it to 16 and, in fp32 on tensor cores, split
    it three ways, at twice the registers)."""
    affinity = tl.zeros((BM, BN), tl.float32)
    for k in tl.static_range(groups):
        column = _column(G, b, n0, n, groups, k, BN)
        affinity += _column(G, b, m0, n, groups, k, BM)[:, None] * column[None, :]
    return affinity


@triton.jit
def _dg(daffinity, G, b, n0, n, groups: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        KP: tl.constexpr):  # fmt: skip
    """daffinity [BM, BN] @ g [BN, K] of positions n0 .. n0 + BN: [BM, KP], a group at a time."""
    out = tl.zeros((BM, KP), tl.float32)
    k_of = tl.arange(0, KP)[None, :]
    for k in tl.static_range(groups):
        column = tl.sum(daffinity * _column(G, b, n0, n, groups, k, BN)[None, :], axis=1)
        out += tl.where(k_of == k, column[:, None], 0.0)
    return out


@triton.jit
def _document_starts(DOCS, b, m0, n, BM: tl.constexpr, HAS_DOCS: tl.constexpr):
    rows = m0 + tl.arange(0, BM)
    if HAS_DOCS:
        return tl.load(_base(DOCS, b, 0, m0, n, 0, 1) + tl.arange(0, BM), mask=rows < n, other=0)
    return tl.zeros((BM,), dtype=tl.int32)


@triton.jit
def _first_key(DOCS, b, m0, n, BN: tl.constexpr, HAS_DOCS: tl.constexpr):
    """The first key block a query block reads: 0, or its first document's."""
    if HAS_DOCS:
        return (tl.load(_base(DOCS, b, 0, m0, n, 0, 1)) // BN) * BN
    return 0


@triton.jit
def _pairs(i, j, first, n, window, sink):
    """(causal, distant) of query positions i (document starts `first`) and key positions j,
    broadcast against each other: [queries, keys], or [keys, queries] in the keys pass."""
    causal = (j <= i) & (j >= first) & (j < n)
    return causal, causal & (i - j >= window) & (j >= first + sink)


@triton.jit
def _gate(affinity, distant, gate_scale, LOG_GATE: tl.constexpr):
    """The gate on a tile: the log gate's additive bias, or the paper's factor on the logit."""
    if LOG_GATE:
        return tl.where(distant, gate_scale * tl.log(tl.maximum(affinity, TINY)), 0.0)
    return tl.where(distant, tl.sigmoid(gate_scale * affinity), 1.0)


@triton.jit
def _gated(raw, gate, causal, LOG_GATE: tl.constexpr):
    """Scores from raw scaled q.k and the gate (tiles of one shape), -inf off the causal pairs."""
    if LOG_GATE:
        return tl.where(causal, raw + gate, float("-inf"))
    return tl.where(causal, raw * gate, float("-inf"))


@triton.jit
def _affinity_grad(dgate, affinity, distant, gate_scale, LOG_GATE: tl.constexpr):
    """d affinity from d gate (summed over heads): the log gate's dbias, or the paper's dfactor."""
    if LOG_GATE:
        return tl.where(distant & (affinity > TINY), dgate * gate_scale / affinity, 0.0)
    factor = tl.sigmoid(gate_scale * affinity)
    return tl.where(distant, dgate * gate_scale * factor * (1.0 - factor), 0.0)


@triton.jit
def _forward(
    Q, K, V, G, DOCS, OUT, LSE,
    n, n_q, offset, heads, kv_heads, rep, groups: tl.constexpr, head_dim,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_n,
    scale, gate_scale, window, sink,
    REP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, KP: tl.constexpr,
    LOG_GATE: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    if not CHUNK:  # the whole sequence: compiled without the chunk's arithmetic
        n_q = n
        offset = 0
    m0 = tl.program_id(0) * BM  # the block's first query row; its position is p0
    p0 = offset + m0
    b = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    head, row, ok = _stacked(m0, rep, n_q, REP, BM)
    q_at, q_ok = _stacked_tile(
        Q, b, kv_head * rep, m0, sq_b, sq_h, sq_n, head, row, ok, head_dim, D
    )
    q = tl.load(q_at, mask=q_ok, other=0.0)
    rows = p0 + tl.arange(0, BM)
    first = _document_starts(DOCS, b, p0, n, BM, HAS_DOCS)
    running_max = tl.full((REP * BM,), float("-inf"), tl.float32)
    total = tl.zeros((REP * BM,), tl.float32)
    acc = tl.zeros((REP * BM, D), tl.float32)
    for start in range(_first_key(DOCS, b, p0, n, BN, HAS_DOCS), tl.minimum(p0 + BM, n), BN):
        k_at, kv_ok = _rows_tile(K, b, kv_head, start, n, sk_b, sk_h, sk_n, head_dim, BN, D)
        v_at, v_ok = _rows_tile(V, b, kv_head, start, n, sv_b, sv_h, sv_n, head_dim, BN, D)
        k = tl.load(k_at, mask=kv_ok, other=0.0)
        cols = start + tl.arange(0, BN)
        causal, distant = _pairs(rows[:, None], cols[None, :], first[:, None], n, window, sink)
        affinity = _affinity(G, b, p0, start, n, groups, BM, BN)
        gate = _gate(affinity, distant, gate_scale, LOG_GATE)
        raw = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = _gated(raw, _heads(gate, REP, BM, BN), _heads(causal, REP, BM, BN), LOG_GATE)
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no key yet: all zero
        p = tl.exp(scores - shift[:, None])
        alpha = tl.exp(running_max - shift)
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_at, mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
    total = tl.where(total == 0.0, 1.0, total)
    o_at, o_ok = _stacked_tile(
        OUT, b, kv_head * rep, m0, so_b, so_h, so_n, head, row, ok, head_dim, D
    )
    tl.store(o_at, (acc / total[:, None]).to(OUT.dtype.element_ty), mask=o_ok)
    lse_at = _base(LSE, b, kv_head * rep, m0, heads * n_q, n_q, 1) + head * n_q + row
    tl.store(lse_at, running_max + tl.log(total), mask=ok)


@triton.jit
def _delta(
    OUT, DO, DELTA, n, heads, head_dim, so_b, so_h, so_n, sd_b, sd_h, sd_n,
    BM: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """delta [b, heads, n] = rowsum(dO * O) in float32, the backward's first step."""
    m0 = tl.program_id(0) * BM
    b = tl.program_id(1) // heads
    head = tl.program_id(1) % heads
    o_at, ok = _rows_tile(OUT, b, head, m0, n, so_b, so_h, so_n, head_dim, BM, D)
    do_at, do_ok = _rows_tile(DO, b, head, m0, n, sd_b, sd_h, sd_n, head_dim, BM, D)
    products = tl.load(o_at, mask=ok, other=0.0).to(tl.float32)
    products *= tl.load(do_at, mask=ok, other=0.0).to(tl.float32)
    rows = tl.arange(0, BM)
    at = _base(DELTA, b, head, m0, heads * n, n, 1) + rows
    tl.store(at, tl.sum(products, axis=1), mask=m0 + rows < n)


@triton.jit
def _backward_keys(
    Q, K, V, G, DOCS, QUERY_END, DO, LSE, DELTA, DK, DV, DG_K,
    n, n_q, offset, heads, kv_heads, rep, groups: tl.constexpr, head_dim,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sd_b, sd_h, sd_n, sg_b, sg_h, sg_n,
    scale, gate_scale, window, sink,
    BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, KP: tl.constexpr,
    LOG_GATE: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """dK, dV and the key side of dg for one key block, over the query blocks that see it; the
    heads sharing the key/value head one after another (sg_*: DK's and DV's strides)."""
    if not CHUNK:
        n_q = n
        offset = 0
    n0 = tl.program_id(0) * BN
    b = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    k_at, kv_ok = _rows_tile(K, b, kv_head, n0, n, sk_b, sk_h, sk_n, head_dim, BN, D)
    v_at, v_ok = _rows_tile(V, b, kv_head, n0, n, sv_b, sv_h, sv_n, head_dim, BN, D)
    k = tl.load(k_at, mask=kv_ok, other=0.0)
    v = tl.load(v_at, mask=kv_ok, other=0.0)
    cols = n0 + tl.arange(0, BN)
    dk = tl.zeros((BN, D), tl.float32)
    dv = tl.zeros((BN, D), tl.float32)
    dg_k = tl.zeros((BN, KP), tl.float32)
    end = n_q
    if HAS_DOCS:
        end = tl.load(_base(QUERY_END, b, 0, tl.program_id(0), tl.num_programs(0), 0, 1))
    begin = n0  # the first query row at or past the block
    if CHUNK:
        begin = tl.maximum(n0 - offset, 0)
    for m0 in range((begin // BM) * BM, end, BM):  # tiles [keys, queries], as FlashAttention-2's
        rows = m0 + tl.arange(0, BM)
        row_ok = rows < n_q
        rows += offset  # positions
        first = _document_starts(DOCS, b, offset + m0, n, BM, HAS_DOCS)
        causal, distant = _pairs(rows[None, :], cols[:, None], first[None, :], n, window, sink)
        causal = causal & row_ok[None, :]
        affinity = _affinity(G, b, n0, offset + m0, n, groups, BN, BM)
        gate = _gate(affinity, distant, gate_scale, LOG_GATE)
        dgate = tl.zeros((BN, BM), tl.float32)
        for r in range(rep):
            head = kv_head * rep + r
            q_at, q_ok = _rows_tile(Q, b, head, m0, n_q, sq_b, sq_h, sq_n, head_dim, BM, D)
            do_at, do_ok = _rows_tile(DO, b, head, m0, n_q, sd_b, sd_h, sd_n, head_dim, BM, D)
            q = tl.load(q_at, mask=q_ok, other=0.0)
            do = tl.load(do_at, mask=q_ok, other=0.0)
            offsets = tl.arange(0, BM)
            lse = _row_stats(LSE, b, head, m0, n_q, heads, offsets, row_ok)
            delta = _row_stats(DELTA, b, head, m0, n_q, heads, offsets, row_ok)
            raw = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale
            p = tl.exp(_gated(raw, gate, causal, LOG_GATE) - lse[None, :])
            dv += tl.dot(p.to(do.dtype), do, input_precision=PRECISION)
            dscores = p * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])
            if LOG_GATE:
                dgate += dscores
                draw = dscores
            else:
                dgate += dscores * raw
                draw = dscores * gate
            dk += tl.dot(draw.to(q.dtype), q, input_precision=PRECISION)
        daffinity = _affinity_grad(dgate, affinity, distant, gate_scale, LOG_GATE)
        dg_k += _dg(daffinity, G, b, offset + m0, n, groups, BN, BM, KP)
    dk_at, dk_ok = _rows_tile(DK, b, kv_head, n0, n, sg_b, sg_h, sg_n, head_dim, BN, D)
    dv_at, dv_ok = _rows_tile(DV, b, kv_head, n0, n, sg_b, sg_h, sg_n, head_dim, BN, D)
    tl.store(dk_at, (dk * scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(dv_at, dv.to(DV.dtype.element_ty), mask=kv_ok)
    _store_dg(DG_K, dg_k, b, kv_head, kv_heads, n0, n, groups, BN, KP)


@triton.jit
def _store_dg(DG, dg, b, kv_head, kv_heads, m0, n, groups, BM: tl.constexpr, KP: tl.constexpr):
    """Rows m0 .. m0 + BM of a [b, kv_heads, n, K] float32 dg."""
    rows = tl.arange(0, BM)
    k = tl.arange(0, KP)
    at = _base(DG, b, kv_head, m0, kv_heads * n * groups, n * groups, groups)
    tl.store(
        at + rows[:, None] * groups + k[None, :],
        dg,
        mask=(m0 + rows[:, None] < n) & (k[None, :] < groups),
    )


@triton.jit
def _backward_queries(
    Q, K, V, G, DOCS, DO, LSE, DELTA, DQ, DG_Q,
    n, n_q, offset, heads, kv_heads, rep, groups: tl.constexpr, head_dim,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sd_b, sd_h, sd_n, so_b, so_h, so_n,
    scale, gate_scale, window, sink,
    REP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, KP: tl.constexpr,
    LOG_GATE: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """dQ and the query side of dg for one query block, over its causal key blocks (so_*: DQ's
    strides)."""
    if not CHUNK:
        n_q = n
        offset = 0
    m0 = tl.program_id(0) * BM
    p0 = offset + m0
    b = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    head, row, ok = _stacked(m0, rep, n_q, REP, BM)
    q_at, q_ok = _stacked_tile(
        Q, b, kv_head * rep, m0, sq_b, sq_h, sq_n, head, row, ok, head_dim, D
    )
    do_at, do_ok = _stacked_tile(
        DO, b, kv_head * rep, m0, sd_b, sd_h, sd_n, head, row, ok, head_dim, D
    )
    q = tl.load(q_at, mask=q_ok, other=0.0)
    do = tl.load(do_at, mask=q_ok, other=0.0)
    offsets = head * n_q + row
    lse = _row_stats(LSE, b, kv_head * rep, m0, n_q, heads, offsets, ok)
    delta = _row_stats(DELTA, b, kv_head * rep, m0, n_q, heads, offsets, ok)
    rows = p0 + tl.arange(0, BM)
    first = _document_starts(DOCS, b, p0, n, BM, HAS_DOCS)
    dq = tl.zeros((REP * BM, D), tl.float32)
    dg_q = tl.zeros((BM, KP), tl.float32)
    for start in range(_first_key(DOCS, b, p0, n, BN, HAS_DOCS), tl.minimum(p0 + BM, n), BN):
        k_at, kv_ok = _rows_tile(K, b, kv_head, start, n, sk_b, sk_h, sk_n, head_dim, BN, D)
        v_at, v_ok = _rows_tile(V, b, kv_head, start, n, sv_b, sv_h, sv_n, head_dim, BN, D)
        k = tl.load(k_at, mask=kv_ok, other=0.0)
        v = tl.load(v_at, mask=kv_ok, other=0.0)
        cols = start + tl.arange(0, BN)
        causal, distant = _pairs(rows[:, None], cols[None, :], first[:, None], n, window, sink)
        affinity = _affinity(G, b, p0, start, n, groups, BM, BN)
        gate = _gate(affinity, distant, gate_scale, LOG_GATE)
        raw = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        stacked_gate = _heads(gate, REP, BM, BN)
        scores = _gated(raw, stacked_gate, _heads(causal, REP, BM, BN) & ok[:, None], LOG_GATE)
        p = tl.exp(scores - lse[:, None])
        dscores = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
        if LOG_GATE:
            dgate = _head_sum(dscores, REP, BM, BN)
            draw = dscores
        else:
            dgate = _head_sum(dscores * raw, REP, BM, BN)
            draw = dscores * stacked_gate
        dq += tl.dot(draw.to(k.dtype), k, input_precision=PRECISION)
        daffinity = _affinity_grad(dgate, affinity, distant, gate_scale, LOG_GATE)
        dg_q += _dg(daffinity, G, b, start, n, groups, BM, BN, KP)
    dq_at, dq_ok = _stacked_tile(
        DQ, b, kv_head * rep, m0, so_b, so_h, so_n, head, row, ok, head_dim, D
    )
    tl.store(dq_at, (dq * scale).to(DQ.dtype.element_ty), mask=q_ok)
    _store_dg(DG_Q, dg_q, b, kv_head, kv_heads, m0, n_q, groups, BM, KP)


def _strides(t: torch.Tensor) -> tuple:
    return t.stride(0), t.stride(1), t.stride(2)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class Plan:
    """The launches of one soft-gate call, forward and backward, from its inputs' shapes,
    strides and dtypes and the GPU's compute capability (None: Triton's interpreter); the fit
    test builds it on meta tensors for each architecture."""

    def __init__(self, q, k, v, g, doc_start, *, window, gate_scale, scale, sink, gate,
                 capability, offset=0):  # fmt: skip
        b, heads, n_q, head_dim = q.shape
        n = k.shape[2]
        if n != offset + n_q:
            raise ValueError(
                f"queries at positions [{offset}, {offset + n_q}) need the {offset + n_q} keys "
                f"before them, not {n}"
            )
        self.b, self.n, self.n_q, self.offset, self.kv_heads = b, n, n_q, offset, k.shape[1]
        self.rep = heads // self.kv_heads
        self.groups = g.shape[-1]
        self.tiles = {
            p: triton_launch.gate_tile(p, capability, head_dim, q.dtype, gate, offset > 0)
            for p in triton_launch.GATE_PASSES
        }
        missing = [p for p, tile in self.tiles.items() if tile is None]
        if missing:
            raise ValueError(
                f"the fused soft gate has no tile for {q.dtype} at head dim {head_dim} on a GPU "
                f"of compute capability {capability} (triton_launch.py); use --focus-kernel "
                "flex or chunked"
            )
        self.sizes = (n, n_q, offset, heads, self.kv_heads, self.rep, self.groups, head_dim)
        self.scalars = (float(scale), float(gate_scale), int(window), int(sink))
        self.dims = dict(D=triton_launch.padded(head_dim), KP=triton_launch.padded(self.groups))
        self.flags = dict(
            LOG_GATE=gate == "log",
            HAS_DOCS=doc_start is not None,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            CHUNK=offset > 0,
        )
        self.docs = doc_start

    def _stacking(self, tile):
        """REP, BM: the query heads sharing a key/value head stacked on `tile.rows` rows (so a
        tile's registers do not grow with GQA; fewer queries a block as more heads share)."""
        rep = triton.next_power_of_2(self.rep)
        return dict(REP=rep, BM=max(1, tile.rows // rep))

    def _launch(self, kernel, pass_, grid_rows, tensors, strides, constants):
        """One program per `grid_rows` rows of the pass's own extent (queries, or keys for the
        keys pass), per sequence and key/value head."""
        tile = self.tiles[pass_]
        extent = self.n if pass_ == "keys" else self.n_q
        extents = (constants.get("REP", 1), max(constants["BM"], constants["BN"]))
        for name, t in strides:  # a tile spans heads and rows
            triton_launch.check_tile_offsets(name, _strides(t)[1:], extents)
        return Launch(
            kernel,
            (triton.cdiv(extent, grid_rows), self.b * self.kv_heads),
            (*tensors, *self.sizes, *(s for _, t in strides for s in _strides(t)), *self.scalars),
            dict(**constants, **self.dims, **self.flags),
            dict(num_warps=tile.warps, num_stages=tile.stages),
        )

    def forward(self, q, k, v, g, docs, out, lse) -> Launch:
        tile = self.tiles["forward"]
        constants = dict(**self._stacking(tile), BN=tile.keys)
        strides = (("q", q), ("k", k), ("v", v), ("out", out))
        return self._launch(
            _forward, "forward", constants["BM"], (q, k, v, g, docs, out, lse), strides, constants
        )

    def delta(self, out, grad_out, delta) -> Launch:
        tile = self.tiles["queries"]
        heads, head_dim = self.sizes[3], self.sizes[7]
        return Launch(
            _delta,
            (triton.cdiv(self.n_q, tile.rows), self.b * heads),
            (out, grad_out, delta, self.n_q, heads, head_dim, *_strides(out), *_strides(grad_out)),
            dict(BM=tile.rows, D=self.dims["D"]),
            dict(num_warps=tile.warps),
        )

    def keys(self, q, k, v, g, docs, query_end, grad_out, lse, delta, dk, dv, dg_k) -> Launch:
        tile = self.tiles["keys"]
        constants = dict(BM=tile.rows, BN=tile.keys)
        strides = (("q", q), ("k", k), ("v", v), ("grad", grad_out), ("dk", dk))
        return self._launch(
            _backward_keys,
            "keys",
            tile.keys,
            (q, k, v, g, docs, query_end, grad_out, lse, delta, dk, dv, dg_k),
            strides,
            constants,
        )

    def queries(self, q, k, v, g, docs, grad_out, lse, delta, dq, dg_q) -> Launch:
        tile = self.tiles["queries"]
        constants = dict(**self._stacking(tile), BN=tile.keys)
        strides = (("q", q), ("k", k), ("v", v), ("grad", grad_out), ("dq", dq))
        return self._launch(
            _backward_queries,
            "queries",
            constants["BM"],
            (q, k, v, g, docs, grad_out, lse, delta, dq, dg_q),
            strides,
            constants,
        )

    def query_ends(self, doc_start: torch.Tensor) -> torch.Tensor:
        """Per sequence and key block of the keys pass, one past the last query row that reads
        a key of the block: the queries whose document starts at or before the block's last key
        (starts are nondecreasing)."""
        block = self.tiles["keys"].keys
        ends = torch.arange(1, triton.cdiv(self.n, block) + 1, device=doc_start.device) * block
        last_key = torch.clamp(ends, max=self.n) - 1
        position = torch.searchsorted(
            doc_start.contiguous(), last_key.expand(self.b, -1).contiguous(), right=True
        )
        return (position - self.offset).clamp(0, self.n_q).to(torch.int32)

    def launches(self, q, k, v, g, docs):
        """Every launch of a forward and backward, on fresh outputs (the fit test's list)."""
        out, lse, dq, dk, dv, dg_q, dg_k, delta = _outputs(q, k, g)
        query_end = self.query_ends(self.docs) if self.docs is not None else g
        return [
            self.forward(q, k, v, g, docs, out, lse),
            self.delta(out, out, delta),
            self.keys(q, k, v, g, docs, query_end, out, lse, delta, dk, dv, dg_k),
            self.queries(q, k, v, g, docs, out, lse, delta, dq, dg_q),
        ]


def _outputs(q, k, g):
    """out, lse, dq, dk, dv, dg_q, dg_k, delta for inputs q, k and assignments g (dg_q of the
    queries' rows, dg_k of the keys')."""
    b, heads, n_q, _ = q.shape
    kv_heads, n = k.shape[1:3]
    rows = torch.empty(b, heads, n_q, device=q.device, dtype=torch.float32)
    dg_q, dg_k = (
        torch.empty(b, kv_heads, m, g.shape[-1], device=g.device, dtype=torch.float32)
        for m in (n_q, n)
    )
    return (
        torch.empty(q.shape, device=q.device, dtype=q.dtype),
        rows,
        torch.empty(q.shape, device=q.device, dtype=q.dtype),
        torch.empty(k.shape, device=k.device, dtype=k.dtype),
        torch.empty(k.shape, device=k.device, dtype=k.dtype),
        dg_q,
        dg_k,
        torch.empty_like(rows),
    )


class TritonSoftFocus(torch.autograd.Function):
    """Soft-gate causal Focus attention (dropout 0) by the kernels above.

    q [b, h, n_q, d] at positions [offset, offset + n_q) (context parallelism's chunks; 0:
    the whole sequence), k/v [b, h_kv, n, d] with n = offset + n_q (any strides, each its own),
    log_g [b, n, K], doc_start [b, n] or None -> [b, h, n_q, d]; gradients for q, k, v and log_g.
    """

    @staticmethod
    def forward(ctx, q, k, v, log_g, window, gate_scale, scale, sink, doc_start, gate, offset):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        g = log_g.float().exp().contiguous()
        plan = Plan(
            q,
            k,
            v,
            g,
            doc_start,
            window=window,
            gate_scale=gate_scale,
            scale=scale,
            sink=sink,
            gate=gate,
            capability=triton_launch.capability_of(q),
            offset=offset,
        )
        docs = doc_start.to(torch.int32).contiguous() if doc_start is not None else g
        out, lse = _outputs(q, k, g)[:2]
        plan.forward(q, k, v, g, docs, out, lse)()
        ctx.save_for_backward(q, k, v, g, docs, out, lse)
        ctx.plan = plan
        ctx.log_g_dtype = log_g.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, g, docs, out, lse = ctx.saved_tensors
        plan = ctx.plan
        grad_out = _last_dim_contiguous(grad_out)
        _, _, dq, dk, dv, dg_q, dg_k, delta = _outputs(q, k, g)
        plan.delta(out, grad_out, delta)()
        query_end = plan.query_ends(plan.docs) if plan.docs is not None else g
        plan.keys(q, k, v, g, docs, query_end, grad_out, lse, delta, dk, dv, dg_k)()
        plan.queries(q, k, v, g, docs, grad_out, lse, delta, dq, dg_q)()
        dlog_g = dg_k.sum(1)
        dlog_g[:, plan.offset :] += dg_q.sum(1)
        dlog_g *= g
        return (dq, dk, dv, dlog_g.to(ctx.log_g_dtype)) + (None,) * 7


def triton_soft_focus(q, k, v, log_g, *, window, gate_scale, scale, gate="log", sink=0,
                      doc_start=None, offset=0):  # fmt: skip
    """Soft-gate causal Focus attention, fused: the signature of flex.flex_soft_focus, plus
    context parallelism's `offset` (the queries' first position; keys, routing and documents
    are taken up to the queries' last position)."""
    n = k.shape[2]
    if doc_start is not None:
        doc_start = doc_start[:, :n]
    return TritonSoftFocus.apply(
        q, k, v, log_g[:, :n], window, gate_scale, scale, sink, doc_start, gate, offset
    )
