"""Causal (leak-free) Sinkhorn normalisation of token-to-group scores, in log space.

The paper normalises each group's column over the *whole* sequence, so token i's assignment, and
with it which earlier tokens i may attend to, depends on tokens after i: the future leaks into
training and the assignment cannot be computed while generating. Here the token-side step of
token i uses only tokens j <= i.

Recurrence, for scores S (n tokens x K groups), L^0 = log_softmax(S) over groups, and t = 1..T:

    token side:  L'_ik    = L^{t-1}_ik - log( (1/i) * sum_{j<=i} exp(L^{t-1}_jk) )
    group side:  L^t_ik   = L'_ik - log( sum_k exp(L'_ik) )

i.e. each entry is divided by its group's *prefix-mean* mass (mass over tokens 1..i divided by i),
then each row is renormalised to a distribution over groups. A group that has taken more than its
share of the prefix is pushed down for the tokens that follow; every quantity at row i is a
function of rows 1..i only, so a full-sequence forward and token-by-token decoding agree exactly
(incremental decoding keeps, per iteration, the K prefix sums). exp(L^T) has rows summing to 1.

The prefix sums are float64 cumulative sums of exp(L), faster than `torch.logcumsumexp` on
the CPU (forward and backward; its scan was the largest part of a Focus step's Sinkhorn); a
log-mass below -700 counts as -700 in them, so the sums never underflow (float64's exp does
below -745; fp32's already below -104).

Packed documents (`doc_start`, documents.py): the prefix of token i is its document's tokens up
to i, so each document is balanced as if it were alone. Their sums are a segmented scan (sums of
masses only: a difference of running totals would lose a small group's mass to cancellation).
"""

from typing import Optional

import torch

from megatron_focus.parallel.context_parallel import chunk_carries

_LOG_MASS_FLOOR = -700.0


def log_prefix_sums(log_g: torch.Tensor, doc_start: Optional[torch.Tensor] = None):
    """log sum_{doc_start_i <= j <= i} exp(log_g_j) along the token dim (-2), a causal scan."""
    masses = log_g.double().clamp_min(_LOG_MASS_FLOOR).exp()
    if doc_start is None:
        return masses.cumsum(dim=-2).log().to(log_g.dtype)
    return segmented_cumsum(masses, doc_start).log().to(log_g.dtype)


def segmented_cumsum(x: torch.Tensor, doc_start: torch.Tensor) -> torch.Tensor:
    """Prefix sums of x [..., n, K] along n, restarting at each token's `doc_start` [..., n].

    A log-step scan: after the step of stride d, x_i sums x over [max(start_i, i - 2d + 1), i],
    adding x_{i-d} (same document) to x_i.
    """
    n = x.shape[-2]
    positions = torch.arange(n, device=x.device)
    stride = 1
    while stride < n:
        reach = (positions[stride:] - stride >= doc_start[..., stride:]).unsqueeze(-1)
        x = torch.cat([x[..., :stride, :], x[..., stride:, :] + x[..., :-stride, :] * reach], -2)
        stride *= 2
    return x


def causal_sinkhorn(
    scores: torch.Tensor,
    iters: int,
    doc_start: Optional[torch.Tensor] = None,
    context: Optional[tuple] = None,
) -> torch.Tensor:
    """Log-assignments [..., n, K] from scores [..., n, K]; rows are log-distributions over
    groups. `doc_start` [..., n]: each token's document start (None: one document). `context`:
    (the rows' positions [n], the context-parallel group) when the rows are a context-parallel
    rank's two chunks of the sequence: their prefixes continue across ranks."""
    if context is None:
        positions, prefix_sums = (
            torch.arange(scores.shape[-2], device=scores.device),
            log_prefix_sums,
        )
    else:
        positions, group = context

        def prefix_sums(log_g, doc_start):
            return log_prefix_sums_across(log_g, doc_start, positions, group)

    prefix_len = positions + 1 if doc_start is None else positions - doc_start + 1
    log_prefix_len = torch.log(prefix_len.to(scores.dtype)).unsqueeze(-1)
    log_g = torch.log_softmax(scores, dim=-1)
    for _ in range(iters):
        log_g = log_g - (prefix_sums(log_g, doc_start) - log_prefix_len)
        log_g = torch.log_softmax(log_g, dim=-1)
    return log_g


def log_prefix_sums_across(
    log_g: torch.Tensor, doc_start: Optional[torch.Tensor], positions: torch.Tensor, group
) -> torch.Tensor:
    """`log_prefix_sums` of a context-parallel rank's rows [b, n, K] (its two chunks, at
    `positions`): each chunk's own prefix sums, plus the masses of the chunks before it back to
    each token's document start (context_parallel.chunk_carries)."""
    b, n, groups = log_g.shape
    chunk = n // 2
    masses = log_g.double().clamp_min(_LOG_MASS_FLOOR).exp().view(b, 2, chunk, groups)
    first = positions.view(2, chunk)[:, :1]  # [2, 1] each chunk's first position
    if doc_start is None:
        sums = masses.cumsum(dim=-2)
        restarts = torch.zeros(2, b, dtype=torch.bool, device=log_g.device)
        continues = torch.ones(b, 2, chunk, 1, dtype=sums.dtype, device=log_g.device)
    else:
        starts = doc_start.view(b, 2, chunk)
        # inside the chunk, each token's document starts at the later of its start and the chunk's
        sums = segmented_cumsum(masses, (starts - first).clamp_min(0))
        restarts = (starts[..., -1] >= first[:, 0]).transpose(0, 1)
        continues = (starts < first).to(sums.dtype).unsqueeze(-1)
    carries = chunk_carries(sums[:, :, -1].transpose(0, 1), ~restarts, group)  # [2, b, K]
    sums = sums + carries.transpose(0, 1).unsqueeze(2) * continues
    return sums.view(b, n, groups).log().to(log_g.dtype)
