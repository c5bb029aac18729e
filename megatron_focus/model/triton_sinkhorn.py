"""The causal Sinkhorn (sinkhorn.causal_sinkhorn) as one Triton kernel forward and one backward.

Why: in PyTorch every iteration is a float64 cumulative sum along the sequence (on a GPU, one
thread per sequence and group walking n dependent steps) and a dozen elementwise kernels: about
300 launches per layer and step at 10 iterations. Causality makes one pass enough: token i's
iteration t reads only tokens <= i at iteration t - 1, so a program walks its sequence block by
block and runs all iterations on a block, carrying each iteration's K prefix masses from the
blocks before (float64, as the PyTorch scan: a group's mass never underflows). The scans inside a
block run along the token axis of a [tokens, groups] tile, restarting at document starts.

The backward walks the blocks in reverse: per iteration, from the last to the first, the
gradient of a prefix sum is a suffix sum of the gradients (restarting at document ends), carried
from the blocks after. It reads what the forward stored: each iteration's log-assignments and
log prefix masses ([iterations, b, n, K] float32 each, a few MB per layer at the recipes' sizes).

Iteration t, with L the log-assignments, m = exp(max(L, -700)), P_i = sum of m_j over the
document's tokens j <= i, and len_i the token's position in its document plus one:

    L'_i = L_i - log P_i + log len_i,    L_next = log_softmax(L') over groups
    dL'_i = dL_next_i - exp(L_next_i) sum_k dL_next_ik
    dL_i = dL'_i + m_i [L_i > -700] * sum_{j >= i, same document} (-dL'_j / P_j)

As the other kernels, compiled for a GPU, or run by Triton's interpreter on CPU tensors under
TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl

from megatron_focus.model import triton_launch
from megatron_focus.model.triton_launch import Launch

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
def _block(DOCS, b, start, n, groups, BT: tl.constexpr, KP: tl.constexpr, HAS_DOCS: tl.constexpr):
    """A block's positions, tile offsets [BT, KP], mask, each token's document start and
    position in its document (1-based)."""
    pos = start + tl.arange(0, BT)
    k = tl.arange(0, KP)
    offsets = (b * n + pos[:, None]) * groups + k[None, :]
    ok = (pos[:, None] < n) & (k[None, :] < groups)
    if HAS_DOCS:
        first = tl.load(DOCS + b * n + pos, mask=pos < n, other=0)
    else:
        first = tl.zeros((BT,), tl.int32)
    return pos, offsets, ok, first, (pos - first + 1).to(tl.float32)


@triton.jit
def _carry_row(carry, t, TP: tl.constexpr):
    """Row t of a [TP, KP] tile of carries."""
    return tl.sum(tl.where(tl.arange(0, TP)[:, None] == t, carry, 0.0), axis=0)


@triton.jit
def _forward(
    S,
    DOCS,
    LOG_G,
    LOG_P,
    n,
    batch,
    groups,
    iters,
    s_b,
    s_n,
    BT: tl.constexpr,
    KP: tl.constexpr,
    TP: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """LOG_G [iters + 1, b, n, K]: the log-assignments before each iteration and the result;
    LOG_P [iters, b, n, K]: each iteration's log prefix masses."""
    b = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: iters x b x n x K can pass 2^31
    plane = tl.cast(batch, tl.int64) * n * groups
    carry = tl.zeros((TP, KP), tl.float64)  # each iteration's prefix masses so far
    rows = tl.arange(0, TP)[:, None]
    for start in range(0, n, BT):
        pos, offsets, ok, first, length = _block(DOCS, b, start, n, groups, BT, KP, HAS_DOCS)
        scores_at = S + b * s_b + pos[:, None] * s_n + tl.arange(0, KP)[None, :]
        log_g = _log_softmax(tl.load(scores_at, mask=ok, other=0.0), ok)
        tl.store(LOG_G + offsets, log_g, mask=ok)
        restarts = (pos == first)[:, None] & ok  # a document starts at the token
        continues = (first < start)[:, None]  # the token's document began in an earlier block
        last = tl.minimum(start + BT, n) - 1 - start  # the block's last valid row
        for t in range(iters):
            mass = tl.where(ok, tl.exp(tl.maximum(log_g, LOG_MASS_FLOOR).to(tl.float64)), 0.0)
            prefix, _ = tl.associative_scan((mass, restarts), 0, _restart_add)
            prefix += tl.where(continues, _carry_row(carry, t, TP)[None, :], 0.0)
            end = tl.sum(tl.where(tl.arange(0, BT)[:, None] == last, prefix, 0.0), axis=0)
            carry = tl.where(rows == t, end[None, :], carry)
            log_p = tl.log(prefix).to(tl.float32)
            tl.store(LOG_P + t * plane + offsets, log_p, mask=ok)
            log_g = _log_softmax(log_g - (log_p - tl.log(length)[:, None]), ok)
            tl.store(LOG_G + (t + 1) * plane + offsets, log_g, mask=ok)


@triton.jit
def _backward(
    DOCS,
    LOG_G,
    LOG_P,
    D_OUT,
    D_S,
    n,
    batch,
    groups,
    iters,
    s_b,
    s_n,
    BT: tl.constexpr,
    KP: tl.constexpr,
    TP: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    plane = tl.cast(batch, tl.int64) * n * groups
    carry = tl.zeros((TP, KP), tl.float64)  # each iteration's suffix sums from later blocks
    rows = tl.arange(0, TP)[:, None]
    blocks = tl.cdiv(n, BT)
    for reverse in range(0, blocks):
        start = (blocks - 1 - reverse) * BT
        pos, offsets, ok, first, length = _block(DOCS, b, start, n, groups, BT, KP, HAS_DOCS)
        if HAS_DOCS:  # the token's document goes on past the block; a document ends at it
            after = tl.load(DOCS + b * n + tl.minimum(start + BT, n - 1))
            continues = ((first == after) & (start + BT < n))[:, None]
            next_first = tl.load(DOCS + b * n + pos + 1, mask=pos + 1 < n, other=-1)
            ends = ((next_first != first) | (pos + 1 >= n))[:, None] & ok
        else:
            continues = tl.full((BT, 1), 1, tl.int1) & (start + BT < n)
            ends = ((pos + 1 >= n)[:, None]) & ok
        grad = tl.load(D_OUT + offsets, mask=ok, other=0.0)
        for back in range(0, iters):
            t = iters - 1 - back
            log_next = tl.load(LOG_G + (t + 1) * plane + offsets, mask=ok, other=0.0)
            log_g = tl.load(LOG_G + t * plane + offsets, mask=ok, other=float("-inf"))
            log_p = tl.load(LOG_P + t * plane + offsets, mask=ok, other=0.0)
            grad_inner = grad - tl.exp(log_next) * tl.sum(grad, axis=1)[:, None]
            grad_inner = tl.where(ok, grad_inner, 0.0)
            grad_p = -grad_inner.to(tl.float64) * tl.exp(-log_p.to(tl.float64))
            suffix, _ = tl.associative_scan((grad_p, ends), 0, _restart_add, reverse=True)
            suffix += tl.where(continues, _carry_row(carry, t, TP)[None, :], 0.0)
            head = tl.sum(tl.where(tl.arange(0, BT)[:, None] == 0, suffix, 0.0), axis=0)
            carry = tl.where(rows == t, head[None, :], carry)
            above = log_g > LOG_MASS_FLOOR
            mass = tl.where(above & ok, tl.exp(log_g.to(tl.float64)), 0.0)
            grad = grad_inner + (mass * suffix).to(tl.float32)
        log_g0 = tl.load(LOG_G + offsets, mask=ok, other=float("-inf"))
        d_scores = grad - tl.exp(log_g0) * tl.sum(grad, axis=1)[:, None]
        d_scores_at = D_S + b * s_b + pos[:, None] * s_n + tl.arange(0, KP)[None, :]
        tl.store(d_scores_at, d_scores, mask=ok)


def _launch_shape(groups: int, iters: int, capability) -> dict:
    return dict(
        BT=triton_launch.sinkhorn_tile(capability).rows,
        KP=max(2, triton.next_power_of_2(groups)),
        TP=max(2, triton.next_power_of_2(max(iters, 1))),
    )


def launches(scores, iters: int, docs, has_docs: bool, log_g, log_p, d_out, d_scores, capability):
    """The forward's and the backward's launch (the fit test's list; `d_out` the gradient of
    the result, `d_scores` that of the scores)."""
    b, n, groups = scores.shape
    tile = triton_launch.sinkhorn_tile(capability)
    constants = dict(**_launch_shape(groups, iters, capability), HAS_DOCS=has_docs)
    options = dict(num_warps=tile.warps, num_stages=tile.stages)
    sizes = (n, b, groups, iters, scores.stride(0), scores.stride(1))
    return (
        Launch(_forward, (b,), (scores, docs, log_g, log_p, *sizes), constants, options),
        Launch(_backward, (b,), (docs, log_g, log_p, d_out, d_scores, *sizes), constants, options),
    )


class TritonCausalSinkhorn(torch.autograd.Function):
    """Log-assignments [b, n, K] (float32) from scores [b, n, K] (any strides over b and n, as
    the router's transposed ones: their gradient is written in the same layout, so nothing is
    copied either way); `doc_start` [b, n] or None."""

    @staticmethod
    def forward(ctx, scores, iters, doc_start):
        scores = scores.float()
        if scores.stride(-1) != 1:
            scores = scores.contiguous()
        b, n, groups = scores.shape
        docs = doc_start.to(torch.int32).contiguous() if doc_start is not None else scores
        log_g = scores.new_empty(iters + 1, b, n, groups)
        log_p = scores.new_empty(max(iters, 1), b, n, groups)
        ctx.launch = dict(
            iters=iters,
            docs=docs,
            has_docs=doc_start is not None,
            capability=triton_launch.capability_of(scores),
        )
        forward, _ = launches(
            scores, **ctx.launch, log_g=log_g, log_p=log_p, d_out=None, d_scores=None
        )
        forward()
        ctx.save_for_backward(log_g, log_p)
        ctx.layout = scores.stride()
        return log_g[iters]

    @staticmethod
    def backward(ctx, grad):
        log_g, log_p = ctx.saved_tensors
        # the scores' gradient in their layout, which sizes the launch as the scores did
        d_scores = torch.empty_strided(log_g.shape[1:], ctx.layout, device=grad.device)
        _, backward = launches(
            d_scores,
            **ctx.launch,
            log_g=log_g,
            log_p=log_p,
            d_out=grad.float().contiguous(),
            d_scores=d_scores,
        )
        backward()
        return d_scores, None, None


def triton_causal_sinkhorn(scores: torch.Tensor, iters: int, doc_start=None) -> torch.Tensor:
    return TritonCausalSinkhorn.apply(scores, iters, doc_start)
