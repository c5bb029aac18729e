"""Sparse (hard top-k) Focus attention that computes only the kept pairs: local + group buckets.

The hard rule (focus_gate.hard_pair_mask) keeps, for query i, the local keys i - w < j <= i and
the keys whose top-1 group is among i's top-k groups. It is split into disjoint parts, each an
ordinary attention call, merged exactly by per-query log-sum-exp weights:

* bucket part, one per top-k slot s. The keys of all groups of all documents are laid out in
  bucket order: tokens stably sorted by (document, top-1 group), positions increasing inside a
  bucket (a sequence is one document, or several packed ones: documents.py). Query i's keys for
  slot s are then one contiguous range of that layout: the members of i's s-th ranked group
  (groups.py) before it in its document (and i itself for its own top-1 group), `_key_ranges`.
  Slot 0 on the CPU is plain causal attention over each bucket: all buckets packed into one call,
  q, k, v each gathered once into the padded [buckets, longest] layout. Other slots, and every
  slot on a GPU, attend their ranges: FlexAttention in one call with a block mask made from the
  ranges (flex.flex_range_attention), or on the CPU blocks of queries against their blocks' key
  ranges (`_range_attention`). Work is the kept pairs, not the bucket's square: a token that
  only queries a bucket adds no keys to it.
* local part: the window keys whose top-1 group is *not* among the query's top-k (the others are
  in a bucket already), by query blocks of B = 16 against the w + B keys ending with them,
  overlapping strided windows of one padded copy: O(n (w + B)). On a GPU, one FlexAttention call
  over the band instead (flex.flex_local_part).

* sinks (`sink` > 0: a document's first s tokens, kept for every query): they join no group
  bucket. A sink query's slot 0 is the sinks' own bucket (causal attention over the sinks
  before it: all its keys); other queries see the sinks in their window through the local part
  and the distant ones through a sink part: a range of that bucket again.

Each key is in exactly one bucket and the local part excludes bucket pairs, so no pair is counted
twice and nothing is subtracted. No part reaches outside the query's document. Cost: the kept
distant pairs plus n w, against n^2 / 2 dense.
Routing (top-k, sort, counts, offsets) stays on the device: no Python loop over groups; the CPU
synchronises with the host for the longest bucket and the key ranges' bounds.

This is an inference path (no backward through the log-sum-exp); training uses the soft gate.
"""

from typing import Optional

import torch

from megatron_focus.model import kernels
from megatron_focus.model.documents import segments
from megatron_focus.model.flex import flex_local_part, flex_range_attention
from megatron_focus.model.focus_gate import attention_with_lse
from megatron_focus.model.groups import Routing


def merge_by_lse(outputs, lses):
    """Exact softmax over the union of disjoint key sets, from each set's output and log-sum-exp.

    outputs: list of [b, h, n, d]; lses: list of [b, h, n] (-inf where a set was empty). One
    interpolation per set, the running output towards the set's by the set's share of the mass.
    """
    out, lse = outputs[0].float(), lses[0]
    for part_out, part_lse in zip(outputs[1:], lses[1:]):
        total = torch.logaddexp(lse, part_lse)
        share = torch.exp(part_lse - total).nan_to_num_(0.0)  # both empty so far: nan -> 0
        out, lse = torch.lerp(out, part_out.float(), share.unsqueeze(-1)), total
    return out, lse


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along dim 0, the rest of each row flattened first (several times faster on the
    CPU than index_select over [rows, heads, d])."""
    return x.flatten(1).index_select(0, index).view((-1,) + x.shape[1:])


def _scatter_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows of x placed at `index` (a permutation), flattened likewise."""
    flat = x.flatten(1)
    return torch.empty_like(flat).index_copy_(0, index, flat).view(x.shape)


def _buckets(groups_q: torch.Tensor, num_groups: int, doc_start, segment, documents: int):
    """Bucket of each token (document * K + top-1 group), the token rows in bucket order (stable:
    positions increasing), each bucket's first place in that order, and [b, n, K] how many
    members each group has in the token's document before it."""
    bucket = (segment * num_groups + groups_q[..., 0]).reshape(-1)
    order = torch.sort(bucket, stable=True).indices
    # Counted by a scatter of known size: bincount would synchronise with the host for its size.
    sizes = bucket.new_zeros(documents * num_groups).index_add_(0, bucket, torch.ones_like(bucket))
    onehot = torch.nn.functional.one_hot(groups_q[..., 0], num_groups)
    before = onehot.cumsum(1) - onehot  # in the sequence, then less those before the document
    before -= before.gather(1, doc_start[..., None].expand_as(before))
    return bucket, order, sizes, torch.cumsum(sizes, 0) - sizes, before


def _key_ranges(groups_q, slot: int, starts, before, segment, num_groups: int):
    """[lo, hi) of each token's slot-`slot` keys in bucket order, [b * n] each: the members of
    the token's slot-th ranked group before it in its document, and the token itself in its own
    (top-1) group."""
    group = groups_q[..., slot : slot + 1]
    lo = starts[segment * num_groups + group[..., 0]]
    return lo.reshape(-1), (lo + before.gather(-1, group)[..., 0] + (slot == 0)).reshape(-1)


def _causal_buckets(rows, order, bucket, sizes, starts, scale):
    """Slot 0 on the CPU: causal attention inside each bucket, all buckets in one padded call."""
    h, d = rows[0].shape[1:]
    num_buckets = sizes.numel()
    longest = int(sizes.max())  # a host synchronisation
    # Token order[i] goes to place `packed_at[i]` of the [buckets * longest] layout; the places
    # after a bucket's tokens (padding) read token 0: as keys they come after every real query
    # of their bucket (causal), as queries they are never read back.
    sorted_bucket = bucket[order]
    packed_at = (
        sorted_bucket * longest
        + torch.arange(order.numel(), device=order.device)
        - starts[sorted_bucket]
    )
    source = order.new_zeros(num_buckets * longest).index_copy_(0, packed_at, order)

    def packed(x):  # [b * n, heads, d] rows -> [buckets, heads, longest, d]
        return _gather_rows(x, source).view(num_buckets, longest, x.shape[1], d).transpose(1, 2)

    out, lse = attention_with_lse(*(packed(x) for x in rows), scale, causal=True)
    back = torch.empty_like(packed_at).index_copy_(0, order, packed_at)  # token -> its place
    return (
        _gather_rows(out.transpose(1, 2).reshape(-1, h, d), back),
        _gather_rows(lse.transpose(1, 2).reshape(-1, h), back),
    )


# Queries per kernel call of `_range_attention`: each call computes its block's queries against
# the union of their key ranges, so a larger block wastes more (the ranges' staircase) and a
# smaller one makes more calls.
_RANGE_BLOCK = 256


def _range_attention(q, k, v, lo, hi, scale: float):
    """Query row e against key rows [lo[e], hi[e]), lo and hi nondecreasing in e, on the CPU.

    q [E, h, d], k/v [M, groups, d] -> (out [E, h, d], lse [E, h], -inf where a range is empty).
    Blocks of queries, each against the key rows from its first lo to its last hi (a view), the
    rest of each range masked.
    """
    rows = q.shape[0]
    out = q.new_zeros(q.shape)
    lse = torch.full(q.shape[:2], float("-inf"), device=q.device)
    firsts, lasts = lo.tolist(), hi.tolist()  # a host synchronisation
    for start in range(0, rows, _RANGE_BLOCK):
        end = min(start + _RANGE_BLOCK, rows)
        first, last = firsts[start], lasts[end - 1]
        if last <= first:
            continue
        # Every query of the block keeps the keys from its last lo to its first hi: only the
        # columns outside that span need comparing.
        mask = torch.zeros(end - start, last - first, dtype=q.dtype, device=q.device)
        inner = (firsts[end - 1] - first, lasts[start] - first)
        for cols in (range(0, inner[0]), range(max(inner), last - first)):
            keys = torch.arange(first + cols.start, first + cols.stop, device=q.device)
            kept = (keys >= lo[start:end, None]) & (keys < hi[start:end, None])
            mask[:, cols.start : cols.stop].masked_fill_(~kept, float("-inf"))
        o, block_lse = attention_with_lse(
            q[start:end].transpose(0, 1)[None],
            k[first:last].transpose(0, 1)[None],
            v[first:last].transpose(0, 1)[None],
            scale,
            causal=False,
            mask=mask[None, None],
        )
        out[start:end] = o[0].transpose(0, 1)
        lse[start:end] = block_lse[0].transpose(0, 1)
    return out, lse.masked_fill_((hi <= lo)[:, None], float("-inf"))


def _bucket_part(
    q,
    k,
    v,
    groups_q,
    num_groups: int,
    doc_start,
    segment,
    documents: int,
    sink: int,
    window,
    scale,
    kernel,
):
    """Per top-k slot, each query's attention over its keys of that slot's group, and with sinks
    the sink part: outputs [parts][b, h, n, d], lses [parts][b, h, n]."""
    b, h, n, d = q.shape
    top_k = groups_q.shape[-1]
    rows = [x.transpose(1, 2).reshape(b * n, x.shape[1], d) for x in (q, k, v)]
    bucket, order, sizes, starts, before = _buckets(
        groups_q, num_groups, doc_start, segment, documents
    )
    ranges = kernel.ranges
    if ranges or top_k > 1 or sink:
        members_k, members_v = (_gather_rows(x, order) for x in rows[1:])

    def attend_ranges(lo, hi, entries):  # entries: the queries in an order where lo, hi rise
        attend = flex_range_attention if ranges else _range_attention
        out_sorted, lse_sorted = attend(
            _gather_rows(rows[0], entries), members_k, members_v, lo[entries], hi[entries], scale
        )
        return (_scatter_rows(x, entries) for x in (out_sorted, lse_sorted))

    def rising(lo, hi):
        return torch.sort(lo * (b * n + 1) + hi).indices

    outs, lses = [], []
    for slot in range(top_k):
        if slot == 0 and not ranges:
            out, lse = _causal_buckets(rows, order, bucket, sizes, starts, scale)
        else:
            lo, hi = _key_ranges(groups_q, slot, starts, before, segment, num_groups)
            # (slot 0: the bucket order)
            out, lse = attend_ranges(lo, hi, rising(lo, hi) if slot else order)
        outs.append(out)
        lses.append(lse)
    if sink:
        # Non-sink query i against its document's sinks outside its window (p_i - p_j >= w):
        # the first min(s, p_i - w + 1) members of the document's sink bucket (group K - 1).
        position = torch.arange(n, device=q.device) - doc_start  # in the document
        count = (position - window + 1).clamp(0, sink) * (position >= sink)
        lo = starts[segment * num_groups + num_groups - 1].reshape(-1)
        hi = lo + count.reshape(-1)
        out, lse = attend_ranges(lo, hi, rising(lo, hi))
        outs.append(out)
        lses.append(lse)
    return (
        [out.view(b, n, h, d).transpose(1, 2) for out in outs],
        [lse.view(b, n, h).transpose(1, 2) for lse in lses],
    )


# Queries per block of the local part: each block meets the w + B keys ending with it, so
# w / (w + B) of the computed pairs are window pairs (50% with B = w).
_LOCAL_BLOCK = 16


def _local_part(q, k, v, groups_q, segment, window: int, scale: float):
    """Window keys whose top-1 group is not among the query's top-k: O(n (w + B)).

    All sequences are laid end to end, each after F >= w zero positions (F and the sequence
    padded to multiples of B), in one [positions, heads, d] copy; block m's queries are positions
    [mB + F, mB + F + B) and its keys the overlapping window [mB, mB + F + B), a strided view of
    that copy (no copy per block). A mask removes keys out of the window, padding and other
    documents (by `segment`, documents.segments), and keys whose top-1 group is one of the
    query's (the bucket part has those).
    """
    b, h, n, d = q.shape
    block = min(_LOCAL_BLOCK, window)
    front = -(-window // block) * block  # F
    length = front + -(-n // block) * block  # L: one sequence with its padding
    keys = front + block  # per block
    blocks = (b * length - front) // block  # M (the last F / B blocks are the next padding's)

    def laid_out(x, fill=0):  # [b, n, ...] -> [b * L, ...]: each sequence after its padding
        out = x.new_empty((b, length) + x.shape[2:])
        out[:, :front] = fill
        out[:, front + n :] = fill
        out[:, front : front + n] = x
        return out.flatten(0, 1)

    def windows(x, size, offset):  # [b * L, ...] -> [M, size, ...], block m from mB + offset
        strides = x.stride()
        return x.as_strided(
            (blocks, size) + x.shape[1:],
            (block * strides[0],) + strides,
            x.storage_offset() + offset * strides[0],
        )

    def heads_first(x, size, offset):  # [b, heads, n, d] -> [M, heads, size, d]
        return windows(laid_out(x.transpose(1, 2)), size, offset).transpose(1, 2)

    distance = (
        front + torch.arange(block, device=q.device)[:, None] - torch.arange(keys, device=q.device)
    )  # [B, F + B], the same for every block
    same_document = (  # padding: -1 as a key, -2 as a query
        windows(laid_out(segment, -1), keys, 0)[:, None, :]
        == windows(laid_out(segment, -2), block, front)[:, :, None]
    )
    keep = (distance >= 0) & (distance < window) & same_document
    key_top1 = windows(laid_out(groups_q[..., 0], -1), keys, 0)[:, None, :]  # [M, 1, F + B]
    query_groups = windows(laid_out(groups_q, -2), block, front)  # [M, B, top_k]
    for slot in range(query_groups.shape[-1]):  # not the keys in one of the query's buckets
        keep &= query_groups[..., slot, None] != key_top1
    mask = torch.where(
        keep,
        torch.zeros((), dtype=q.dtype, device=q.device),
        torch.full((), float("-inf"), dtype=q.dtype, device=q.device),
    )
    out, lse = attention_with_lse(
        heads_first(q, block, front),
        heads_first(k, keys, 0),
        heads_first(v, keys, 0),
        scale,
        causal=False,
        mask=mask.unsqueeze(1),
    )
    lse = lse.masked_fill(~keep.any(-1).unsqueeze(1), float("-inf"))

    def back(x):  # [M, h, B, ...] -> [b, h, n, ...], a view
        x = x.transpose(1, 2).flatten(0, 1)  # positions F .. b * L of the layout
        # Sequence s's positions are rows [s L, s L + n) here (n <= L - F: inside the rows).
        x = x.as_strided(
            (b, n) + x.shape[1:], (length * x.stride(0),) + x.stride(), x.storage_offset()
        )
        return x.transpose(1, 2)

    return back(out), back(lse)


@torch.no_grad()
def sparse_focus_attention(
    q,
    k,
    v,
    routing: Routing,
    *,
    window: int,
    top_k: int,
    scale: float,
    sink: int = 0,
    kernel: Optional[kernels.Kernel] = None,
):
    """Hard-rule Focus attention computing only kept pairs. q [b,h,n,d], k/v [b,g,n,d]; the
    routing's documents, if any, each attend as alone. `kernel`: the layer's
    kernels.lse_attention (by q's device if None)."""
    kernel = kernel or kernels.lse_attention(q.device)
    b, _, n, _ = q.shape
    groups_q = routing.top(top_k)  # [b, n, top_k], top-1 first
    num_groups = routing.groups.shape[-1]
    doc_start = routing.doc_start
    if doc_start is None:
        doc_start = torch.zeros(b, n, dtype=torch.long, device=q.device)
    sink = min(sink, n)
    if sink:  # the sinks' bucket is group K: their slot 0, and no other query's group
        groups_q = groups_q.clone()
        position = torch.arange(n, device=q.device) - doc_start
        groups_q[..., 0].masked_fill_(position < sink, num_groups)
        num_groups += 1
    segment = segments(doc_start)
    # One document per sequence unless packed: then counting them synchronises with the host.
    documents = b if routing.doc_start is None else int(segment[-1, -1]) + 1
    outs, lses = _bucket_part(
        q, k, v, groups_q, num_groups, doc_start, segment, documents, sink, window, scale, kernel
    )
    if kernel.ranges:  # a GPU: one call over the band
        local_out, local_lse = flex_local_part(q, k, v, groups_q, segment, window, scale)
    else:
        local_out, local_lse = _local_part(q, k, v, groups_q, segment, window, scale)
    out, _ = merge_by_lse(outs + [local_out], [lse.float() for lse in lses + [local_lse]])
    return out.to(q.dtype)
