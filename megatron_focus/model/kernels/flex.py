"""FlexAttention kernels for Focus on a GPU: the soft gate fused as a `score_mod`, and attention
with its log-sum-exp for the sparse path's calls.

Why: on a GPU the chunked autograd Function of focus_gate would run PyTorch ops chunk by chunk;
FlexAttention compiles the gate into one flash-style Triton kernel, forward and backward, the
gradient of the assignments included (PyTorch accumulates gradients of captured tensors since
2.6). Memory stays linear in n: no score matrix exists, and block masks skip the future.

On the CPU, FlexAttention has no backward (torch 2.13), so training there keeps the chunked path.
These functions still run forward on the CPU, eagerly (a dense evaluation of the same
`score_mod`), which is how the tests check them against the dense reference; the gradient of
`gate_score_mod` is checked by differentiating it on dense index grids.
"""

import functools
from typing import Optional

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from megatron_focus import platform
from megatron_focus.model.kernels.kernels import compiled

# g_i . g_j below this is 0 for every purpose (the clamp keeps log() and its gradient finite);
# the same floor as focus_gate's chunked path.
TINY_AFFINITY = 1e-30


def gate_score_mod(
    g: torch.Tensor,
    window: int,
    gate_scale: float,
    gate: str = "log",
    sink: int = 0,
    doc_start: Optional[torch.Tensor] = None,
):
    """The soft rule as a score_mod: a distant pair (i - j >= w, j not one of the first `sink`
    tokens) gets lambda * log(g_i . g_j) added, or with the paper's gate (`gate="sigmoid"`) its
    logit times sigmoid(lambda g_i . g_j). With packed documents (`doc_start` [b, n]), a key
    before the query's document is removed and the sinks are its document's first tokens.

    g [b, n, K] are the assignments (probabilities). The K-term dot product is unrolled, so each
    pair reads 2K numbers; its gradient reaches g through FlexAttention's captured-buffer rule.
    That rule (inductor's lowering of the backward) takes each captured tensor that requires
    gradients to be indexed once: the query side and the key side read their own copy of each
    column. Causality is the block mask's job, not this function's.
    """
    query_side = [column.clone() for column in g.unbind(-1)]  # K tensors [b, n]
    key_side = [column.clone() for column in g.unbind(-1)]

    def score_mod(score, b, h, q_idx, kv_idx):
        affinity = query_side[0][b, q_idx] * key_side[0][b, kv_idx]
        for g_q, g_k in zip(query_side[1:], key_side[1:]):
            affinity = affinity + g_q[b, q_idx] * g_k[b, kv_idx]
        if gate == "sigmoid":
            gated = score * torch.sigmoid(gate_scale * affinity)
        else:
            gated = score + gate_scale * torch.log(torch.clamp(affinity, min=TINY_AFFINITY))
        if doc_start is None:
            return torch.where((q_idx - kv_idx >= window) & (kv_idx >= sink), gated, score)
        first = doc_start[b, q_idx]
        gated = torch.where((q_idx - kv_idx >= window) & (kv_idx >= first + sink), gated, score)
        return torch.where(kv_idx >= first, gated, float("-inf"))

    return score_mod


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _causal_window(window: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return mask_mod


def block_indices(some: torch.Tensor, every: torch.Tensor) -> tuple:
    """A BlockMask's index tensors from [batch, query blocks, key blocks] booleans (batch 1: the
    same for every sequence): the blocks with some kept pair, and those whose every pair is kept
    (whole: FlexAttention evaluates no mask there), by key block for the forward and by query
    block for the backward. Tensors only, so it traces into a compiled region."""

    def counts_and_indices(kept):  # kept blocks first, in increasing order, in each row
        order = torch.sort((~kept).to(torch.int8), dim=-1, stable=True).indices
        return kept.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    partial = some & ~every
    return (
        *counts_and_indices(partial),
        *counts_and_indices(every),
        *counts_and_indices(partial.transpose(-1, -2)),
        *counts_and_indices(every.transpose(-1, -2)),
    )


# block_indices' tensors, in order, as BlockMask's fields (the same names in torch 2.11 to 2.13)
_INDEX_FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def _block_mask(indices: tuple, mask_mod, block: int, seq_lengths: tuple) -> BlockMask:
    """The BlockMask of `block_indices`' tensors (no computation: BlockMask.from_kv_blocks would
    transpose the indices again, eagerly)."""
    return BlockMask(
        seq_lengths=seq_lengths,
        BLOCK_SIZE=(block, block),
        mask_mod=mask_mod,
        **dict(zip(_INDEX_FIELDS, indices, strict=True)),
    )


@functools.lru_cache(maxsize=32)
def causal_block_mask(
    n: int, device: torch.device, window: Optional[int] = None, block: int = 128
) -> BlockMask:
    """The causal (i - w < j <= i with a window) n x n BlockMask, from its block geometry.

    `create_block_mask` would evaluate the mask at every one of the n^2 pairs. Here a block of
    queries [a, a'] and keys [c, c'] is skipped unless some pair is causal and in the window
    (a' >= c and a - c' < w), and whole (no mask evaluated) if every pair is (a >= c' and
    a' - c < w). Its index tensors hold (n / block)^2 integers.
    """
    window = n if window is None else window
    blocks = -(-n // block)
    first = torch.arange(blocks, device=device) * block
    last = first + block - 1
    q_first, q_last, k_first, k_last = first[:, None], last[:, None], first[None], last[None]
    some = (q_last >= k_first) & (q_first - k_last < window)
    every = (q_first >= k_last) & (q_last - k_first < window)
    mask_mod = _causal if window >= n else _causal_window(window)
    return _block_mask(block_indices(some[None], every[None]), mask_mod, block, (n, n))


def _kernel(device: torch.device):
    return _compiled_flex() if compiled(device) else flex_attention


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    platform.setup()  # raises dynamo's recompile limit (platform.RECOMPILE_LIMIT)
    # dynamic=False: a second sequence length recompiles for its shape instead of turning the
    # kernel symbolic (slower, and some block-mask shapes are refused symbolic).
    return torch.compile(flex_attention, dynamic=False)


def _attend_with_lse(q, k, v, scale: float, score_mod=None, block_mask=None):
    """FlexAttention's (output, natural log-sum-exp); kv heads may be fewer than q heads."""
    out, aux = _kernel(q.device)(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        return_aux=AuxRequest(lse=True),
    )
    return out, aux.lse


def flex_soft_focus(
    q,
    k,
    v,
    log_g,
    *,
    window: int,
    gate_scale: float,
    scale: float,
    gate: str = "log",
    sink: int = 0,
    doc_start: Optional[torch.Tensor] = None,
):
    """Soft-gate causal Focus attention, fused. q [b,h,n,d], k/v [b,groups,n,d], log_g [b,n,K],
    doc_start [b, n] or None (packed documents: their blocks skip the other documents)."""
    score_mod = gate_score_mod(log_g.float().exp(), window, gate_scale, gate, sink, doc_start)
    if doc_start is None:
        block_mask = causal_block_mask(q.shape[2], q.device)
    else:
        block_mask = document_block_mask(doc_start)
    return _kernel(q.device)(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def flex_attention_with_lse(q, k, v, scale: float, causal: bool, mask=None):
    """(output, natural log-sum-exp) like focus_gate.attention_with_lse, by FlexAttention.

    `mask` is additive, broadcastable to [b, h, nq, nk]; a query with no key left gets
    log-sum-exp -inf and output 0.
    """
    score_mod = None
    if mask is not None:
        mask = mask.expand(q.shape[0], -1, q.shape[2], k.shape[2])  # heads may stay at 1
        heads = mask.shape[1]

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + mask[b, h if heads > 1 else 0, q_idx, kv_idx]

    block_mask = causal_block_mask(q.shape[2], q.device) if causal else None
    return _attend_with_lse(q, k, v, scale, score_mod, block_mask)


def flex_local_part(q, k, v, groups_q, segment, window: int, scale: float):
    """Sparse Focus's local part in one call over the band (i - w < j <= i): the window keys
    of the query's document (`segment` [b, n]: documents.segments) whose top-1 group is not
    among the query's top-k groups (those are in the bucket part).

    groups_q [b, n, top_k] (top-1 first). Returns (output, log-sum-exp), -inf where no key is left.
    """
    top1 = groups_q[..., 0].contiguous()  # its own tensor: inductor refuses a captured view
    slots = groups_q.shape[-1]

    def score_mod(score, b, h, q_idx, kv_idx):
        removed = (groups_q[b, q_idx, 0] == top1[b, kv_idx]) | (
            segment[b, q_idx] != segment[b, kv_idx]
        )
        for s in range(1, slots):
            removed = removed | (groups_q[b, q_idx, s] == top1[b, kv_idx])
        return torch.where(removed, float("-inf"), score)

    return _attend_with_lse(
        q, k, v, scale, score_mod, causal_block_mask(q.shape[2], q.device, window)
    )


def range_blocks(lo: torch.Tensor, hi: torch.Tensor, keys: int, block: int = 128) -> tuple:
    """`block_indices` of query e against keys [lo[e], hi[e]) (lo, hi nondecreasing in e; [rows],
    or [b, rows] for one mask per sequence): a block of queries reads the key blocks from its
    first lo to its last hi; those inside every one of its ranges (from its last lo to its first
    hi) are whole, most of a bucket's blocks."""
    lo, hi = lo.reshape(-1, lo.shape[-1]), hi.reshape(-1, hi.shape[-1])
    rows = lo.shape[-1]
    q_blocks, kv_blocks = -(-rows // block), -(-keys // block)
    last_row = torch.clamp(torch.arange(1, q_blocks + 1, device=lo.device) * block, max=rows) - 1
    lo_first, lo_last = lo[:, ::block, None], lo[:, last_row, None]
    hi_first, hi_last = hi[:, ::block, None], hi[:, last_row, None]
    key_first = torch.arange(kv_blocks, device=lo.device) * block
    some = (key_first < hi_last) & (key_first + block > lo_first) & (hi_last > lo_first)
    every = (key_first >= lo_last) & (key_first + block <= hi_first)
    return block_indices(some, every)


def range_block_mask(
    lo: torch.Tensor, hi: torch.Tensor, keys: int, block: int = 128, indices=None
) -> BlockMask:
    """The BlockMask of `range_blocks` (`indices`: theirs, where already made)."""
    if indices is None:
        indices = range_blocks(lo, hi, keys, block)
    batched = lo.dim() == 2
    lo, hi = lo.reshape(-1, lo.shape[-1]), hi.reshape(-1, hi.shape[-1])

    def mask_mod(b, h, q_idx, kv_idx):
        row = b if batched else 0
        return (kv_idx >= lo[row, q_idx]) & (kv_idx < hi[row, q_idx])

    return _block_mask(indices, mask_mod, block, (lo.shape[-1], keys))


def document_block_mask(doc_start: torch.Tensor) -> BlockMask:
    """The causal mask within packed documents (doc_start [b, n]), per sequence: query i reads
    keys [doc_start[i], i], so blocks of other documents are skipped, not computed and masked."""
    n = doc_start.shape[-1]
    ends = torch.arange(1, n + 1, device=doc_start.device).expand(doc_start.shape)
    return range_block_mask(doc_start, ends, n)


def flex_range_attention(q, k, v, lo, hi, scale: float, blocks=None):
    """Query row e against key rows [lo[e], hi[e]) in one FlexAttention call (the sparse path's
    bucket part on a GPU: no padding, no bucket squares). q [E, h, d], k/v [M, groups, d] ->
    (out [E, h, d], lse [E, h], -inf where a range is empty). `blocks`: the ranges'
    `range_blocks`, where already made."""
    out, lse = _attend_with_lse(
        *(x.transpose(0, 1)[None] for x in (q, k, v)),
        scale,
        block_mask=range_block_mask(lo, hi, k.shape[0], indices=blocks),
    )
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)
