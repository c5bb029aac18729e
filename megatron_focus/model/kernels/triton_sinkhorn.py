"""The causal Sinkhorn (sinkhorn.causal_sinkhorn) as Triton kernels, parallel along the sequence.

Why: in PyTorch every iteration is a float64 cumulative sum along the sequence (on a GPU, one
thread per sequence and group walking n dependent steps) and a dozen elementwise kernels: about
300 launches per layer and step at 10 iterations. Here the sequence is cut into spans, one program
each (a two-level scan): one launch per iteration, in which every span scans its own tokens block
by block (float64, as the PyTorch scan: a group's mass never underflows) and stores its total;
the next launch adds to each span the totals of the spans before it (back to the document start
of the token before the span), finishes that iteration and scans the next. So the GPU's SMs all
work at b = 1, and a layer costs `iters + 1` launches each way instead of `iters x n / 64`
dependent steps in b programs. The scans inside a block run along the token axis of a [tokens,
groups] tile, restarting at document starts.

The backward has the same shape, in reverse: per iteration, the gradient of a prefix sum is a
suffix sum of the gradients (restarting at document ends), each span's carried from the spans
after it (to the end of the document of the token after the span). It reads what the forward
stored: each iteration's log-assignments and log prefix masses ([iterations, b, n, K] float32
each, a few MB per layer at the recipes' sizes).

Iteration t, with L the log-assignments, m = exp(max(L, -700)), P_i = sum of m_j over the
document's tokens j <= i, and len_i the token's position in its document plus one:

    L'_i = L_i - log P_i + log len_i,    L_next = log_softmax(L') over groups
    dL'_i = dL_next_i - exp(L_next_i) sum_k dL_next_ik
    dL_i = dL'_i + m_i [L_i > -700] * sum_{j >= i, same document} (-dL'_j / P_j)

As the other kernels, compiled for a GPU, or run by Triton's interpreter on CPU tensors under
TRITON_INTERPRET=1.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from megatron_focus.model.kernels import triton_launch
from megatron_focus.model.kernels.triton_launch import Launch
from megatron_focus.parallel import context_parallel
from megatron_focus.parallel.context_parallel import _in_order

LOG_MASS_FLOOR = tl.constexpr(-700.0)  # sinkhorn._LOG_MASS_FLOOR


@triton.jit
def _restart_add(a, a_restarts, b, b_restarts):
    """Combine of a scan that restarts where a flag is set (documents)."""
    return tl.where(b_restarts, b, a + b), a_restarts | b_restarts


@triton.jit
def _log_softmax(x, ok):
    """Over the groups (axis 1) of x; padded groups (not `ok`) stay -inf."""
    x = tl.where(ok, x, float("-inf"))
    shifted = x - tl.max(x, axis=1)[:, None]
    return shifted - tl.log(tl.sum(tl.exp(shifted), axis=1))[:, None]


@triton.jit
def _block(DOCS, b, start, n, groups, at, BT: tl.constexpr, KP: tl.constexpr,
           HAS_DOCS: tl.constexpr):  # fmt: skip
    """A block's rows, tile offsets [BT, KP], mask, each token's document start (a position in
    the sequence, whose row 0 is at position `at`) and position in its document (1-based)."""
    pos = start + tl.arange(0, BT)
    k = tl.arange(0, KP)
    offsets = (b * n + pos[:, None]) * groups + k[None, :]
    ok = (pos[:, None] < n) & (k[None, :] < groups)
    if HAS_DOCS:
        first = tl.load(DOCS + b * n + pos, mask=pos < n, other=0)
    else:
        first = tl.zeros((BT,), tl.int32)
    return pos, offsets, ok, first, (at + pos - first + 1).to(tl.float32)


@triton.jit
def _row(x, i, BT: tl.constexpr):
    """Row i of a [BT, KP] tile."""
    return tl.sum(tl.where(tl.arange(0, BT)[:, None] == i, x, 0.0), axis=0)


@triton.jit
def _spans_sum(X, first, last, KP: tl.constexpr, CB: tl.constexpr):
    """Rows first .. last - 1 of a [spans, KP] float64 plane, summed: [KP]."""
    total = tl.zeros((KP,), tl.float64)
    rows = tl.arange(0, CB)[:, None]
    k = tl.arange(0, KP)[None, :]
    for a in range(first, last, CB):
        total += tl.sum(tl.load(X + (a + rows) * KP + k, mask=a + rows < last, other=0.0), 0)
    return total


@triton.jit
def _prefix_masses(log_g, ok, restarts, continues, carry):
    """Each token's mass summed over its document up to it, float64: the block's own scan plus
    the carry of the tokens before the block (for those whose document began before it)."""
    mass = tl.where(ok, tl.exp(tl.maximum(log_g, LOG_MASS_FLOOR).to(tl.float64)), 0.0)
    prefix, _ = tl.associative_scan((mass, restarts), 0, _restart_add)
    return prefix + tl.where(continues, carry[None, :], 0.0)


@triton.jit(do_not_specialize=["t"])
def _forward(
    S, DOCS, FIRST_SPAN, LOG_G, LOG_P, TOTALS, AT, CARRIES,
    n, batch, groups, iters, s_b, s_n, span, spans, t,
    BT: tl.constexpr, KP: tl.constexpr, CB: tl.constexpr, HAS_DOCS: tl.constexpr,
    CHUNKS: tl.constexpr,
):  # fmt: skip
    """Launch t of a span: iteration t - 1 finished (its prefix masses, with the totals of the
    spans before it: LOG_P[t - 1], LOG_G[t]; at t = 0 LOG_G[0] from the scores), iteration t's
    masses scanned and the span's total stored (TOTALS [iters, b, spans, KP]: its masses since
    its last document start). CHUNKS: the sequences are context-parallel chunks, row 0 at
    position AT[b], and CARRIES [iters, b, KP] the masses of the chunks before (FIRST_SPAN < 0:
    the document began before the chunk)."""
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)  # offsets in 64 bits: iters x b x n x K can pass 2^31
    plane = tl.cast(batch, tl.int64) * n * groups
    begin = p * span
    end = tl.minimum(begin + span, n)
    at = tl.load(AT + b) if CHUNKS else 0
    carry = tl.zeros((KP,), tl.float64)  # iteration t - 1's masses before the block
    if t > 0:
        first_span = 0
        if HAS_DOCS:
            first_span = tl.load(FIRST_SPAN + b * spans + p)
        carry = _spans_sum(
            TOTALS + ((t - 1) * batch + b) * spans * KP, tl.maximum(first_span, 0), p, KP, CB
        )
        if CHUNKS and first_span < 0:
            carry += tl.load(CARRIES + ((t - 1) * batch + b) * KP + tl.arange(0, KP))
    total = tl.zeros((KP,), tl.float64)  # iteration t's masses in the span before the block
    for start in range(begin, end, BT):
        pos, offsets, ok, first, length = _block(DOCS, b, start, n, groups, at, BT, KP, HAS_DOCS)
        restarts = (at + pos == first)[:, None] & ok  # a document starts at the token
        continues = (first < at + start)[:, None]  # its document began before the block
        last = tl.minimum(start + BT, n) - 1 - start  # the block's last valid row
        if t == 0:
            scores_at = S + b * s_b + pos[:, None] * s_n + tl.arange(0, KP)[None, :]
            log_g = _log_softmax(tl.load(scores_at, mask=ok, other=0.0), ok)
            tl.store(LOG_G + offsets, log_g, mask=ok)
        else:
            log_g = tl.load(LOG_G + (t - 1) * plane + offsets, mask=ok, other=0.0)
            prefix = _prefix_masses(log_g, ok, restarts, continues, carry)
            carry = _row(prefix, last, BT)
            log_p = tl.log(prefix).to(tl.float32)
            tl.store(LOG_P + (t - 1) * plane + offsets, log_p, mask=ok)
            log_g = _log_softmax(log_g - (log_p - tl.log(length)[:, None]), ok)
            tl.store(LOG_G + t * plane + offsets, log_g, mask=ok)
        if t < iters:
            total = _row(_prefix_masses(log_g, ok, restarts, continues, total), last, BT)
    if t < iters:
        k = tl.arange(0, KP)
        tl.store(TOTALS + ((t * batch + b) * spans + p) * KP + k, total)


@triton.jit
def _suffix(LOG_G, LOG_P, plane, t, grad, offsets, ok, ends, continues, carry):
    """Iteration t's backward on a block from the gradient of its result: dL' and the suffix
    sums of -dL'/P over each token's document from it on (the block's own scan plus the carry of
    the tokens after the block, for those whose document goes on past it)."""
    log_next = tl.load(LOG_G + (t + 1) * plane + offsets, mask=ok, other=0.0)
    log_p = tl.load(LOG_P + t * plane + offsets, mask=ok, other=0.0)
    grad_inner = tl.where(ok, grad - tl.exp(log_next) * tl.sum(grad, axis=1)[:, None], 0.0)
    grad_p = -grad_inner.to(tl.float64) * tl.exp(-log_p.to(tl.float64))
    suffix, _ = tl.associative_scan((grad_p, ends), 0, _restart_add, reverse=True)
    return grad_inner, suffix + tl.where(continues, carry[None, :], 0.0)


@triton.jit(do_not_specialize=["t"])
def _backward(
    DOCS, LAST_SPAN, LOG_G, LOG_P, D_OUT, GRAD, D_S, HEADS, AT, CARRIES, NEXT,
    n, batch, groups, iters, s_b, s_n, span, spans, t,
    BT: tl.constexpr, KP: tl.constexpr, CB: tl.constexpr, HAS_DOCS: tl.constexpr,
    CHUNKS: tl.constexpr,
):  # fmt: skip
    """Launch t of a span, backwards: iteration t's gradient finished from the gradient of its
    result (D_OUT's, or GRAD's, where the launch before left it) with the heads of the spans
    after it, and stored in GRAD; then
    iteration t - 1's suffix sums scanned and the span's head stored (HEADS [iters, b, spans,
    KP]: its sums up to its first document end); at t = 0 the scores' gradient. CHUNKS: as the
    forward's, CARRIES the sums of the chunks after (LAST_SPAN >= spans: the document goes on
    past the chunk), NEXT[b] the document start of the token after the chunk (-1: none)."""
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    plane = tl.cast(batch, tl.int64) * n * groups
    begin = p * span
    end = tl.minimum(begin + span, n)
    at = tl.load(AT + b) if CHUNKS else 0
    next_doc = tl.load(NEXT + b) if CHUNKS else -1
    carry = tl.zeros((KP,), tl.float64)  # iteration t's sums after the block
    if t < iters:
        last_span = spans - 1
        if HAS_DOCS:
            last_span = tl.load(LAST_SPAN + b * spans + p)
        heads = HEADS + (t * batch + b) * spans * KP
        carry = _spans_sum(heads, p + 1, tl.minimum(last_span, spans - 1) + 1, KP, CB)
        if CHUNKS and last_span >= spans:
            carry += tl.load(CARRIES + (t * batch + b) * KP + tl.arange(0, KP))
    head = tl.zeros((KP,), tl.float64)  # iteration t - 1's sums in the span after the block
    blocks = tl.cdiv(end - begin, BT)
    for reverse in range(0, blocks):
        start = begin + (blocks - 1 - reverse) * BT
        pos, offsets, ok, first, length = _block(DOCS, b, start, n, groups, at, BT, KP, HAS_DOCS)
        if HAS_DOCS:  # the token's document goes on past the block; a document ends at it
            after = tl.load(DOCS + b * n + tl.minimum(start + BT, n - 1))
            after = tl.where(start + BT < n, after, next_doc)
            continues = (first == after)[:, None]
            next_first = tl.load(DOCS + b * n + pos + 1, mask=pos + 1 < n, other=-1)
            next_first = tl.where(pos + 1 < n, next_first, next_doc)
            ends = (next_first != first)[:, None] & ok
        else:
            continues = tl.full((BT, 1), 1, tl.int1) & (start + BT < n)
            ends = ((pos + 1 >= n)[:, None]) & ok
        if t + 1 >= iters:  # the gradient of the result
            grad = tl.load(D_OUT + offsets, mask=ok, other=0.0)
        else:
            grad = tl.load(GRAD + offsets, mask=ok, other=0.0)
        if t < iters:
            grad_inner, suffix = _suffix(
                LOG_G, LOG_P, plane, t, grad, offsets, ok, ends, continues, carry
            )
            carry = _row(suffix, 0, BT)
            log_g = tl.load(LOG_G + t * plane + offsets, mask=ok, other=float("-inf"))
            mass = tl.where((log_g > LOG_MASS_FLOOR) & ok, tl.exp(log_g.to(tl.float64)), 0.0)
            grad = grad_inner + (mass * suffix).to(tl.float32)
            tl.store(GRAD + offsets, grad, mask=ok)
        if t > 0:
            _, suffix = _suffix(LOG_G, LOG_P, plane, t - 1, grad, offsets, ok, ends, continues,
                                head)  # fmt: skip
            head = _row(suffix, 0, BT)
        else:
            log_g0 = tl.load(LOG_G + offsets, mask=ok, other=float("-inf"))
            d_scores = grad - tl.exp(log_g0) * tl.sum(grad, axis=1)[:, None]
            d_scores_at = D_S + b * s_b + pos[:, None] * s_n + tl.arange(0, KP)[None, :]
            tl.store(d_scores_at, d_scores, mask=ok)
    if t > 0:
        k = tl.arange(0, KP)
        tl.store(HEADS + (((t - 1) * batch + b) * spans + p) * KP + k, head)


def _span_ends(doc_start, span: int, spans: int, chunks=None):
    """Per sequence and span (int32 [b, spans] each): the span holding the document start of
    the token before it, the forward's first span to add (negative: the document began before
    the chunk), and the span holding the document end of the token after it, the backward's last
    (`spans`: the document goes on past the chunk)."""
    n = doc_start.shape[1]
    begins = torch.arange(spans, device=doc_start.device) * span
    before = doc_start[:, (begins - 1).clamp_min(0)]
    following = doc_start[:, (begins + span).clamp_max(n - 1)]
    doc_end = torch.searchsorted(doc_start, following.contiguous(), right=True) - 1
    last_span = doc_end // span
    if chunks is not None:
        before = before - chunks.at[:, None]
        past = (doc_end == n - 1) & (following == chunks.next_doc[:, None])
        last_span = torch.where(past, spans, last_span)
    first_span = torch.div(before, span, rounding_mode="floor")
    return first_span.to(torch.int32), last_span.to(torch.int32)


@dataclasses.dataclass(frozen=True)
class Chunks:
    """A context-parallel rank's two chunks of each sequence, run as sequences of their own (row
    2 b + j: sequence b's chunk j): the position each begins at, the document start of the token
    after each (-1: none), and the group the carries between chunks cross."""

    at: torch.Tensor
    next_doc: torch.Tensor
    group: object

    @staticmethod
    def of(doc_start: torch.Tensor, positions: torch.Tensor, group) -> "Chunks":
        """From the rank's rows' document starts [b, 2c] and positions [2c] (context_parallel)."""
        b, length = doc_start.shape
        chunk = length // 2
        firsts = _in_order(context_parallel._all_gather(doc_start[:, ::chunk].t(), group))
        size = len(firsts) // 2
        none = torch.full_like(firsts[0], -1)
        mine = context_parallel.chunk_ids(torch.distributed.get_rank(group), size)
        next_doc = torch.stack([firsts[c + 1] if c + 1 < 2 * size else none for c in mine], 1)
        at = positions[::chunk].to(torch.int32).repeat(b)
        return Chunks(at, next_doc.reshape(-1).to(torch.int32), group)

    def carried(self, sums: torch.Tensor, docs: torch.Tensor, span: int, reverse: bool):
        """What flows into each chunk from the others at one iteration, from its spans' sums
        [2b, spans, KP]: forward, the masses since the last document start of each chunk before
        it; reverse, the gradients' sums up to the first document end of each chunk after it."""
        index = torch.arange(sums.shape[1], device=sums.device)
        if reverse:
            end = torch.searchsorted(docs, docs[:, :1].contiguous(), right=True)[:, 0] - 1
            own, through = index <= end[:, None] // span, docs[:, 0] == self.next_doc
        else:
            last = docs[:, -1] - self.at
            own = index >= torch.div(last, span, rounding_mode="floor").clamp_min(0)[:, None]
            through = last < 0
        pair = lambda x: x.view(-1, 2, *x.shape[1:]).transpose(0, 1)  # noqa: E731
        own_sums = (sums * own[..., None]).sum(1)
        flow = context_parallel.chunk_carries(pair(own_sums), pair(through), self.group, reverse)
        return flow.transpose(0, 1).reshape(own_sums.shape)


def launches(scores, iters: int, docs, has_docs: bool, log_g, log_p, d_out, d_scores,
             capability, chunks=None):  # fmt: skip
    """The forward's launches and the backward's, one per iteration and one more each (the fit
    test compiles the first of each; `d_out` the gradient of the result, `d_scores` that of the
    scores), and the buffers the launches share:
    each span's sums per iteration, and under context parallelism each chunk's carries."""
    b, n, groups = scores.shape
    tile = triton_launch.sinkhorn_tile(capability)
    span = triton_launch.sinkhorn_span(capability, b, n)
    spans = triton.cdiv(n, span)
    kp = max(2, triton.next_power_of_2(groups))
    # per iteration, each span's total (forward) and head (backward)
    sums = torch.empty(max(iters, 1), b, spans, kp, device=scores.device, dtype=torch.float64)
    grad = sums  # the backward's: each iteration's gradient, as it goes
    if d_out is not None:
        grad = torch.empty(log_g.shape[1:], device=log_g.device)
    carries = sums  # unread without chunks
    if chunks is not None:
        carries = torch.zeros(max(iters, 1), b, kp, device=scores.device, dtype=torch.float64)
    first_span, last_span = _span_ends(docs, span, spans, chunks) if has_docs else (sums, sums)
    at, next_doc = (chunks.at, chunks.next_doc) if chunks is not None else (sums, sums)
    constants = dict(BT=tile.rows, KP=kp, CB=16, HAS_DOCS=has_docs, CHUNKS=chunks is not None)
    options = dict(num_warps=tile.warps, num_stages=tile.stages)
    sizes = (n, b, groups, iters, scores.stride(0), scores.stride(1), span, spans)

    def launch(kernel, *tensors, t):
        return Launch(kernel, (spans, b), (*tensors, *sizes, t), constants, options)

    forward = [
        launch(_forward, scores, docs, first_span, log_g, log_p, sums, at, carries, t=t)
        for t in range(iters + 1)
    ]
    backward = [
        launch(
            _backward,
            docs,
            last_span,
            log_g,
            log_p,
            d_out,
            grad,
            d_scores,
            sums,
            at,
            carries,
            next_doc,
            t=t,
        )  # fmt: skip
        for t in range(iters, -1, -1)
    ]
    return forward, backward, (sums, carries, span)


class TritonCausalSinkhorn(torch.autograd.Function):
    """Log-assignments [b, n, K] (float32) from scores [b, n, K] (any strides over b and n, as
    the router's transposed ones: their gradient is written in the same layout, so nothing is
    copied either way); `doc_start` [b, n] or None; `context` as sinkhorn.causal_sinkhorn's
    (the rows a context-parallel rank's two chunks: each runs as a sequence, with what flows
    from the other chunks exchanged between launches)."""

    @staticmethod
    def forward(ctx, scores, iters, doc_start, context):
        shape = scores.shape
        scores = scores.float()
        if scores.stride(-1) != 1 or context is not None:
            scores = scores.contiguous()
        chunks = None
        if context is not None:
            positions, group = context
            if doc_start is None:  # one document: the sequence's
                doc_start = torch.zeros(shape[:2], dtype=torch.int32, device=scores.device)
            chunks = Chunks.of(doc_start.to(torch.int32), positions, group)
            scores = scores.view(2 * shape[0], shape[1] // 2, shape[2])
            doc_start = doc_start.reshape(2 * shape[0], shape[1] // 2)
        b, n, groups = scores.shape
        docs = doc_start.to(torch.int32).contiguous() if doc_start is not None else scores
        log_g = scores.new_empty(iters + 1, b, n, groups)
        log_p = scores.new_empty(max(iters, 1), b, n, groups)
        ctx.launch = dict(
            iters=iters,
            docs=docs,
            has_docs=doc_start is not None,
            capability=triton_launch.capability_of(scores),
            chunks=chunks,
        )
        forward, _, (sums, carries, span) = launches(
            scores, **ctx.launch, log_g=log_g, log_p=log_p, d_out=None, d_scores=None
        )
        for t, step in enumerate(forward):
            step()
            if chunks is not None and t < iters:
                carries[t] = chunks.carried(sums[t], docs, span, reverse=False)
        ctx.save_for_backward(log_g, log_p)
        ctx.layout, ctx.shape = scores.stride(), shape
        return log_g[iters].view(shape)

    @staticmethod
    def backward(ctx, grad):
        log_g, log_p = ctx.saved_tensors
        # the scores' gradient in their layout, which sizes the launch as the scores did
        d_scores = torch.empty_strided(log_g.shape[1:], ctx.layout, device=grad.device)
        d_out = grad.float().reshape(log_g.shape[1:]).contiguous()
        _, backward, (sums, carries, span) = launches(
            d_scores, **ctx.launch, log_g=log_g, log_p=log_p, d_out=d_out, d_scores=d_scores
        )
        chunks, iters = ctx.launch["chunks"], ctx.launch["iters"]
        for t, step in zip(range(iters, -1, -1), backward):
            step()
            if chunks is not None and t > 0:
                carries[t - 1] = chunks.carried(sums[t - 1], ctx.launch["docs"], span, True)
        return d_scores.view(ctx.shape), None, None, None


def triton_causal_sinkhorn(
    scores: torch.Tensor, iters: int, doc_start=None, context=None
) -> torch.Tensor:
    return TritonCausalSinkhorn.apply(scores, iters, doc_start, context)
