"""Sparse Focus's attention parts as one Triton kernel, forward and backward: queries against key
ranges, rows read and written through the routing's permutations inside the kernel.

Every part of the hard rule (focus_sparse.py) is the same computation: queries, taken in an
order where their key ranges rise, each against the keys [lo, hi) of a key order, optionally
less the keys of the query's own groups. The window band is token order against token order
(lo: the window's or the document's first key, hi: the query itself; its keys in one of the
query's groups excluded, those are in a bucket); each top-k slot and the sinks are their queries
against ranges of the bucket order. So one kernel serves them all:

* no gathered copies and no scatter: a program reads its query rows through the part's query
  order (`ENTRIES`) and its key rows through the key order (`ORDER`), from q, k, v laid out as
  the model hands them ([b, heads, n, d], its strides whole rows of d: `addressable`), and
  writes to token rows;
* the parts are merged in each launch's epilogue: the first launch (the band, which covers
  every row) writes the rows' normalised output and log-sum-exp, each later one merges its own
  into them by log-sum-exp weights (lse_merge.py's rule) in registers, one read and write of a
  float32 row per part;
* a query block walks the key tiles from its first query's lo to its last query's hi (ranges
  rise, so that is all of them), with masks only on the tiles at the edges: the tiles inside
  every query's range are loaded and computed without one;
* a query's groups and a key's top-1 group are bit masks (one AND a pair decides the band's
  exclusion);
* backward: delta = rowsum(dO * O) in torch, then per part one pass per key block for dK and dV
  (the queries that read a key block are one contiguous run of the part's order, found by
  searchsorted on its rising lo and hi; the heads sharing a key/value head one after another)
  and one per query block for dQ, each accumulated in registers and added to a float32 row
  once a part: no atomics, deterministic.

Top-k > 1 is one launch per slot, each query's key range in that slot's bucket; sinks one more.
Each slot takes its own query order, so a query block's ranges lie side by side in one bucket
and its tiles are its own queries' keys. One launch for every slot (a block index per query
block, as NSA's selection) would keep one query order: a block that shares its top-1 group
spreads its second choices over the other groups, and each of their tiles would be computed
for the whole block, a few of whose queries keep it. The launches' host cost is what a CUDA
graph removes (focus_sparse, graphs.py).

Under TRITON_INTERPRET=1 the kernels run on CPU tensors (the tests check them against the float64
dense hard rule); on a GPU they compile with the tiles of triton_launch.sparse_tile.
"""

import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from megatron_focus.model.kernels import triton_launch
from megatron_focus.model.kernels.triton_launch import Launch

# BAND, a part's kind: 0 a bucket part (its ranges given); in token order, its ranges computed:
# the window band, or the whole hard rule as one part (`Part.rule`)
BAND_PART, WHOLE_RULE = tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _quotient(x, n):
    """x // n for 0 <= x < 2^31 and 1 <= n < 2^31, as one multiply (Granlund and Montgomery's
    magic number for 31-bit dividends: m = ceil(2^(31 + l) / n), l = ceil(log2 n), then
    x // n = (2x * m) >> (32 + l)), where a division is a long routine a key row. The magic
    number depends on n alone: computed once, outside the loops."""
    exponent = tl.cast((n - 1).to(tl.float64), tl.int64, bitcast=True) >> 52  # exact: n < 2^53
    shift = tl.where(n == 1, 0, exponent - 1022).to(tl.int32)  # l: the bit length of n - 1
    magic = (((tl.full((), 1, tl.int64) << (31 + shift)) + n - 1) // n).to(tl.uint32)
    return (tl.umulhi((x << 1).to(tl.uint32), magic) >> shift).to(tl.int32)


@triton.jit
def _row_base(X, rows, head, n, s_b, s_h, s_n, head_dim, NARROW: tl.constexpr):
    """Pointers to element (row // n, head, row % n, 0) of a [b, heads, n, d] tensor, for token
    rows `rows` (b * n of them); s_b and s_n count rows of head_dim elements (`_strides`).
    NARROW: the row's place as a 32-bit index times the head dim in one widening multiply,
    where 64-bit products of sequence and position by their strides cost three times the
    instructions (the dK/dV pass, at the register file's edge, keeps the products: its rows'
    cost is spread over 128 keys, and the narrow index spills in its loop under Triton 3.6)."""
    sequence = _quotient(rows, n)
    position = rows - sequence * n
    if NARROW:
        index = sequence * s_b + position * s_n  # < 2^31: `addressable`
        wide = index.to(tl.uint32).to(tl.uint64) * head_dim.to(tl.uint32).to(tl.uint64)
        return X + wide.to(tl.int64) + tl.cast(head, tl.int64) * s_h
    w = tl.int64
    sequence_step = sequence.to(w) * (s_b * tl.cast(head_dim, w))
    position_step = position.to(w) * (s_n * tl.cast(head_dim, w))
    return X + sequence_step + tl.cast(head, w) * s_h + position_step


@triton.jit
def _tile_at(X, rows, ok, head, n, s_b, s_h, s_n, head_dim, D: tl.constexpr,
             NARROW: tl.constexpr = True):  # fmt: skip
    """(pointers, mask) of the [rows, D] tile of one head of a [b, heads, n, d] tensor."""
    dims = tl.arange(0, D)
    at = _row_base(X, rows, head, n, s_b, s_h, s_n, head_dim, NARROW)[:, None] + dims[None, :]
    return at, ok[:, None] & (dims[None, :] < head_dim)


@triton.jit
def _load_tile(X, rows, ok, head, n, s_b, s_h, s_n, head_dim, D: tl.constexpr,
               MASKED: tl.constexpr, EVEN_D: tl.constexpr,
               NARROW: tl.constexpr = True):  # fmt: skip
    at, mask = _tile_at(X, rows, ok, head, n, s_b, s_h, s_n, head_dim, D, NARROW)
    if MASKED or not EVEN_D:
        return tl.load(at, mask=mask, other=0.0)
    return tl.load(at)


@triton.jit
def _indices(INDEX, at, ok, IDENTITY: tl.constexpr, MASKED: tl.constexpr = True):
    """INDEX[at] (a part's order), or `at` itself where the order is the identity."""
    if IDENTITY:
        return at
    if MASKED:
        return tl.load(INDEX + at.to(tl.int64), mask=ok, other=0).to(tl.int32)
    return tl.load(INDEX + at.to(tl.int64)).to(tl.int32)


@triton.jit
def _ranges(LO, HI, DOCS, at, ok, n, window, BAND: tl.constexpr, HAS_DOCS: tl.constexpr,
            DIVIDE: tl.constexpr = False):  # fmt: skip
    """[lo, hi) of the part's queries `at`: in token order computed (to the query itself, from
    the window's or the document's first key in the band, from the document's first under
    the whole rule), the others' loaded. DIVIDE: the queries' sequences by a division, not
    `_quotient` (the dK/dV pass's binary searches and loop, a block of queries a step, so
    little to save: there the magic number's registers made the band's launch spill inside its
    loop on sm_80 under Triton 3.6)."""
    if BAND:
        sequence = at // n if DIVIDE else _quotient(at, n)
        position = at - sequence * n
        first = position * 0
        if BAND == BAND_PART:
            first = tl.maximum(position - window + 1, 0)
        if HAS_DOCS:
            start = tl.load(DOCS + at.to(tl.int64), mask=ok, other=0).to(tl.int32)
            first = tl.maximum(first, start)
        return sequence * n + first, at + 1
    wide = at.to(tl.int64)
    lo = tl.load(LO + wide, mask=ok, other=0).to(tl.int32)
    return lo, tl.load(HI + wide, mask=ok, other=0).to(tl.int32)


@triton.jit
def _first_past(LO, HI, DOCS, count, n, window, target, OF_HI: tl.constexpr,
                BAND: tl.constexpr, HAS_DOCS: tl.constexpr):  # fmt: skip
    """The first of the part's queries whose hi (OF_HI) or lo passes `target` (both rise along
    the part's order; `count` if none): a binary search, a scalar a step."""
    low = tl.cast(0, tl.int32)
    high = tl.cast(count, tl.int32)
    while low < high:
        mid = (low + high) // 2
        lo, hi = _ranges(LO, HI, DOCS, mid, True, n, window, BAND, HAS_DOCS, True)
        past = (hi if OF_HI else lo) > target
        high = tl.where(past, mid, high)
        low = tl.where(past, low, mid + 1)
    return low


@triton.jit
def _kept(cols, lo, hi, key_bits, query_bits, window, BAND: tl.constexpr,
          KEYS_FIRST: tl.constexpr):  # fmt: skip
    """Which pairs of a tile are in their query's range: [queries, keys], or [keys, queries]
    for the keys pass. In the band, less the keys of one of the query's groups; under the
    whole rule, only those and the window's (the query is hi - 1: token order)."""
    if KEYS_FIRST:
        keep = (cols[:, None] >= lo[None, :]) & (cols[:, None] < hi[None, :])
        shared = (key_bits[:, None] & query_bits[None, :]) != 0
        near = hi[None, :] - 1 - cols[:, None] < window
    else:
        keep = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        shared = (query_bits[:, None] & key_bits[None, :]) != 0
        near = hi[:, None] - 1 - cols[None, :] < window
    if BAND == BAND_PART:
        keep = keep & ~shared
    elif BAND == WHOLE_RULE:
        keep = keep & (shared | near)
    return keep


@triton.jit
def _bits(BITS, rows, ok, side, EXCLUDE: tl.constexpr):
    """The group bit masks of `rows` (the band's exclusion; a placeholder elsewhere): BITS
    [2, rows], `side` 0 for the queries' (their groups), the rows' count for the keys' (their
    top-1 group)."""
    bits = rows.to(tl.int64)
    if EXCLUDE:
        bits = tl.load(BITS + (bits + side), mask=ok, other=0)
    return bits


@triton.jit
def _forward_run(acc, total, running_max, q, lo, hi, query_bits, K, V, ORDER, BITS, kv_head,
                 start_at, stop_at, key_end, key_side, window, n, head_dim, sk_b, sk_h, sk_n, sv_b,
                 sv_h, sv_n, qk_scale, BN: tl.constexpr, D: tl.constexpr, IDENTITY_K: tl.constexpr,
                 BAND: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
                 EVEN_D: tl.constexpr):  # fmt: skip
    """The online softmax over the key tiles start_at .. stop_at of the key order (with masks,
    or tiles inside every query's range without)."""
    for start in range(start_at, stop_at, BN):
        cols = start + tl.arange(0, BN)
        col_ok = cols < key_end
        key_rows = _indices(ORDER, cols, col_ok, IDENTITY_K, MASKED)
        k = _load_tile(K, key_rows, col_ok, kv_head, n, sk_b, sk_h, sk_n, head_dim, D, MASKED,
                       EVEN_D)  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # scaled in the exp2's FMA
        if MASKED:
            key_bits = _bits(BITS, key_rows, col_ok, key_side, BAND)
            keep = _kept(cols, lo, hi, key_bits, query_bits, window, BAND, False)
            scores = tl.where(keep, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1) * qk_scale)
        shift = new_max
        if MASKED:
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no key yet: all zero
        p = tl.exp2(scores * qk_scale - shift[:, None])
        alpha = tl.exp2(running_max - shift)
        total = total * alpha + tl.sum(p, axis=1)
        v = _load_tile(V, key_rows, col_ok, kv_head, n, sv_b, sv_h, sv_n, head_dim, D, MASKED,
                       EVEN_D)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
    return acc, total, running_max


@triton.jit
def _block_ranges(LO, HI, DOCS, e0, count, n, window, BM: tl.constexpr, BN: tl.constexpr,
                  BAND: tl.constexpr, HAS_DOCS: tl.constexpr):  # fmt: skip
    """For the queries e0 .. e0 + BM of a part: the starts of its three runs of key tiles,
    (start, inner, outer, end): [start, inner) and [outer, end) with masks, [inner, outer)
    tiles inside every query's range (none in the band, whose groups are excluded)."""
    last = tl.minimum(e0 + BM, count) - 1
    lo_first, hi_first = _ranges(LO, HI, DOCS, e0, True, n, window, BAND, HAS_DOCS)
    lo_last, end = _ranges(LO, HI, DOCS, last, True, n, window, BAND, HAS_DOCS)
    start = (lo_first // BN) * BN
    inner = tl.maximum(tl.cdiv(lo_last, BN) * BN, start)
    outer = tl.maximum((hi_first // BN) * BN, inner)
    if BAND:
        inner = start
        outer = start
    return start, inner, outer, end


@triton.jit
def _write_rows(ACC, LSE_ACC, OUT, so_b, so_h, so_n, out, lse, rows, ok, head, heads, n,
                head_dim, D: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
                ADD: tl.constexpr):  # fmt: skip
    """A part's rows, merged with the parts' before (in the float32 accumulators [rows, heads,
    D] and [rows, heads]) by log-sum-exp weights, or added (`ADD`: gradients); the last part
    writes the result in OUT's dtype and layout ([b, heads, n, d])."""
    slot = rows.to(tl.int64) * heads + head
    at = ACC + slot[:, None] * D + tl.arange(0, D)[None, :]
    if not FIRST:
        before = tl.load(at, mask=ok[:, None], other=0.0)
        if ADD:
            out = before + out
        else:
            lse_before = tl.load(LSE_ACC + slot, mask=ok, other=float("-inf"))
            top = tl.maximum(lse_before, lse)
            top = tl.where(top == float("-inf"), 0.0, top)
            w_before = tl.exp2(lse_before - top)
            w_new = tl.exp2(lse - top)
            weight = w_before + w_new
            out = (before * w_before[:, None] + out * w_new[:, None]) / tl.where(
                weight == 0.0, 1.0, weight
            )[:, None]
            lse = tl.where(weight == 0.0, float("-inf"), top + tl.log2(weight))
    if not ADD:
        tl.store(LSE_ACC + slot, lse, mask=ok)
    if LAST:
        out_at, out_ok = _tile_at(OUT, rows, ok, head, n, so_b, so_h, so_n, head_dim, D)
        tl.store(out_at, out.to(OUT.dtype.element_ty), mask=out_ok)
    else:
        tl.store(at, out, mask=ok[:, None])


@triton.jit
def _query_block(Q, ENTRIES, LO, HI, DOCS, BITS, count, n, head_dim, window, sq_b, sq_h, sq_n,
                 BM: tl.constexpr, D: tl.constexpr, BAND: tl.constexpr,
                 HAS_DOCS: tl.constexpr, EVEN_D: tl.constexpr):  # fmt: skip
    """A query-major program's block: (its first entry, its query head, which entries are
    real, their token rows, their key ranges [lo, hi), their group bits, their q tile)."""
    e0 = tl.program_id(0) * BM
    head = tl.program_id(1)
    at = e0 + tl.arange(0, BM)
    ok = at < count
    rows = _indices(ENTRIES, at, ok, BAND)
    lo, hi = _ranges(LO, HI, DOCS, at, ok, n, window, BAND, HAS_DOCS)
    query_bits = _bits(BITS, rows, ok, 0, BAND)
    q = _load_tile(Q, rows, ok, head, n, sq_b, sq_h, sq_n, head_dim, D, True, EVEN_D)
    return e0, head, ok, rows, lo, hi, query_bits, q


@triton.jit
def _forward(
    Q, K, V, ENTRIES, LO, HI, ORDER, DOCS, BITS, ACC, LSE_ACC, OUT,
    count, n, heads, rep, head_dim, window,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_n, qk_scale,
    BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, BAND: tl.constexpr,
    HAS_DOCS: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr,
):  # fmt: skip
    """One part's queries e0 .. e0 + BM (of `count`, in the part's order) for one query head,
    merged with the parts' before (log-sum-exp in base 2)."""
    e0, head, ok, rows, lo, hi, query_bits, q = _query_block(
        Q, ENTRIES, LO, HI, DOCS, BITS, count, n, head_dim, window, sq_b, sq_h, sq_n, BM, D,
        BAND, HAS_DOCS, EVEN_D,
    )  # fmt: skip
    kv_head = head // rep
    running_max = tl.full((BM,), float("-inf"), tl.float32)
    total = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    start, inner, outer, end = _block_ranges(LO, HI, DOCS, e0, count, n, window, BM, BN, BAND,
                                             HAS_DOCS)  # fmt: skip
    acc, total, running_max = _forward_run(
        acc, total, running_max, q, lo, hi, query_bits, K, V, ORDER, BITS, kv_head, start,
        inner, end, count, window, n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, qk_scale, BN,
        D, BAND, BAND, True, PRECISION, EVEN_D,
    )  # fmt: skip
    acc, total, running_max = _forward_run(
        acc, total, running_max, q, lo, hi, query_bits, K, V, ORDER, BITS, kv_head, inner,
        outer, end, count, window, n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, qk_scale, BN,
        D, BAND, BAND, False, PRECISION, EVEN_D,
    )  # fmt: skip
    acc, total, running_max = _forward_run(
        acc, total, running_max, q, lo, hi, query_bits, K, V, ORDER, BITS, kv_head, outer,
        end, end, count, window, n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, qk_scale, BN, D,
        BAND, BAND, True, PRECISION, EVEN_D,
    )  # fmt: skip
    lse = tl.where(total == 0.0, float("-inf"), running_max + tl.log2(total))
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    _write_rows(ACC, LSE_ACC, OUT, so_b, so_h, so_n, out, lse, rows, ok, head, heads, n,
                head_dim, D, FIRST, LAST, False)  # fmt: skip


@triton.jit
def _queries_run(dq, q, do, lse, delta, lo, hi, query_bits, K, V, ORDER, BITS, kv_head, start_at,
                 stop_at, key_end, key_side, window, n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h,
                 sv_n, qk_scale, BN: tl.constexpr, D: tl.constexpr, BAND: tl.constexpr,
                 MASKED: tl.constexpr, PRECISION: tl.constexpr, EVEN_D: tl.constexpr):  # fmt: skip
    """dQ over the key tiles start_at .. stop_at (with masks, or inside every query's range)."""
    for start in range(start_at, stop_at, BN):
        cols = start + tl.arange(0, BN)
        col_ok = cols < key_end
        key_rows = _indices(ORDER, cols, col_ok, BAND, MASKED)
        k = _load_tile(K, key_rows, col_ok, kv_head, n, sk_b, sk_h, sk_n, head_dim, D, MASKED,
                       EVEN_D)  # fmt: skip
        v = _load_tile(V, key_rows, col_ok, kv_head, n, sv_b, sv_h, sv_n, head_dim, D, MASKED,
                       EVEN_D)  # fmt: skip
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            key_bits = _bits(BITS, key_rows, col_ok, key_side, BAND)
            keep = _kept(cols, lo, hi, key_bits, query_bits, window, BAND, False)
            scores = tl.where(keep, scores, float("-inf"))
        p = tl.exp2(scores * qk_scale - lse[:, None])
        grad = tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None]
        dq += tl.dot((p * grad).to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _backward_queries(
    Q, K, V, DO, OUT, ENTRIES, LO, HI, ORDER, DOCS, BITS, LSE, DELTA, ACC, DQ,
    count, n, heads, rep, head_dim, window,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sd_b, sd_h, sd_n, so_b, so_h, so_n,
    qk_scale, scale,
    BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, BAND: tl.constexpr,
    HAS_DOCS: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr,
):  # fmt: skip
    """dQ of one part's query block for one query head, added to the parts' before; LSE
    [rows, heads] is the merged output's, DELTA (rowsum(dO * O)) is written by the first
    part's launch and read by the others (so_*: OUT's strides, DQ's the same)."""
    e0, head, ok, rows, lo, hi, query_bits, q = _query_block(
        Q, ENTRIES, LO, HI, DOCS, BITS, count, n, head_dim, window, sq_b, sq_h, sq_n, BM, D,
        BAND, HAS_DOCS, EVEN_D,
    )  # fmt: skip
    kv_head = head // rep
    do = _load_tile(DO, rows, ok, head, n, sd_b, sd_h, sd_n, head_dim, D, True, EVEN_D)
    slot = rows.to(tl.int64) * heads + head
    lse = tl.load(LSE + slot, mask=ok, other=0.0)
    if FIRST:
        o = _load_tile(OUT, rows, ok, head, n, so_b, so_h, so_n, head_dim, D, True, EVEN_D)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        tl.store(DELTA + slot, delta, mask=ok)
    else:
        delta = tl.load(DELTA + slot, mask=ok, other=0.0)
    dq = tl.zeros((BM, D), tl.float32)
    start, inner, outer, end = _block_ranges(LO, HI, DOCS, e0, count, n, window, BM, BN, BAND,
                                             HAS_DOCS)  # fmt: skip
    dq = _queries_run(
        dq, q, do, lse, delta, lo, hi, query_bits, K, V, ORDER, BITS, kv_head, start, inner, end,
        count, window, n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, qk_scale, BN, D, BAND, True,
        PRECISION, EVEN_D,
    )  # fmt: skip
    dq = _queries_run(
        dq, q, do, lse, delta, lo, hi, query_bits, K, V, ORDER, BITS, kv_head, inner, outer, end,
        count, window, n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, qk_scale, BN, D, BAND,
        False, PRECISION, EVEN_D,
    )  # fmt: skip
    dq = _queries_run(
        dq, q, do, lse, delta, lo, hi, query_bits, K, V, ORDER, BITS, kv_head, outer, end, end,
        count, window, n, head_dim, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, qk_scale, BN, D, BAND, True,
        PRECISION, EVEN_D,
    )  # fmt: skip
    _write_rows(ACC, LSE, DQ, so_b, so_h, so_n, dq * scale, lse, rows, ok, head, heads, n,
                head_dim, D, FIRST, LAST, True)  # fmt: skip


@triton.jit
def _keys_run(dk, dv, k, v, cols, key_bits, Q, DO, ENTRIES, LO, HI, DOCS, BITS, LSE, DELTA,
              head, start_at, stop_at, first, stop, count, n, heads, head_dim, window, sq_b,
              sq_h, sq_n, sd_b, sd_h, sd_n, qk_scale, BM: tl.constexpr, D: tl.constexpr,
              BAND: tl.constexpr, HAS_DOCS: tl.constexpr, MASKED: tl.constexpr,
              PRECISION: tl.constexpr, EVEN_D: tl.constexpr):  # fmt: skip
    """dK and dV of one key block over the query blocks start_at .. stop_at of the part's
    order, for one query head; tiles [keys, queries], as FlashAttention-2's."""
    for e0 in range(start_at, stop_at, BM):
        at = e0 + tl.arange(0, BM)
        ok = (at >= first) & (at < stop)
        rows = _indices(ENTRIES, at, ok, BAND, MASKED)
        q = _load_tile(Q, rows, ok, head, n, sq_b, sq_h, sq_n, head_dim, D, MASKED, EVEN_D,
                       False)  # fmt: skip
        do = _load_tile(DO, rows, ok, head, n, sd_b, sd_h, sd_n, head_dim, D, MASKED, EVEN_D,
                        False)  # fmt: skip
        slot = rows.to(tl.int64) * heads + head
        if MASKED:
            lse = tl.load(LSE + slot, mask=ok, other=0.0)
            delta = tl.load(DELTA + slot, mask=ok, other=0.0)
        else:
            lse = tl.load(LSE + slot)
            delta = tl.load(DELTA + slot)
        scores = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse[None, :]
        if MASKED:
            lo, hi = _ranges(LO, HI, DOCS, at, ok, n, window, BAND, HAS_DOCS, True)
            query_bits = _bits(BITS, rows, ok, 0, BAND)
            keep = _kept(cols, lo, hi, key_bits, query_bits, window, BAND, True) & ok[None, :]
            scores = tl.where(keep, scores, float("-inf"))
        p = tl.exp2(scores)  # [keys, queries]
        dv += tl.dot(p.to(do.dtype), do, input_precision=PRECISION)
        grad = tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :]
        dk += tl.dot((p * grad).to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["rep"])
def _backward_keys(
    Q, K, V, DO, ENTRIES, LO, HI, ORDER, DOCS, BITS, LSE, DELTA, DK_ACC, DV_ACC, DK, DV,
    count, keys, n, heads, kv_heads, rep, head_dim, window,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sd_b, sd_h, sd_n, sg_b, sg_h, sg_n,
    qk_scale, scale,
    BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, BAND: tl.constexpr,
    HAS_DOCS: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr,
):  # fmt: skip
    """dK and dV of one key block (of the part's key order) for one key/value head, over the
    part's queries that read it: one run of the part's order, found by binary search, whose
    middle (the queries whose ranges hold the whole block) needs no mask; the heads sharing
    the key/value head one after another (sg_*: DK's and DV's strides)."""
    c0 = tl.program_id(0) * BN
    kv_head = tl.program_id(1)
    cols = c0 + tl.arange(0, BN)
    col_ok = cols < keys
    key_rows = _indices(ORDER, cols, col_ok, BAND)
    k = _load_tile(K, key_rows, col_ok, kv_head, n, sk_b, sk_h, sk_n, head_dim, D, True, EVEN_D)
    v = _load_tile(V, key_rows, col_ok, kv_head, n, sv_b, sv_h, sv_n, head_dim, D, True, EVEN_D)
    key_bits = _bits(BITS, key_rows, col_ok, keys, BAND)
    last = c0 + BN - 1
    first = _first_past(LO, HI, DOCS, count, n, window, c0, True, BAND, HAS_DOCS)
    stop = _first_past(LO, HI, DOCS, count, n, window, last, False, BAND, HAS_DOCS)
    # whole blocks of queries whose ranges all hold the key block: hi > last and lo <= c0
    base = (first // BM) * BM
    inner = tl.cdiv(_first_past(LO, HI, DOCS, count, n, window, last, True, BAND, HAS_DOCS)
                    - base, BM) * BM + base  # fmt: skip
    outer = _first_past(LO, HI, DOCS, count, n, window, c0, False, BAND, HAS_DOCS)
    outer = tl.maximum(((outer - inner) // BM) * BM + inner, inner)
    inner = tl.minimum(tl.maximum(inner, base), stop)
    outer = tl.minimum(outer, stop)
    if BAND:
        inner = stop
        outer = stop
    dk = tl.zeros((BN, D), tl.float32)
    dv = tl.zeros((BN, D), tl.float32)
    for r in range(rep):
        head = kv_head * rep + r
        dk, dv = _keys_run(
            dk, dv, k, v, cols, key_bits, Q, DO, ENTRIES, LO, HI, DOCS, BITS, LSE, DELTA, head,
            base, inner, first, stop, count, n, heads, head_dim, window, sq_b, sq_h, sq_n, sd_b,
            sd_h, sd_n, qk_scale, BM, D, BAND, HAS_DOCS, True, PRECISION, EVEN_D,
        )  # fmt: skip
        dk, dv = _keys_run(
            dk, dv, k, v, cols, key_bits, Q, DO, ENTRIES, LO, HI, DOCS, BITS, LSE, DELTA, head,
            inner, outer, first, stop, count, n, heads, head_dim, window, sq_b, sq_h, sq_n,
            sd_b, sd_h, sd_n, qk_scale, BM, D, BAND, HAS_DOCS, False, PRECISION, EVEN_D,
        )  # fmt: skip
        dk, dv = _keys_run(
            dk, dv, k, v, cols, key_bits, Q, DO, ENTRIES, LO, HI, DOCS, BITS, LSE, DELTA, head,
            outer, stop, first, stop, count, n, heads, head_dim, window, sq_b, sq_h, sq_n, sd_b,
            sd_h, sd_n, qk_scale, BM, D, BAND, HAS_DOCS, True, PRECISION, EVEN_D,
        )  # fmt: skip
    if FIRST or LAST or first < stop:  # a middle part's key block that no query reads adds 0
        _write_rows(DK_ACC, DK_ACC, DK, sg_b, sg_h, sg_n, dk * scale, dk, key_rows, col_ok,
                    kv_head, kv_heads, n, head_dim, D, FIRST, LAST, True)  # fmt: skip
        _write_rows(DV_ACC, DV_ACC, DV, sg_b, sg_h, sg_n, dv, dv, key_rows, col_ok, kv_head,
                    kv_heads, n, head_dim, D, FIRST, LAST, True)  # fmt: skip


class Part(NamedTuple):
    """Queries against key ranges: `entries` the query rows in an order where both bounds rise,
    [lo, hi) each one's keys in the key order `order`. The band is `Part()`: token order
    against token order, its ranges computed in the kernel (the window's or the document's
    first key to the query itself), less the keys of one of the query's groups. `rule`: the
    whole hard rule as one part instead (every causal key of the document, kept where it is in
    the window or of one of the query's groups): dense work, one launch a pass."""

    entries: Optional[torch.Tensor] = None
    lo: Optional[torch.Tensor] = None
    hi: Optional[torch.Tensor] = None
    order: Optional[torch.Tensor] = None
    rule: bool = False

    @property
    def kind(self) -> int:
        if self.entries is not None:
            return 0
        return WHOLE_RULE.value if self.rule else BAND_PART.value


class Plan:
    """The launches of a sparse attention's parts (the band first; every part covers every
    token row once, as query and as key) for q [b, h, n, d], k/v [b, g, n, d] on a GPU of
    `capability` (None: the interpreter's tiles). `docs` [b, n] the documents' starts or None;
    `bits` [2, b * n]: each token's groups as a bit mask, and its top-1 group's bit."""

    def __init__(self, q, k, parts, docs, bits, window: int, scale: float, capability):
        b, self.heads, self.n, head_dim = q.shape
        self.kv_heads = k.shape[1]
        self.rows = b * self.n
        self.parts, self.docs, self.bits, self.window = parts, docs, bits, int(window)
        self.tiles = {
            p: triton_launch.sparse_tile(p, capability, head_dim, q.dtype)
            for p in triton_launch.SPARSE_PASSES
        }
        self.scale, self.qk_scale = float(scale), float(scale) * math.log2(math.e)
        self.head_dim = head_dim
        self.flags = dict(
            D=triton_launch.padded(head_dim),
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            EVEN_D=triton_launch.padded(head_dim) == head_dim,
            HAS_DOCS=docs is not None,
        )

    def _constants(self, index: int, tile) -> dict:
        return dict(
            BM=tile.rows,
            BN=tile.keys,
            BAND=self.parts[index].kind,
            FIRST=index == 0,
            LAST=index == len(self.parts) - 1,
            **self.flags,
        )

    def _tensors(self, index: int) -> tuple:
        """ENTRIES, LO, HI, ORDER, DOCS, BITS (the band's bits as placeholders elsewhere)."""
        part = self.parts[index]
        indices = tuple(self.bits if x is None else x for x in part[:4])
        return (*indices, self.docs if self.docs is not None else self.bits, self.bits)

    def _launch(self, kernel, pass_, index, grid, args):
        tile = self.tiles[pass_]
        return Launch(kernel, grid, args, self._constants(index, tile),
                      dict(num_warps=tile.warps, num_stages=tile.stages))  # fmt: skip

    def forward(self, index, q, k, v, acc, lse, out) -> Launch:
        rows = self.tiles["forward"].rows
        return self._launch(
            _forward, "forward", index, (triton.cdiv(self.rows, rows), self.heads),
            (q, k, v, *self._tensors(index), acc, lse, out, self.rows, self.n, self.heads,
             self.heads // self.kv_heads, self.head_dim, self.window, *_strides(q),
             *_strides(k), *_strides(v), *_strides(out), self.qk_scale),
        )  # fmt: skip

    def queries(self, index, q, k, v, grad, out, lse, delta, acc, dq) -> Launch:
        rows = self.tiles["queries"].rows
        return self._launch(
            _backward_queries, "queries", index, (triton.cdiv(self.rows, rows), self.heads),
            (q, k, v, grad, out, *self._tensors(index), lse, delta, acc, dq, self.rows, self.n,
             self.heads, self.heads // self.kv_heads, self.head_dim, self.window, *_strides(q),
             *_strides(k), *_strides(v), *_strides(grad), *_strides(out), self.qk_scale,
             self.scale),
        )  # fmt: skip

    def keys(self, index, q, k, v, grad, lse, delta, dk_acc, dv_acc, dk, dv) -> Launch:
        keys = self.tiles["keys"].keys
        return self._launch(
            _backward_keys, "keys", index, (triton.cdiv(self.rows, keys), self.kv_heads),
            (q, k, v, grad, *self._tensors(index), lse, delta, dk_acc, dv_acc, dk, dv,
             self.rows, self.rows, self.n, self.heads, self.kv_heads,
             self.heads // self.kv_heads, self.head_dim, self.window, *_strides(q),
             *_strides(k), *_strides(v), *_strides(grad), *_strides(dk), self.qk_scale,
             self.scale),
        )  # fmt: skip

    def accumulators(self, device) -> tuple:
        """Float32 rows between the parts: output, dq ([rows, heads, D]), dk, dv ([rows,
        kv heads, D]); none with a single part."""
        D = self.flags["D"]
        sizes = (self.heads, self.heads, self.kv_heads, self.kv_heads)
        rows = self.rows if len(self.parts) > 1 else 1
        return tuple(torch.empty(rows, h, D, device=device, dtype=torch.float32) for h in sizes)

    def launches(self, q, k, v):
        """Every launch of a forward and backward, on fresh outputs (the fit test's list)."""
        acc, dq_acc, dk_acc, dv_acc = self.accumulators(q.device)
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        lse = torch.empty(self.rows, self.heads, device=q.device, dtype=torch.float32)
        dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
        launches = []
        for index in range(len(self.parts)):
            launches += [
                self.forward(index, q, k, v, acc, lse, out),
                self.queries(index, q, k, v, out, out, lse, lse, dq_acc, out),
                self.keys(index, q, k, v, out, lse, lse, dk_acc, dv_acc, dk, dk),
            ]
        return launches


def _strides(t: torch.Tensor) -> tuple:
    """(s_b, s_h, s_n) of a [b, heads, n, d] tensor, s_b and s_n in rows of d (`_row_base`);
    a dim of size 1 steps nowhere."""
    d = t.shape[-1]
    s_b, s_h, s_n = (0 if size == 1 else stride for size, stride in zip(t.shape[:3], t.stride()))
    return s_b // d, s_h, s_n // d


def addressable(t: torch.Tensor) -> torch.Tensor:
    """t as the kernels address it: its last dim contiguous and its sequence and position
    strides whole rows of it (every layout the model makes; else a contiguous copy); raises
    where a row's index would pass 2^31 (a tensor of more than 2^31 rows)."""
    d = t.shape[-1]
    steps = ((t.shape[0], t.stride(0)), (t.shape[2], t.stride(2)))  # sequence, position
    if t.stride(-1) != 1 or any(size > 1 and stride % d for size, stride in steps):
        t = t.contiguous()
    s_b, _, s_n = _strides(t)
    if (t.shape[0] - 1) * s_b + (t.shape[2] - 1) * s_n >= 2**31:
        raise ValueError(f"sparse Focus's kernel: a tensor of {tuple(t.shape)} with strides "
                         f"{t.stride()} spans more than 2^31 rows of its last dim")  # fmt: skip
    return t


def attend(q, k, v, plan: Plan) -> tuple:
    """(out, lse): the parts merged forward, one launch a part."""
    acc = plan.accumulators(q.device)[0]
    lse = torch.empty(plan.rows, plan.heads, device=q.device, dtype=torch.float32)
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    for index in range(len(plan.parts)):
        plan.forward(index, q, k, v, acc, lse, out)()
    return out, lse


def gradients(grad, q, k, v, out, lse, plan: Plan) -> tuple:
    """(dq, dk, dv) of `attend`'s output: two launches a part."""
    grad = addressable(grad)
    _, dq_acc, dk_acc, dv_acc = plan.accumulators(q.device)
    delta = torch.empty_like(lse)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk, dv = (torch.empty(k.shape, device=k.device, dtype=k.dtype) for _ in range(2))
    for index in range(len(plan.parts)):  # the first writes delta, which the keys read
        plan.queries(index, q, k, v, grad, out, lse, delta, dq_acc, dq)()
    for index in range(len(plan.parts)):
        plan.keys(index, q, k, v, grad, lse, delta, dk_acc, dv_acc, dk, dv)()
    return dq, dk, dv


class TritonSparseAttention(torch.autograd.Function):
    """The parts merged, forward and backward, by the kernels above: q [b, h, n, d], k/v
    [b, g, n, d] (`addressable`) -> [b, h, n, d]. Launches: one per part forward, two per part
    backward; nothing else."""

    @staticmethod
    def forward(ctx, q, k, v, plan: Plan):
        out, lse = attend(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return *gradients(grad, *ctx.saved_tensors, ctx.plan), None


def planned(q, k, parts, docs, bits, *, window: int, scale: float) -> Plan:
    """The launches of `parts` for q and k (`addressable`) on q's GPU."""
    return Plan(q, k, parts, docs, bits, window, scale, triton_launch.capability_of(q))


def triton_sparse_attention(q, k, v, parts, docs, bits, *, window: int, scale: float):
    """The parts (`Part`s: the band, then the buckets' ranges) merged: q [b, h, n, d], k/v
    [b, g, n, d]; docs [b, n] the documents' starts or None; bits [2, b * n] int64: each
    token's groups as a bit mask (as a query) and its top-1 group's bit (as a key), whose pairs
    the band leaves out."""
    q, k, v = (addressable(t) for t in (q, k, v))
    plan = planned(q, k, parts, docs, bits, window=window, scale=scale)
    return TritonSparseAttention.apply(q, k, v, plan)
