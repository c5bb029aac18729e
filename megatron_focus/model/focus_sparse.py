"""Sparse (hard top-k) Focus attention that computes only the kept pairs: local + group buckets.

The hard rule (focus_gate.hard_pair_mask) keeps, for query i, the local keys i - w < j <= i and
the keys whose top-1 group is among i's top-k groups. It is split into disjoint parts, each an
ordinary attention call, merged exactly by per-query log-sum-exp weights:

* bucket part, one per top-k slot s: query i meets, causally, the keys of group topk(i)[s]. All
  groups of all sequences are packed into one call: tokens are stably sorted by (sequence, group),
  so positions stay increasing inside a bucket and plain causal attention over the bucket is the
  causal rule; q, k and v are each gathered once into the padded [buckets, longest] layout. A
  bucket holds the tokens whose top-1 group it is (their keys count) and, for top-k > 1, tokens
  that only query it; a [buckets, longest] key mask removes those keys.
* local part: the window keys whose top-1 group is *not* among the query's top-k (the others are
  in a bucket already), by query blocks of B = 16 against the w + B keys ending with them,
  overlapping strided windows of one padded copy: O(n (w + B)). On a GPU, one FlexAttention call
  over the band instead (flex.flex_local_part).

Each key is in exactly one bucket and the local part excludes bucket pairs, so no pair is counted
twice and nothing is subtracted. Cost: sum over buckets of |bucket|^2 / 2 plus n w, against n^2 / 2
dense. Routing (top-k, sort, counts, offsets) stays on the device: no Python loop over groups and
one host synchronisation per call (the longest bucket, which sizes the packed batch).

This is an inference path (no backward through the log-sum-exp); training uses the soft gate.
"""

import torch

from megatron_focus.model import focus_gate
from megatron_focus.model.flex import flex_local_part
from megatron_focus.model.focus_gate import attention_with_lse

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
    top_k = groups_q.shape[-1]
    num_groups = int(groups_q.max()) + 1
    # One entry per (sequence, token, slot); a token's own key lives in its top-1 bucket (slot 0).
    entry = torch.arange(b * n * top_k, device=q.device)
    token_row, slot = entry // top_k, entry % top_k  # token_row = sequence * n + position
    bucket = (token_row // n) * num_groups + groups_q.reshape(-1)
    order = torch.sort(bucket, stable=True).indices  # positions stay increasing in a bucket
    sizes = torch.bincount(bucket, minlength=b * num_groups)
    starts = torch.cumsum(sizes, 0) - sizes
    longest = int(sizes.max())  # the one host synchronisation
    # Entry order[i] goes to place `packed_at[i]` of the [buckets * longest] layout; the places
    # after a bucket's tokens (padding) read entry 0: as keys they come after every real query
    # of their bucket (causal), as queries they are never read back.
    packed_at = bucket[order] * longest + torch.arange(order.numel(), device=q.device) \
        - starts[bucket[order]]
    source = order.new_zeros(b * num_groups * longest).index_copy_(0, packed_at, order)

    def packed(x):  # [b, heads, n, d] -> [buckets, heads, longest, d]
        heads = x.shape[1]
        rows = x.transpose(1, 2).reshape(b * n, heads, d)
        return rows.index_select(0, source // top_k).view(b * num_groups, longest, heads, d) \
            .transpose(1, 2)

    if top_k == 1:
        out, lse = attention_with_lse(packed(q), packed(k), packed(v), scale, causal=True)
    else:
        # A bucket also holds tokens that only query it (slots > 0): a key mask removes their
        # keys, and a query with no key of the group at or before it gets log-sum-exp -inf.
        member = (slot.index_select(0, source) == 0).view(b * num_groups, longest)
        mask = torch.zeros(member.shape, dtype=q.dtype, device=q.device)
        mask.masked_fill_(~member, float("-inf"))
        out, lse = attention_with_lse(packed(q), packed(k), packed(v), scale, causal=True,
                                      mask=mask[:, None, None, :])
        lse = lse.masked_fill(member.cumsum(1).unsqueeze(1) == 0, float("-inf"))
    # Back to [slot][b, h, n, ...]: entry e sits at place packed_at[rank of e in `order`].
    rank = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(),
                                                                       device=q.device))
    back = packed_at.index_select(0, rank)
    out = out.transpose(1, 2).reshape(-1, h, d).index_select(0, back)
    lse = lse.transpose(1, 2).reshape(-1, h).index_select(0, back)
    outs = out.view(b, n, top_k, h, d).permute(2, 0, 3, 1, 4)
    lses = lse.view(b, n, top_k, h).permute(2, 0, 3, 1)
    return list(outs), list(lses)


# Queries per block of the local part: each block meets the w + B keys ending with it, so
# w / (w + B) of the computed pairs are window pairs (50% with B = w).
_LOCAL_BLOCK = 16


def _local_part(q, k, v, groups_q, window: int, scale: float):
    """Window keys whose top-1 group is not among the query's top-k: O(n (w + B)).

    All sequences are laid end to end, each after F >= w zero positions (F and the sequence
    padded to multiples of B), in one [positions, heads, d] copy; block m's queries are positions
    [mB + F, mB + F + B) and its keys the overlapping window [mB, mB + F + B), a strided view of
    that copy (no copy per block). A mask removes keys out of the window, padding, and keys whose
    top-1 group is one of the query's (the bucket part has those).
    """
    b, h, n, d = q.shape
    block = min(_LOCAL_BLOCK, window)
    front = -(-window // block) * block  # F
    length = front + -(-n // block) * block  # L: one sequence with its padding
    keys = front + block  # per block
    blocks = (b * length - front) // block  # M (the last F / B blocks are the next padding's)

    def laid_out(x, fill=0):  # [b, n, ...] -> [b * L, ...]: each sequence after its padding
        out = x.new_full((b, length) + x.shape[2:], fill)
        out[:, front:front + n] = x
        return out.flatten(0, 1)

    def windows(x, size, offset):  # [b * L, ...] -> [M, size, ...], block m from mB + offset
        strides = x.stride()
        return x.as_strided((blocks, size) + x.shape[1:], (block * strides[0],) + strides,
                            x.storage_offset() + offset * strides[0])

    def heads_first(x, size, offset):  # [b, heads, n, d] -> [M, heads, size, d]
        return windows(laid_out(x.transpose(1, 2)), size, offset).transpose(1, 2)

    real = laid_out(torch.ones(b, n, dtype=torch.bool, device=q.device), False)
    top1 = laid_out(groups_q[..., 0], -1)
    distance = front + torch.arange(block, device=q.device)[:, None] \
        - torch.arange(keys, device=q.device)  # [B, F + B], the same for every block
    in_window = (distance >= 0) & (distance < window)
    in_bucket = (windows(laid_out(groups_q, -2), block, front)[:, :, None, :]
                 == windows(top1, keys, 0)[:, None, :, None]).any(-1)  # [M, B, F + B]
    keep = in_window & windows(real, keys, 0)[:, None, :] & ~in_bucket
    mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf"))
    out, lse = attention_with_lse(heads_first(q, block, front), heads_first(k, keys, 0),
                                  heads_first(v, keys, 0), scale, causal=False,
                                  mask=mask.unsqueeze(1))
    lse = lse.masked_fill(~keep.any(-1).unsqueeze(1), float("-inf"))

    def back(x):  # [M, h, B, ...] -> [b, h, n, ...]
        x = x.transpose(1, 2).flatten(0, 1)  # positions F .. b * L
        x = torch.cat([x.new_zeros((front,) + x.shape[1:]), x]).unflatten(0, (b, length))
        return x[:, front:front + n].transpose(1, 2)

    return back(out), back(lse)


@torch.no_grad()
def sparse_focus_attention(q, k, v, log_g, *, window: int, top_k: int, scale: float):
    """Hard-rule Focus attention computing only kept pairs. q [b,h,n,d], k/v [b,g,n,d], log_g [b,n,K]."""
    groups_q = log_g.topk(top_k, dim=-1).indices  # [b, n, top_k], top-1 first
    bucket_outs, bucket_lses = _bucket_part(q, k, v, groups_q, scale)
    if focus_gate.lse_kernel(q.device) == "flex":  # a GPU: one call over the band
        local_out, local_lse = flex_local_part(q, k, v, groups_q, window, scale)
    else:
        local_out, local_lse = _local_part(q, k, v, groups_q, window, scale)
    out, _ = merge_by_lse(bucket_outs + [local_out],
                          [lse.float() for lse in bucket_lses + [local_lse]])
    return out.to(q.dtype)
