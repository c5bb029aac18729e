"""Sparse (hard top-k) Focus attention that computes only the kept pairs: local + group buckets.

The hard rule (focus_gate.hard_pair_mask) keeps, for query i, the local keys i - w < j <= i and
the keys whose top-1 group is among i's top-k groups. It is split into disjoint parts, each an
ordinary attention call, merged exactly by per-query log-sum-exp weights:

* bucket part, one per top-k slot s: query i meets, causally, the keys of group topk(i)[s]. All
  groups of all sequences are packed into one call: tokens are stably sorted by (sequence, group),
  so positions stay increasing inside a bucket and plain causal attention over the bucket is the
  causal rule. A bucket holds the tokens whose top-1 group it is (their keys count) and, for
  top-k > 1, tokens that only query it; those keys are removed by one extra head dimension
  (q: 1, k: -inf-like), so the call stays a plain causal one with no mask tensor.
* local part: the window keys whose top-1 group is *not* among the query's top-k (the others are
  in a bucket already), by query blocks of w against 2w keys: O(n w).

Each key is in exactly one bucket and the local part excludes bucket pairs, so no pair is counted
twice and nothing is subtracted. Cost: sum over buckets of |bucket|^2 / 2 plus n w, against n^2 / 2
dense. Routing (top-k, sort, counts, offsets) stays on the device: no Python loop over groups and
one host synchronisation per call (the longest bucket, which sizes the packed batch).

This is an inference path (no backward through the log-sum-exp); training uses the soft gate.
"""

import torch
import torch.nn.functional as F

from megatron_focus.model.focus_gate import attention_with_lse

# Score given to a query-only token's key inside a bucket: exp() of it is exactly 0 in fp32.
_EXCLUDED = -1e6


def merge_by_lse(outputs, lses):
    """Exact softmax over the union of disjoint key sets, from each set's output and log-sum-exp.

    outputs: list of [b, h, n, d]; lses: list of [b, h, n] (-inf where a set was empty).
    """
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    merged = sum(torch.exp(part - safe).unsqueeze(-1) * out for out, part in zip(outputs, lses))
    return merged, lse


def _bucket_part(q, k, v, groups_q, scale):
    """Per top-k slot, each query's attention over its bucket: outputs [k][b,h,n,d], lses [k][b,h,n]."""
    b, h, n, d = q.shape
    kv_heads, top_k = k.shape[1], groups_q.shape[-1]
    num_groups = int(groups_q.max()) + 1
    # One entry per (sequence, token, slot); a token's own key lives in its top-1 bucket (slot 0).
    entry = torch.arange(b * n * top_k, device=q.device)
    token_row, slot = entry // top_k, entry % top_k  # token_row = sequence * n + position
    bucket = (token_row // n) * num_groups + groups_q.reshape(-1)
    order = torch.sort(bucket, stable=True).indices  # positions stay increasing in a bucket
    sizes = torch.bincount(bucket, minlength=b * num_groups)
    starts = torch.cumsum(sizes, 0) - sizes
    longest = int(sizes.max())  # the one host synchronisation
    rows = token_row[order]
    slots = order.new_empty(order.shape)
    slots[order] = torch.arange(order.numel(), device=q.device)  # entry -> its place in `order`
    packed_at = bucket[order] * longest + torch.arange(order.numel(), device=q.device) \
        - starts[bucket[order]]  # place in the padded [buckets * longest] layout

    extra_k = torch.where(slot[order] == 0, 0.0, _EXCLUDED / scale).to(k.dtype)

    def packed(x, extra):  # [b, heads, n, d] -> [buckets, heads, longest, d + 1], zero padded
        heads = x.shape[1]
        entries = x.transpose(1, 2).reshape(b * n, heads, d).index_select(0, rows)
        extra = extra.view(-1, 1, 1).expand(-1, heads, 1) if extra.dim() else \
            entries.new_full((entries.shape[0], heads, 1), float(extra))
        out = x.new_zeros(b * num_groups * longest, heads, d + 1)
        out.index_copy_(0, packed_at, torch.cat([entries, extra], dim=-1))
        return out.view(b * num_groups, longest, heads, d + 1).transpose(1, 2)

    pq = packed(q, torch.tensor(1.0))
    pk, pv = packed(k, extra_k), packed(v, torch.tensor(0.0))
    out, lse = attention_with_lse(pq, pk, pv, scale, causal=True)
    # Back to [slot][b, h, n, ...]; padding rows (after each bucket's tokens) are never read.
    back = packed_at.index_select(0, slots)
    out = out.transpose(1, 2).reshape(-1, h, d + 1).index_select(0, back)[..., :d]
    lse = lse.transpose(1, 2).reshape(-1, h).index_select(0, back)
    outs = out.view(b, n, top_k, h, d).permute(2, 0, 3, 1, 4)
    lses = lse.view(b, n, top_k, h).permute(2, 0, 3, 1)
    return list(outs), list(lses)


def _blocks(x: torch.Tensor, dim: int, window: int, with_previous: bool = False):
    """Split `dim` (positions, zero-padded) into blocks of w; optionally prepend the previous block."""
    n = x.shape[dim]
    pad = -n % window
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    x = x.unflatten(dim, (-1, window))
    if with_previous:
        previous = torch.cat([torch.zeros_like(x.narrow(dim, 0, 1)),
                              x.narrow(dim, 0, x.shape[dim] - 1)], dim=dim)
        x = torch.cat([previous, x], dim=dim + 1)
    return x


def _local_part(q, k, v, groups_q, window: int, scale: float):
    """Window keys whose top-1 group is not among the query's top-k, by blocks of w queries."""
    b, h, n, d = q.shape
    blocks = -(-n // window)
    q_pos = torch.arange(blocks * window, device=q.device).view(blocks, window)
    k_pos = torch.cat([q_pos - window, q_pos], dim=1)  # [blocks, 2w]; padding keys are >= n
    distance = q_pos[:, :, None] - k_pos[:, None, :]
    window_pairs = (distance >= 0) & (distance < window) & (k_pos >= 0)[:, None, :] \
        & (k_pos < n)[:, None, :]
    groups_qb = _blocks(groups_q, 1, window)  # [b, blocks, w, top_k]
    top1_kb = _blocks(groups_q[..., 0], 1, window, with_previous=True)  # [b, blocks, 2w]
    in_bucket = (groups_qb[:, :, :, None, :] == top1_kb[:, :, None, :, None]).any(-1)
    keep = window_pairs & ~in_bucket  # [b, blocks, w, 2w]
    mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf"))

    def per_block(x, with_previous):  # [b, heads, n, d] -> [b * blocks, heads, w or 2w, d]
        x = _blocks(x, 2, window, with_previous)
        return x.transpose(1, 2).flatten(0, 1)

    out, lse = attention_with_lse(per_block(q, False), per_block(k, True), per_block(v, True),
                                  scale, causal=False, mask=mask.flatten(0, 1).unsqueeze(1))
    lse = lse.masked_fill(~keep.any(-1).flatten(0, 1).unsqueeze(1), float("-inf"))
    out = out.unflatten(0, (b, blocks)).transpose(1, 2).flatten(2, 3)[:, :, :n]
    lse = lse.unflatten(0, (b, blocks)).transpose(1, 2).flatten(2, 3)[:, :, :n]
    return out, lse


@torch.no_grad()
def sparse_focus_attention(q, k, v, log_g, *, window: int, top_k: int, scale: float):
    """Hard-rule Focus attention computing only kept pairs. q [b,h,n,d], k/v [b,g,n,d], log_g [b,n,K]."""
    groups_q = log_g.topk(top_k, dim=-1).indices  # [b, n, top_k], top-1 first
    bucket_outs, bucket_lses = _bucket_part(q, k, v, groups_q, scale)
    local_out, local_lse = _local_part(q, k, v, groups_q, window, scale)
    out, _ = merge_by_lse(bucket_outs + [local_out],
                          [lse.float() for lse in bucket_lses + [local_lse]])
    return out.to(q.dtype)
