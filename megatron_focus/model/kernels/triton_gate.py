"""Focus's soft gate as one fused attention kernel in Triton, forward and backward, in
FlashAttention-2's shape.

Why not FlexAttention: a score_mod's captured tensor gets its gradient by an atomic scatter per
score element (about 1.6e9 per layer backward at the 0.7B recipe's shape), and the affinity
g_i . g_j is recomputed for every head. Here:

* the assignments g come padded to 16 groups in the attention's dtype, so a tile's affinity is
  one tensor-core dot, [queries, 16] x [16, keys], beside QK^T's; so are the assignments'
  gradients (dA x g). Query heads that share a key/value head are stacked along the rows (GQA:
  keys, values and their assignments are loaded once for all of them);
* the log gate at lambda = 1 (the default and every recipe) takes no logarithm: a distant pair's
  weight is exp2(s - m) * a, with m the running maximum of the raw scores (a <= 1, so nothing
  overflows; the gate's floor TINY_AFFINITY bounds how far the largest weight can fall below 1,
  within float32's and bfloat16's range, not float16's, which takes the general path), and its
  backward needs no division (dA = P_raw (dP - delta), P_raw the ungated weight). Other lambdas
  use the hardware's log2 (lg2.approx), the paper's sigmoid gate its own factor;
* each program walks its key blocks (queries pass and forward) or query blocks (keys pass) in
  three runs: the blocks of the first document edge and the sinks, with masks; the wholly
  distant blocks, most of them, with no mask at all; the window band and the diagonal, with
  masks;
* backward: `delta` (the rows' dO . O) by a small kernel, then one pass per key block for dK, dV
  and the key side of dg (each query block's affinity computed once, the heads sharing the key
  block taken one after another), and one pass per query block for dQ and the query side of
  dg (per query head, summed outside), each accumulated in registers and written once: no
  atomics, deterministic. Each pass has tiles of its own (triton_launch.py's table, per GPU
  architecture).

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

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from megatron_focus.model.kernels import triton_launch
from megatron_focus.model.kernels.flex import TINY_AFFINITY
from megatron_focus.model.kernels.triton_launch import Launch

TINY = tl.constexpr(TINY_AFFINITY)
LOG2E = tl.constexpr(math.log2(math.e))
LN2 = tl.constexpr(math.log(2.0))
# The gate's forms (GATE): the log gate at lambda 1 in bf16 or fp32, with no logarithm; the log
# gate at any lambda; the paper's sigmoid factor.
FAST_LOG, LOG, SIGMOID = 0, 1, 2
GROUPS_PADDED = 16  # the assignments' columns: one tensor-core dot's depth


@triton.jit
def _lg2(x, HW: tl.constexpr):
    """log2: the hardware's approximation on a GPU, exact under the interpreter."""
    if HW:
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@triton.jit
def _div(x, y, HW: tl.constexpr):
    if HW:
        return libdevice.fast_dividef(x, y)
    return x / y


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
def _load_rows(X, b, head, m0, n, s_b, s_h, s_n, head_dim, BM: tl.constexpr, D: tl.constexpr,
               MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):  # fmt: skip
    """Rows m0 .. m0 + BM of one head of a [b, heads, n, d] tensor (zero past n and d), masked
    only where a row may lie past n (`MASK_ROWS`) or d is padded (not `EVEN_D`): a wholly
    distant run's blocks are whole."""
    at, ok = _rows_tile(X, b, head, m0, n, s_b, s_h, s_n, head_dim, BM, D)
    if MASK_ROWS or not EVEN_D:
        return tl.load(at, mask=ok, other=0.0)
    return tl.load(at)


@triton.jit
def _groups(G, b, positions, n, KP: tl.constexpr, MASK_ROWS: tl.constexpr = True):
    """The assignments g [rows, KP] of `positions` (zero past n) of sequence b: [b, n, KP]."""
    at = _base(G, b, 0, 0, n * KP, 0, 0) + positions[:, None] * KP + tl.arange(0, KP)[None, :]
    if MASK_ROWS:
        return tl.load(at, mask=positions[:, None] < n, other=0.0)
    return tl.load(at)


@triton.jit
def _document_starts(DOCS, b, positions, n, HAS_DOCS: tl.constexpr):
    if HAS_DOCS:
        return tl.load(_base(DOCS, b, 0, 0, n, 0, 0) + positions, mask=positions < n, other=0)
    return tl.zeros(positions.shape, dtype=tl.int32)


@triton.jit
def _pairs(i, j, first, window, sink, HAS_DOCS: tl.constexpr):
    """(causal, distant) of query positions i (document starts `first`) and key positions j,
    broadcast against each other: [queries, keys], or [keys, queries] in the keys pass. Keys
    past the sequence need no mask (they are past every row that is stored), nor do rows past
    it (their q, dO and statistics load as zeros, so they add nothing to any gradient)."""
    causal = j <= i
    if HAS_DOCS:
        causal = causal & (j >= first)
    return causal, causal & (i - j >= window) & (j >= first + sink)


@triton.jit
def _block_floor(x, B: tl.constexpr):
    """The start of the block of size B holding position x >= 0."""
    return (x // B) * B


@triton.jit
def _key_runs(DOCS, b, p0, n, window, sink, BM: tl.constexpr, BN: tl.constexpr,
              HAS_DOCS: tl.constexpr):  # fmt: skip
    """For the query block at positions p0 .. p0 + BM: the starts of its three runs of key
    blocks, (first, distant, band, end): [first, distant) the first document's edge and the
    sinks, masked; [distant, band) wholly distant from every row (no mask); [band, end) the
    window band and the diagonal, masked."""
    last = tl.minimum(p0 + BM, n) - 1
    first_doc = 0
    last_doc = 0
    if HAS_DOCS:
        first_doc = tl.load(_base(DOCS, b, 0, p0, n, 0, 1))
        last_doc = tl.load(_base(DOCS, b, 0, last, n, 0, 1))
    first = _block_floor(first_doc, BN)
    # keys below `band`: i - j >= window for every row; at or past `distant`: past every row's
    # document start and sinks
    band = _block_floor(tl.maximum(p0 + 1 - window, 0), BN)
    distant = tl.maximum(first, tl.minimum(tl.cdiv(last_doc + sink, BN) * BN, band))
    band = tl.maximum(band, distant)
    return first, distant, band, last + 1


@triton.jit
def _query_runs(n0, n_q, offset, window, sink, end, free_end, BM: tl.constexpr,
                BN: tl.constexpr, HAS_DOCS: tl.constexpr):  # fmt: skip
    """For the key block at positions n0 .. n0 + BN (keys pass), in the chunk's query rows
    (those that read it end at `end`): the starts of its runs of query blocks, (begin,
    distant, band): [begin, distant) the diagonal and the window band, masked; [distant, band)
    whole blocks wholly distant from the key block (no mask); [band, end) the rest, masked: the
    last partial block, and with documents the rows whose document start or sinks pass the
    block's first key (from `free_end` on)."""
    begin = _block_floor(tl.maximum(n0 - offset, 0), BM)
    last = tl.cdiv(end, BM) * BM
    distant = tl.cdiv(tl.maximum(n0 + BN - 1 + window - offset, 0), BM) * BM
    distant = tl.minimum(tl.maximum(distant, begin), last)
    if not HAS_DOCS:
        free_end = tl.where(n0 >= sink, n_q, 0)  # a block holding sinks: all masked
    band = tl.maximum(_block_floor(tl.minimum(free_end, n_q), BM), distant)
    return begin, distant, band


@triton.jit
def _gate_terms(a, distant, gate_scale, MASKED: tl.constexpr, GATE: tl.constexpr,
                HW: tl.constexpr):  # fmt: skip
    """(the bias LOG adds to a distant pair's score in log2 units, the factor FAST_LOG
    multiplies its weight by or SIGMOID its logit by; 0 and 1 elsewhere) of an affinity tile:
    computed once a tile, whichever heads share it."""
    if GATE == 1:
        bias = gate_scale * _lg2(tl.maximum(a, TINY), HW)
        factor = bias  # unused
        if MASKED:
            bias = tl.where(distant, bias, 0.0)
    else:
        if GATE == 0:
            factor = tl.maximum(a, TINY)
        else:
            factor = tl.sigmoid(gate_scale * a)
        bias = factor  # unused
        if MASKED:
            factor = tl.where(distant, factor, 1.0)
    return bias, factor


@triton.jit
def _scores(raw, bias, factor, causal, qk_scale, MASKED: tl.constexpr, GATE: tl.constexpr):
    """Scores in log2 units: FAST_LOG's are the raw ones (its factor multiplies the weight),
    LOG's add its bias, SIGMOID's scale the logit by its factor; -inf off the causal pairs."""
    if GATE == 0:
        scores = raw * qk_scale
    elif GATE == 1:
        scores = raw * qk_scale + bias
    else:
        scores = raw * (qk_scale * factor)
    if MASKED:
        scores = tl.where(causal, scores, float("-inf"))
    return scores


@triton.jit
def _forward_run(
    acc, total, running_max, q, gq, positions, first, K, V, G, b, kv_head, start_at, stop_at,
    n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, qk_scale, gate_scale, window, sink,
    BN: tl.constexpr, D: tl.constexpr, KP: tl.constexpr, GATE: tl.constexpr,
    MASKED: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr, HW: tl.constexpr,
    EVEN_D: tl.constexpr,
):  # fmt: skip
    """The online softmax over key blocks start_at .. stop_at (masked or wholly distant)."""
    for start in range(start_at, stop_at, BN):
        cols = start + tl.arange(0, BN)
        k = _load_rows(K, b, kv_head, start, n, sk_b, sk_h, sk_n, head_dim, BN, D, MASKED, EVEN_D)
        raw = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        gk = _groups(G, b, cols, n, KP, MASKED)
        a = tl.dot(gq, tl.trans(gk), input_precision=PRECISION)
        causal = first[:, None] >= 0  # placeholders where no mask is needed
        distant = causal
        if MASKED:
            causal, distant = _pairs(positions[:, None], cols[None, :], first[:, None], window,
                                     sink, HAS_DOCS)  # fmt: skip
        bias, factor = _gate_terms(a, distant, gate_scale, MASKED, GATE, HW)
        scores = _scores(raw, bias, factor, causal, qk_scale, MASKED, GATE)
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        shift = new_max
        if MASKED:
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no key yet: all zero
        p = tl.exp2(scores - shift[:, None])
        if GATE == 0:
            p = p * factor
        alpha = tl.exp2(running_max - shift)
        total = total * alpha + tl.sum(p, axis=1)
        v = _load_rows(V, b, kv_head, start, n, sv_b, sv_h, sv_n, head_dim, BN, D, MASKED, EVEN_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
    return acc, total, running_max


@triton.jit
def _forward(
    Q, K, V, G, DOCS, OUT, LSE,
    n, n_q, offset, heads, kv_heads, rep, head_dim,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_n,
    qk_scale, gate_scale, window, sink,
    REP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, KP: tl.constexpr,
    GATE: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr,
    HW: tl.constexpr, EVEN_D: tl.constexpr,
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
    positions = p0 + row
    gq = _groups(G, b, positions, n, KP)
    first = _document_starts(DOCS, b, positions, n, HAS_DOCS)
    running_max = tl.full((REP * BM,), float("-inf"), tl.float32)
    total = tl.zeros((REP * BM,), tl.float32)
    acc = tl.zeros((REP * BM, D), tl.float32)
    begin, distant, band, end = _key_runs(DOCS, b, p0, n, window, sink, BM, BN, HAS_DOCS)
    # the first document's edge and the sinks, the wholly distant blocks, the band
    acc, total, running_max = _forward_run(
        acc, total, running_max, q, gq, positions, first, K, V, G, b, kv_head, begin, distant,
        n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, qk_scale, gate_scale, window, sink,
        BN, D, KP, GATE, True, HAS_DOCS, PRECISION, HW, EVEN_D,
    )  # fmt: skip
    acc, total, running_max = _forward_run(
        acc, total, running_max, q, gq, positions, first, K, V, G, b, kv_head, distant, band,
        n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, qk_scale, gate_scale, window, sink,
        BN, D, KP, GATE, False, HAS_DOCS, PRECISION, HW, EVEN_D,
    )  # fmt: skip
    acc, total, running_max = _forward_run(
        acc, total, running_max, q, gq, positions, first, K, V, G, b, kv_head, band, end,
        n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, qk_scale, gate_scale, window, sink,
        BN, D, KP, GATE, True, HAS_DOCS, PRECISION, HW, EVEN_D,
    )  # fmt: skip
    total = tl.where(total == 0.0, 1.0, total)
    o_at, o_ok = _stacked_tile(
        OUT, b, kv_head * rep, m0, so_b, so_h, so_n, head, row, ok, head_dim, D
    )
    tl.store(o_at, (acc / total[:, None]).to(OUT.dtype.element_ty), mask=o_ok)
    lse_at = _base(LSE, b, kv_head * rep, m0, heads * n_q, n_q, 1) + head * n_q + row
    tl.store(lse_at, running_max + tl.log2(total), mask=ok)  # base 2


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
def _weights(raw, bias, factor, lse, causal, qk_scale, LSE_ROWS: tl.constexpr,
             MASKED: tl.constexpr, GATE: tl.constexpr):  # fmt: skip
    """(the softmax weights P, the ungated ones P_raw (FAST_LOG; else P)) of a tile, from the
    rows' log-sum-exp (base 2) along axis 0 (`LSE_ROWS`: [rows, keys]) or axis 1 ([keys,
    rows])."""
    scores = _scores(raw, bias, factor, causal, qk_scale, MASKED, GATE)
    if LSE_ROWS:
        ungated = tl.exp2(scores - lse[:, None])
    else:
        ungated = tl.exp2(scores - lse[None, :])
    if GATE == 0:
        return ungated * factor, ungated
    return ungated, ungated


@triton.jit
def _gate_grad(dgate, a, factor, distant, gate_scale, MASKED: tl.constexpr, GATE: tl.constexpr,
               HW: tl.constexpr):  # fmt: skip
    """d affinity from the tile's gate gradient (summed over heads): FAST_LOG's is already
    dA = P_raw (dP - delta) (its factor, max(a, TINY), tells the floor, so `a` need not stay
    live); LOG's is d bias, times lambda / a; SIGMOID's d factor, times the sigmoid's slope."""
    if GATE == 0:
        da = tl.where(factor > TINY, dgate, 0.0)
    elif GATE == 1:
        da = tl.where(a > TINY, _div(dgate * gate_scale, tl.maximum(a, TINY), HW), 0.0)
    else:
        factor = tl.sigmoid(gate_scale * a)
        da = dgate * gate_scale * factor * (1.0 - factor)
    if MASKED:
        da = tl.where(distant, da, 0.0)
    return da


@triton.jit
def _keys_run(
    dk, dv, dg_k, k, v, gk, cols, Q, G, DOCS, DO, LSE, DELTA, b, kv_head, rep, start_at, stop_at,
    n, n_q, offset, heads, head_dim, sq_b, sq_h, sq_n, sd_b, sd_h, sd_n, qk_scale, scale,
    gate_scale, window, sink, BM: tl.constexpr, D: tl.constexpr, KP: tl.constexpr,
    GATE: tl.constexpr, MASKED: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr,
    HW: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """dK, dV and the key side of dg of one key block over query blocks start_at .. stop_at
    (rows of the chunk); tiles [keys, queries], as FlashAttention-2's."""
    for m0 in range(start_at, stop_at, BM):
        positions = offset + m0 + tl.arange(0, BM)
        gq = _groups(G, b, positions, n, KP, MASKED)
        a = tl.dot(gk, tl.trans(gq), input_precision=PRECISION)  # [keys, queries]
        causal = cols[:, None] < n  # placeholders where no mask is needed
        distant = causal
        if MASKED:
            first = _document_starts(DOCS, b, positions, n, HAS_DOCS)
            causal, distant = _pairs(positions[None, :], cols[:, None], first[None, :], window,
                                     sink, HAS_DOCS)  # fmt: skip
        bias, factor = _gate_terms(a, distant, gate_scale, MASKED, GATE, HW)
        dgate = tl.zeros(a.shape, tl.float32)
        for r in range(rep):
            head = kv_head * rep + r
            q = _load_rows(Q, b, head, m0, n_q, sq_b, sq_h, sq_n, head_dim, BM, D, MASKED,
                           EVEN_D)  # fmt: skip
            do = _load_rows(DO, b, head, m0, n_q, sd_b, sd_h, sd_n, head_dim, BM, D, MASKED,
                            EVEN_D)  # fmt: skip
            stats = _base(LSE, b, head, m0, heads * n_q, n_q, 1) + tl.arange(0, BM)
            deltas = _base(DELTA, b, head, m0, heads * n_q, n_q, 1) + tl.arange(0, BM)
            if MASKED:
                row_ok = m0 + tl.arange(0, BM) < n_q
                lse = tl.load(stats, mask=row_ok, other=0.0)
                delta = tl.load(deltas, mask=row_ok, other=0.0)
            else:
                lse = tl.load(stats)
                delta = tl.load(deltas)
            raw = tl.dot(k, tl.trans(q), input_precision=PRECISION)
            p, ungated = _weights(raw, bias, factor, lse, causal, qk_scale, False, MASKED, GATE)
            dv += tl.dot(p.to(do.dtype), do, input_precision=PRECISION)
            grad = tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :]
            if GATE == 0:
                dungated = ungated * grad  # = dS / factor: dA at lambda 1
                dscores = dungated * factor
                dgate += dungated
                draw = dscores
            elif GATE == 1:
                dscores = p * grad
                dgate += dscores
                draw = dscores
            else:
                dscores = p * grad
                dgate += dscores * (raw * scale)
                draw = dscores * factor
            dk += tl.dot(draw.to(q.dtype), q, input_precision=PRECISION)
        da = _gate_grad(dgate, a, factor, distant, gate_scale, MASKED, GATE, HW)
        dg_k += tl.dot(da.to(gq.dtype), gq, input_precision=PRECISION)
    return dk, dv, dg_k


@triton.jit(do_not_specialize=["rep"])  # one head a key/value head: the same loop
def _backward_keys(
    Q, K, V, G, DOCS, BOUNDS, DO, LSE, DELTA, DK, DV, DG_K,
    n, n_q, offset, heads, kv_heads, rep, head_dim,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sd_b, sd_h, sd_n, sg_b, sg_h, sg_n,
    qk_scale, scale, gate_scale, window, sink,
    BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, KP: tl.constexpr,
    GATE: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr,
    HW: tl.constexpr, EVEN_D: tl.constexpr,
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
    v_at, _ = _rows_tile(V, b, kv_head, n0, n, sv_b, sv_h, sv_n, head_dim, BN, D)
    k = tl.load(k_at, mask=kv_ok, other=0.0)
    v = tl.load(v_at, mask=kv_ok, other=0.0)
    cols = n0 + tl.arange(0, BN)
    gk = _groups(G, b, cols, n, KP)
    dk = tl.zeros((BN, D), tl.float32)
    dv = tl.zeros((BN, D), tl.float32)
    dg_k = tl.zeros((BN, KP), tl.float32)
    end = n_q
    free_end = n_q
    if HAS_DOCS:  # (one past the last row that reads the block, the first whose sinks pass it)
        bound = _base(BOUNDS, b, 0, tl.program_id(0), 2 * tl.num_programs(0), 0, 2)
        end = tl.load(bound)
        free_end = tl.load(bound + 1)
    begin, distant, band = _query_runs(n0, n_q, offset, window, sink, end, free_end, BM, BN,
                                       HAS_DOCS)  # fmt: skip
    # the band and the diagonal, the wholly distant blocks, the rest (the last partial block,
    # other documents' edges)
    dk, dv, dg_k = _keys_run(
        dk, dv, dg_k, k, v, gk, cols, Q, G, DOCS, DO, LSE, DELTA, b, kv_head, rep, begin,
        distant, n, n_q, offset, heads, head_dim, sq_b, sq_h, sq_n, sd_b, sd_h, sd_n, qk_scale,
        scale, gate_scale, window, sink, BM, D, KP, GATE, True, HAS_DOCS, PRECISION, HW, EVEN_D,
    )  # fmt: skip
    dk, dv, dg_k = _keys_run(
        dk, dv, dg_k, k, v, gk, cols, Q, G, DOCS, DO, LSE, DELTA, b, kv_head, rep, distant,
        band, n, n_q, offset, heads, head_dim, sq_b, sq_h, sq_n, sd_b, sd_h, sd_n, qk_scale,
        scale, gate_scale, window, sink, BM, D, KP, GATE, False, HAS_DOCS, PRECISION, HW, EVEN_D,
    )  # fmt: skip
    dk, dv, dg_k = _keys_run(
        dk, dv, dg_k, k, v, gk, cols, Q, G, DOCS, DO, LSE, DELTA, b, kv_head, rep, band,
        end, n, n_q, offset, heads, head_dim, sq_b, sq_h, sq_n, sd_b, sd_h, sd_n, qk_scale,
        scale, gate_scale, window, sink, BM, D, KP, GATE, True, HAS_DOCS, PRECISION, HW, EVEN_D,
    )  # fmt: skip
    dk_at, dk_ok = _rows_tile(DK, b, kv_head, n0, n, sg_b, sg_h, sg_n, head_dim, BN, D)
    dv_at, dv_ok = _rows_tile(DV, b, kv_head, n0, n, sg_b, sg_h, sg_n, head_dim, BN, D)
    tl.store(dk_at, (dk * scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(dv_at, dv.to(DV.dtype.element_ty), mask=kv_ok)
    _store_dg(DG_K, dg_k, b, kv_head, kv_heads, n0 + tl.arange(0, BN), n, KP)


@triton.jit
def _store_dg(DG, dg, b, head, heads, rows, n, KP: tl.constexpr):
    """Rows `rows` of a [b, heads, n, KP] float32 dg."""
    at = _base(DG, b, head, 0, heads * n * KP, n * KP, 0)
    tl.store(at + rows[:, None] * KP + tl.arange(0, KP)[None, :], dg, mask=rows[:, None] < n)


@triton.jit
def _queries_run(
    dq, dg_q, q, do, lse, delta, gq, positions, first, ok, K, V, G, b, kv_head, start_at,
    stop_at, n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, qk_scale, scale, gate_scale,
    window, sink, BN: tl.constexpr, D: tl.constexpr, KP: tl.constexpr, GATE: tl.constexpr,
    MASKED: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr, HW: tl.constexpr,
    EVEN_D: tl.constexpr,
):  # fmt: skip
    """dQ and the query side of dg (per stacked row) over key blocks start_at .. stop_at."""
    for start in range(start_at, stop_at, BN):
        k = _load_rows(K, b, kv_head, start, n, sk_b, sk_h, sk_n, head_dim, BN, D, MASKED, EVEN_D)
        v = _load_rows(V, b, kv_head, start, n, sv_b, sv_h, sv_n, head_dim, BN, D, MASKED, EVEN_D)
        cols = start + tl.arange(0, BN)
        gk = _groups(G, b, cols, n, KP, MASKED)
        a = tl.dot(gq, tl.trans(gk), input_precision=PRECISION)
        causal = ok[:, None]  # placeholders where no mask is needed
        distant = causal
        if MASKED:
            causal, distant = _pairs(positions[:, None], cols[None, :], first[:, None], window,
                                     sink, HAS_DOCS)  # fmt: skip
        bias, factor = _gate_terms(a, distant, gate_scale, MASKED, GATE, HW)
        raw = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        p, ungated = _weights(raw, bias, factor, lse, causal, qk_scale, True, MASKED, GATE)
        grad = tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None]
        if GATE == 0:
            dgate = ungated * grad
            draw = dgate * factor
        elif GATE == 1:
            dgate = p * grad
            draw = dgate
        else:
            draw = p * grad
            dgate = draw * (raw * scale)
            draw = draw * factor
        dq += tl.dot(draw.to(k.dtype), k, input_precision=PRECISION)
        da = _gate_grad(dgate, a, factor, distant, gate_scale, MASKED, GATE, HW)
        dg_q += tl.dot(da.to(gk.dtype), gk, input_precision=PRECISION)
    return dq, dg_q


@triton.jit
def _backward_queries(
    Q, K, V, G, DOCS, DO, LSE, DELTA, DQ, DG_Q,
    n, n_q, offset, heads, kv_heads, rep, head_dim,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sd_b, sd_h, sd_n, so_b, so_h, so_n,
    qk_scale, scale, gate_scale, window, sink,
    REP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, KP: tl.constexpr,
    GATE: tl.constexpr, HAS_DOCS: tl.constexpr, PRECISION: tl.constexpr, CHUNK: tl.constexpr,
    HW: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """dQ and the query side of dg for one query block, over its causal key blocks (so_*: DQ's
    strides); dg per query head ([b, heads, n_q, KP], summed outside)."""
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
    do_at, _ = _stacked_tile(DO, b, kv_head * rep, m0, sd_b, sd_h, sd_n, head, row, ok, head_dim, D)
    q = tl.load(q_at, mask=q_ok, other=0.0)
    do = tl.load(do_at, mask=q_ok, other=0.0)
    stats = _base(LSE, b, kv_head * rep, m0, heads * n_q, n_q, 1) + head * n_q + row
    lse = tl.load(stats, mask=ok, other=0.0)
    delta = tl.load(_base(DELTA, b, kv_head * rep, m0, heads * n_q, n_q, 1) + head * n_q + row,
                    mask=ok, other=0.0)  # fmt: skip
    positions = p0 + row
    gq = _groups(G, b, positions, n, KP)
    first = _document_starts(DOCS, b, positions, n, HAS_DOCS)
    dq = tl.zeros((REP * BM, D), tl.float32)
    dg_q = tl.zeros((REP * BM, KP), tl.float32)
    begin, distant, band, end = _key_runs(DOCS, b, p0, n, window, sink, BM, BN, HAS_DOCS)
    dq, dg_q = _queries_run(
        dq, dg_q, q, do, lse, delta, gq, positions, first, ok, K, V, G, b, kv_head, begin,
        distant, n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, qk_scale, scale, gate_scale,
        window, sink, BN, D, KP, GATE, True, HAS_DOCS, PRECISION, HW, EVEN_D,
    )  # fmt: skip
    dq, dg_q = _queries_run(
        dq, dg_q, q, do, lse, delta, gq, positions, first, ok, K, V, G, b, kv_head, distant,
        band, n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, qk_scale, scale, gate_scale,
        window, sink, BN, D, KP, GATE, False, HAS_DOCS, PRECISION, HW, EVEN_D,
    )  # fmt: skip
    dq, dg_q = _queries_run(
        dq, dg_q, q, do, lse, delta, gq, positions, first, ok, K, V, G, b, kv_head, band,
        end, n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, qk_scale, scale, gate_scale,
        window, sink, BN, D, KP, GATE, True, HAS_DOCS, PRECISION, HW, EVEN_D,
    )  # fmt: skip
    dq_at, dq_ok = _stacked_tile(
        DQ, b, kv_head * rep, m0, so_b, so_h, so_n, head, row, ok, head_dim, D
    )
    tl.store(dq_at, (dq * scale).to(DQ.dtype.element_ty), mask=q_ok)
    dg_at = _base(DG_Q, b, kv_head * rep, m0, heads * n_q * KP, n_q * KP, KP)
    dg_at += (head * n_q * KP + row * KP)[:, None] + tl.arange(0, KP)[None, :]
    tl.store(dg_at, dg_q, mask=ok[:, None])


def _strides(t: torch.Tensor) -> tuple:
    return t.stride(0), t.stride(1), t.stride(2)


def gate_form(gate: str, gate_scale: float, dtype: torch.dtype) -> int:
    """The kernels' GATE: the log gate at lambda 1 without a logarithm, where the weights' range
    allows it (bf16, fp32: float16's would underflow, see the module's docstring)."""
    if gate == "sigmoid":
        return SIGMOID
    return FAST_LOG if gate_scale == 1.0 and dtype != torch.float16 else LOG


def padded_groups(log_g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The assignments g = exp(log_g) [b, n, K] as the kernels read them: [b, n, 16] in the
    attention's dtype, zero past K."""
    groups = log_g.shape[-1]
    width = max(GROUPS_PADDED, triton.next_power_of_2(groups))
    g = torch.nn.functional.pad(log_g.detach().float().exp(), (0, width - groups))
    return g.to(dtype).contiguous()


class Plan:
    """The launches of one soft-gate call, forward and backward, from its inputs' shapes,
    strides and dtypes and the GPU's compute capability (None: Triton's interpreter); the fit
    test builds it on meta tensors for each architecture. `g` is `padded_groups`'s."""

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
        self.heads, self.rep = heads, heads // self.kv_heads
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
        self.sizes = (n, n_q, offset, heads, self.kv_heads, self.rep, head_dim)
        self.qk_scale = float(scale) * math.log2(math.e)
        self.scale, self.gate_scale, self.window, self.sink = (
            float(scale),
            float(gate_scale),
            int(window),
            int(sink),
        )
        self.dims = dict(D=triton_launch.padded(head_dim), KP=g.shape[-1])
        self.flags = dict(
            GATE=gate_form(gate, float(gate_scale), q.dtype),
            HAS_DOCS=doc_start is not None,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            CHUNK=offset > 0,
            HW=q.device.type != "cpu",  # compiled (CPU tensors: the interpreter)
            EVEN_D=triton_launch.padded(head_dim) == head_dim,
        )
        self.docs = doc_start

    def _stacking(self, tile):
        """REP, BM: the query heads sharing a key/value head stacked on `tile.rows` rows (so a
        tile's registers do not grow with GQA; fewer queries a block as more heads share)."""
        rep = triton.next_power_of_2(self.rep)
        return dict(REP=rep, BM=max(1, tile.rows // rep))

    def _launch(self, kernel, pass_, grid_rows, tensors, strides, scalars, constants):
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
            (*tensors, *self.sizes, *(s for _, t in strides for s in _strides(t)), *scalars),
            dict(**constants, **self.dims, **self.flags),
            dict(num_warps=tile.warps, num_stages=tile.stages),
        )

    def forward(self, q, k, v, g, docs, out, lse) -> Launch:
        tile = self.tiles["forward"]
        constants = dict(**self._stacking(tile), BN=tile.keys)
        strides = (("q", q), ("k", k), ("v", v), ("out", out))
        scalars = (self.qk_scale, self.gate_scale, self.window, self.sink)
        return self._launch(
            _forward, "forward", constants["BM"], (q, k, v, g, docs, out, lse), strides, scalars,
            constants,
        )  # fmt: skip

    def delta(self, out, grad_out, delta) -> Launch:
        tile = self.tiles["queries"]
        heads, head_dim = self.heads, self.sizes[-1]
        return Launch(
            _delta,
            (triton.cdiv(self.n_q, tile.rows), self.b * heads),
            (out, grad_out, delta, self.n_q, heads, head_dim, *_strides(out), *_strides(grad_out)),
            dict(BM=tile.rows, D=self.dims["D"]),
            dict(num_warps=tile.warps),
        )

    def _backward_scalars(self):
        return (self.qk_scale, self.scale, self.gate_scale, self.window, self.sink)

    def keys(self, q, k, v, g, docs, bounds, grad_out, lse, delta, dk, dv, dg_k) -> Launch:
        tile = self.tiles["keys"]
        constants = dict(BM=tile.rows, BN=tile.keys)
        strides = (("q", q), ("k", k), ("v", v), ("grad", grad_out), ("dk", dk))
        return self._launch(
            _backward_keys,
            "keys",
            tile.keys,
            (q, k, v, g, docs, bounds, grad_out, lse, delta, dk, dv, dg_k),
            strides,
            self._backward_scalars(),
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
            self._backward_scalars(),
            constants,
        )

    def key_bounds(self, doc_start: torch.Tensor) -> torch.Tensor:
        """Per sequence and key block of the keys pass, in the chunk's query rows: one past the
        last row that reads a key of the block (its document starts at or before the block's
        last key), and the first row whose document start and sinks pass the block's first key
        (none of the rows from there on has the whole block distant): [b, blocks, 2] int32
        (starts are nondecreasing)."""
        block = self.tiles["keys"].keys
        firsts = torch.arange(0, triton.cdiv(self.n, block), device=doc_start.device) * block
        lasts = torch.clamp(firsts + block, max=self.n) - 1
        bounds = [
            torch.searchsorted(doc_start.contiguous(), keys.expand(self.b, -1).contiguous(),
                               right=True)
            for keys in (lasts, firsts - self.sink)
        ]  # fmt: skip
        return (torch.stack(bounds, -1) - self.offset).clamp(0, self.n_q).to(torch.int32)

    def launches(self, q, k, v, g, docs):
        """Every launch of a forward and backward, on fresh outputs (the fit test's list)."""
        out, lse, dq, dk, dv, dg_q, dg_k, delta = _outputs(q, k, g)
        bounds = self.key_bounds(self.docs) if self.docs is not None else g
        return [
            self.forward(q, k, v, g, docs, out, lse),
            self.delta(out, out, delta),
            self.keys(q, k, v, g, docs, bounds, out, lse, delta, dk, dv, dg_k),
            self.queries(q, k, v, g, docs, out, lse, delta, dq, dg_q),
        ]


def _outputs(q, k, g):
    """out, lse, dq, dk, dv, dg_q, dg_k, delta for inputs q, k and assignments g (dg_q per query
    head of the queries' rows, dg_k per key/value head of the keys')."""
    b, heads, n_q, _ = q.shape
    kv_heads, n = k.shape[1:3]
    rows = torch.empty(b, heads, n_q, device=q.device, dtype=torch.float32)
    dg_q, dg_k = (
        torch.empty(b, h, m, g.shape[-1], device=g.device, dtype=torch.float32)
        for h, m in ((heads, n_q), (kv_heads, n))
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
        q, k, v = (triton_launch.last_dim_contiguous(t) for t in (q, k, v))
        g = padded_groups(log_g, q.dtype)
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
        ctx.save_for_backward(q, k, v, log_g, g, docs, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, log_g, g, docs, out, lse = ctx.saved_tensors
        plan = ctx.plan
        grad_out = triton_launch.last_dim_contiguous(grad_out)
        _, _, dq, dk, dv, dg_q, dg_k, delta = _outputs(q, k, g)
        plan.delta(out, grad_out, delta)()
        bounds = plan.key_bounds(plan.docs) if plan.docs is not None else g
        plan.keys(q, k, v, g, docs, bounds, grad_out, lse, delta, dk, dv, dg_k)()
        plan.queries(q, k, v, g, docs, grad_out, lse, delta, dq, dg_q)()
        groups = log_g.shape[-1]
        dlog_g = dg_k.sum(1)[..., :groups]
        dlog_g[:, plan.offset :] += dg_q.sum(1)[..., :groups]
        dlog_g *= log_g.float().exp()
        return (dq, dk, dv, dlog_g.to(log_g.dtype)) + (None,) * 7


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
