"""Sparse (hard top-k) Focus attention that computes only the kept pairs: local + group buckets.

The hard rule (focus_gate.hard_pair_mask) keeps, for query i, the local keys i - w < j <= i and
the keys whose top-1 group is among i's top-k groups. It is split into disjoint parts, each an
ordinary attention call, merged exactly by per-query log-sum-exp weights:

* bucket part, one per top-k slot s. The keys of all groups of all documents are laid out in
  bucket order: tokens stably sorted by (document, top-1 group), positions increasing inside a
  bucket (a sequence is one document, or several packed ones: documents.py). Query i's keys for
  slot s are then one contiguous range of that layout: the members of i's s-th ranked group
  (groups.py) before it in its document (and i itself for its own top-1 group), `_key_ranges`.
  Slot 0 is plain causal attention over each bucket: on the CPU all buckets packed into one
  call, q, k, v each gathered once into the padded [buckets, longest] layout (by strips of
  queries where buckets are short: there the CPU kernel's causal mode skips little); on CUDA
  one varlen call over the bucket boundaries (torch's varlen flash kernel,
  kernels.varlen_causal_attention) where its inputs fit and each sequence is one document.
  Other slots, and slot 0 elsewhere on a GPU, attend their ranges: FlexAttention in one call
  with a block mask made from the ranges (flex.flex_range_attention), or on the CPU blocks of
  queries against their blocks' key ranges (`_range_attention`). Work is the kept pairs, not the
  bucket's square: a token that only queries a bucket adds no keys to it.
* local part: the window keys whose top-1 group is *not* among the query's top-k (the others are
  in a bucket already), by query blocks of B = 64 against the w + B keys ending with them,
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
synchronises with the host for the longest bucket and the key ranges' bounds, a GPU not at all.
Everything taken from the routing (buckets, key ranges, the ranges' block masks) is one pure
function of tensors (`_route`), which a GPU runs as one compiled region per layer call instead
of some 20-180 small kernels; the backward reuses it.

It trains too, the routing frozen (its groups are a hard choice, with no gradient): the parts
and their merge are one autograd function (`_SparseAttention`) whose backward runs each part's
attention backward with the merged output and log-sum-exp (lse_merge), the CPU flash kernel's
backward on the CPU; FlexAttention, which differentiates its log-sum-exp but takes no given
output, recomputes its calls in backward; the varlen kernel's backward takes the merged output
and log-sum-exp as the CPU's does. The layouts' gathers are differentiated by autograd.
"""

import bisect
import dataclasses
import functools
import time
import warnings
from typing import Callable, NamedTuple, Optional

import torch

from megatron_focus import platform
from megatron_focus.model.documents import segments
from megatron_focus.model.focus.focus_gate import attention_with_lse
from megatron_focus.model.focus.groups import Routing, top1_onehot
from megatron_focus.model.kernels import flex, graphs, kernels
from megatron_focus.model.kernels.lse_merge import merge_by_lse, part_gradients


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
    positions increasing), the buckets' sizes, where each starts in that order (and the end),
    and [b, n, K] how many members each group has in the token's document before it."""
    bucket = (segment * num_groups + groups_q[..., 0]).reshape(-1)
    order = torch.sort(bucket, stable=True).indices
    # Counted by a scatter of known size: bincount would synchronise with the host for its size.
    sizes = bucket.new_zeros(documents * num_groups).index_add_(0, bucket, torch.ones_like(bucket))
    onehot = top1_onehot(groups_q, num_groups)
    before = onehot.cumsum(1) - onehot  # in the sequence, then less those before the document
    before -= before.gather(1, doc_start[..., None].expand_as(before))
    return bucket, order, sizes, torch.nn.functional.pad(torch.cumsum(sizes, 0), (1, 0)), before


def _key_ranges(groups_q, slot: int, starts, before, segment, num_groups: int):
    """[lo, hi) of each token's slot-`slot` keys in bucket order, [b * n] each: the members of
    the token's slot-th ranked group before it in its document, and the token itself in its own
    (top-1) group."""
    group = groups_q[..., slot : slot + 1]
    lo = starts[segment * num_groups + group[..., 0]]
    return lo.reshape(-1), (lo + before.gather(-1, group)[..., 0] + (slot == 0)).reshape(-1)


class _Range(NamedTuple):
    """Queries `entries` (token rows, in an order where their key ranges rise) against the keys
    [lo, hi) of the bucket order; `blocks`: the ranges' block-mask indices (flex.range_blocks)
    where the kernel attends ranges in one call."""

    entries: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    blocks: Optional[tuple]


class _Route(NamedTuple):
    """What the parts take from the routing (`_route`)."""

    groups_q: torch.Tensor  # [b, n, top_k], top-1 first; the sinks' top-1 is group K
    segment: torch.Tensor  # [b, n], documents.segments
    bucket: torch.Tensor  # [b * n], each token's
    order: torch.Tensor  # the token rows in bucket order
    sizes: torch.Tensor  # [buckets]
    starts: torch.Tensor  # [buckets], where each bucket starts in bucket order
    cu_seqlens: torch.Tensor  # [buckets + 1] int32, the starts and the end (varlen's)
    ranges: tuple  # a _Range per top-k slot from `first_slot`, then the sinks' (sink > 0)
    bits: torch.Tensor  # [2, b * n]: each token's groups as a bit mask, its top-1 group's bit


def _route(
    groups_q,
    doc_start: Optional[torch.Tensor],
    num_groups: int,
    documents: int,
    sink: int,
    window: int,
    first_slot: int,
    blocks: bool,
) -> _Route:
    """The buckets, and the key ranges of the slots from `first_slot` and of the sinks: tensors
    only, with no host synchronisation where `documents` is a bound (a GPU: one compiled region,
    `_compiled_route`). groups_q [b, n, top_k] top-1 first, doc_start [b, n] or None (one
    document per sequence); `blocks`: with the ranges' block-mask indices (FlexAttention)."""
    b, n, top_k = groups_q.shape
    if doc_start is None:
        doc_start = groups_q.new_zeros(b, n)
    position = torch.arange(n, device=groups_q.device) - doc_start  # in the document
    if sink:  # the sinks' bucket is group K: their slot 0, and no other query's group
        groups_q = _sinks_as_group(groups_q, position, num_groups, sink)
        num_groups += 1
    segment = segments(doc_start)
    bucket, order, sizes, bounds, before = _buckets(
        groups_q, num_groups, doc_start, segment, documents
    )
    starts = bounds[:-1]

    def ranged(lo, hi, entries):
        lo, hi = lo[entries], hi[entries]
        return _Range(entries, lo, hi, flex.range_blocks(lo, hi, b * n) if blocks else None)

    def rising(lo, hi):
        return torch.sort(lo * (b * n + 1) + hi).indices

    ranges = []
    for slot in range(first_slot, top_k):
        lo, hi = _key_ranges(groups_q, slot, starts, before, segment, num_groups)
        ranges.append(ranged(lo, hi, rising(lo, hi) if slot else order))  # slot 0: bucket order
    if sink:
        # Non-sink query i against its document's sinks outside its window (p_i - p_j >= w):
        # the first min(s, p_i - w + 1) members of the document's sink bucket (group K - 1).
        count = (position - window + 1).clamp(0, sink) * (position >= sink)
        lo = starts[segment * num_groups + num_groups - 1].reshape(-1)
        hi = lo + count.reshape(-1)
        ranges.append(ranged(lo, hi, rising(lo, hi)))
    cu_seqlens = bounds.to(torch.int32)
    return _Route(
        groups_q, segment, bucket, order, sizes, starts, cu_seqlens, tuple(ranges),
        _group_bits(groups_q),
    )  # fmt: skip


def _sinks_as_group(groups_q, position, num_groups: int, sink: int):
    """The sinks' top-1 group is a group of their own, K."""
    top1 = groups_q[..., 0].masked_fill(position < sink, num_groups)
    return torch.cat([top1[..., None], groups_q[..., 1:]], -1)


def _group_bits(groups_q, also: int = 0):
    """[2, b * n] int64: each token's groups as a bit mask (as a query; `also` OR-ed in), and
    its top-1 group's bit (as a key). The groups of a token are distinct."""
    bit = torch.ones_like(groups_q) << groups_q
    return torch.stack([bit.sum(-1) | also, bit[..., 0]]).reshape(2, -1)


def _rule_bits(groups_q, doc_start, num_groups: int, sink: int):
    """The bits of the whole rule as one part: the sinks a group of their own that every query
    keeps (as `_route` lays them out, with no sort)."""
    if sink:
        n = groups_q.shape[1]
        position = torch.arange(n, device=groups_q.device)
        if doc_start is not None:
            position = position - doc_start
        return _group_bits(_sinks_as_group(groups_q, position, num_groups, sink), 1 << num_groups)
    return _group_bits(groups_q)


@functools.lru_cache(maxsize=2)
def _compiled_route(backend: str = "inductor"):
    platform.setup()  # raises dynamo's recompile limit (platform.RECOMPILE_LIMIT)
    # One graph (the tests trace it with fullgraph: a host synchronisation would break it), its
    # sizes symbolic: one compile per K, top-k and documents-or-not serves every length, where
    # an evaluation or a benchmark sweeping lengths would otherwise pay one compile each. Not
    # fullgraph here: past the recompile limit it falls back to eager.
    return torch.compile(_route, dynamic=True, backend=backend)


def _routed(device: torch.device, *inputs) -> _Route:
    """`_route(*inputs)`, compiled on a GPU. Should the compiler fail there (a torch whose
    inductor cannot lower one of its ops), the routing runs eagerly from then on, said once: the
    same results, at some 25-130 more launches per layer."""
    global _compile_failed
    if kernels.compiled(device) and not _compile_failed:
        try:
            return _compiled_route()(*inputs)
        except Exception as e:  # the eager call below raises what is not the compiler's
            _compile_failed = True
            warnings.warn(f"sparse Focus: compiling the routing failed, running it eagerly ({e})")
    return _route(*inputs)


_compile_failed = False


@dataclasses.dataclass(frozen=True)
class _Part:
    """One attention call of the sparse path, on rows ([b * n, heads, ...], token order): where
    its queries and keys come from, the call, and the call's backward given the merged output
    and log-sum-exp (in the call's layout). Parts that lay their keys out alike share the same
    `keys` function: the keys are laid out once."""

    queries: Callable  # rows -> the call's queries (q; d_out, out and lse in backward)
    keys: Callable  # rows -> the call's keys (k, v)
    rows: Callable  # the call's per-query results -> rows
    attend: Callable  # (q, k, v) -> (out, lse), lse -inf where a query has no key
    gradients: Callable  # (d_out, q, k, v, out, lse) -> (dq, dk, dv)


class _Layouts(dict):
    """Each layout function's result for a tensor, computed once."""

    def of(self, function, which: int, x):
        if (function, which) not in self:
            self[function, which] = function(x)
        return self[function, which]


class _SparseAttention(torch.autograd.Function):
    """The parts merged by log-sum-exp, as one autograd function: its backward runs each part's
    attention backward with the merged output and log-sum-exp (lse_merge), so no part's output
    is kept, and no gradient has to pass through a kernel's log-sum-exp (most give none)."""

    @staticmethod
    def forward(ctx, q, k, v, parts):
        rows = [_rows(x) for x in (q, k, v)]
        laid = _Layouts()
        outs, lses = [], []
        for part in parts:
            out, lse = part.attend(
                laid.of(part.queries, 0, rows[0]),
                laid.of(part.keys, 1, rows[1]),
                laid.of(part.keys, 2, rows[2]),
            )
            outs.append(part.rows(out))
            lses.append(part.rows(lse))
        del laid
        out, lse = merge_by_lse(outs, lses)
        out = out.to(q.dtype)
        ctx.parts = parts
        ctx.save_for_backward(q, k, v, out, lse)
        return out.view(q.shape[0], q.shape[2], *out.shape[1:]).transpose(1, 2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [_rows(x).detach().requires_grad_() for x in (q, k, v)]
            laid = _Layouts()
            for part in ctx.parts:
                laid.of(part.queries, 0, leaves[0])
                for which in (1, 2):
                    laid.of(part.keys, which, leaves[which])
        given, grads = _Layouts(), {}
        for part in ctx.parts:
            inputs = [laid[part.queries, 0], laid[part.keys, 1], laid[part.keys, 2]]
            merged = [given.of(part.queries, i, x) for i, x in enumerate((_rows(d_out), out, lse))]
            part_grads = part.gradients(
                merged[0], *(x.detach() for x in inputs), merged[1], merged[2]
            )
            for key, grad in zip(((part.queries, 0), (part.keys, 1), (part.keys, 2)), part_grads):
                grads[key] = grads[key] + grad if key in grads else grad
        keys = list(grads)
        dq, dk, dv = torch.autograd.grad(
            [laid[key] for key in keys], leaves, [grads[key] for key in keys]
        )
        return (*(_unrows(g, q.shape[0]) for g in (dq, dk, dv)), None)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[b, heads, n, ...] -> [b * n, heads, ...]"""
    return x.transpose(1, 2).flatten(0, 1)


def _unrows(x: torch.Tensor, b: int) -> torch.Tensor:
    """[b * n, heads, ...] -> [b, heads, n, ...], a view"""
    return x.unflatten(0, (b, -1)).transpose(1, 2)


def _recomputed(attend):
    """The backward of a call whose kernel differentiates its log-sum-exp but takes no given
    output (FlexAttention): the call again, given the merge's gradients of its output and
    log-sum-exp (lse_merge.part_gradients)."""

    def gradients(d_out, q, k, v, out, lse):
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_() for x in (q, k, v)]
            part_out, part_lse = attend(*inputs)
            return torch.autograd.grad(
                (part_out, part_lse), inputs, part_gradients(d_out, out, lse, part_out, part_lse)
            )

    return gradients


def _causal_buckets(route: _Route, scale, dtype) -> _Part:
    """Slot 0 on the CPU: causal attention inside each bucket, all buckets in one padded layout,
    one causal call, or by strips where the buckets are short (`_STRIPS_BELOW`)."""
    order, bucket, sizes, starts = route.order, route.bucket, route.sizes, route.starts
    num_buckets = sizes.numel()
    longest = int(sizes.max())  # a host synchronisation
    # Token order[i] goes to place `packed_at[i]` of the [buckets * longest] layout; the places
    # after a bucket's tokens (padding) read token 0: as keys they come after every real query
    # of their bucket (causal), as queries they are never read back (and get no gradient).
    sorted_bucket = bucket[order]
    packed_at = (
        sorted_bucket * longest
        + torch.arange(order.numel(), device=order.device)
        - starts[sorted_bucket]
    )
    source = order.new_zeros(num_buckets * longest).index_copy_(0, packed_at, order)
    back = torch.empty_like(packed_at).index_copy_(0, order, packed_at)  # token -> its place
    real = (torch.arange(longest, device=order.device) < sizes[:, None])[:, None, :, None]

    def packed(x):  # rows -> [buckets, heads, longest, ...]
        return _gather_rows(x, source).view((num_buckets, longest) + x.shape[1:]).transpose(1, 2)

    def rows(x):
        return _gather_rows(x.transpose(1, 2).flatten(0, 1), back)

    if longest < _STRIPS_BELOW:  # place r's keys: places [0, r]
        places = torch.arange(longest, device=order.device)
        strips = functools.partial(
            _range_blocks, torch.zeros_like(places), places + 1, dtype, _STRIP
        )
        attend = functools.partial(_ranges_attention, blocks=strips, scale=scale)
        backward = functools.partial(_ranges_gradients, blocks=strips, scale=scale)
    else:
        attend = functools.partial(attention_with_lse, scale=scale, causal=True)
        backward = functools.partial(kernels.cpu_attention_backward, scale=scale, causal=True)

    def gradients(d_out, q, k, v, out, lse):
        return backward(d_out * real.to(d_out.dtype), q, k, v, out, lse)  # not the padding's

    return _Part(packed, packed, rows, attend, gradients)


# Slot 0 on the CPU attends by strips of _STRIP queries against all keys up to their last (the
# diagonal block masked) where its buckets are shorter than this. The fused kernel's causal mode
# computes whole blocks of 512 keys, so up to 512 tokens it costs as much as full attention.
# Strips cost 0.70-0.85x the causal call up to 512 tokens, 0.8-1.0x from 576 to 704 and
# 1.0-1.1x from 768 on (benchmarks/attention_kernel.py, "strips / causal", 2 runs).
_STRIPS_BELOW = 768
_STRIP = 64

# Queries per kernel call of `_range_attention`: each call computes its block's queries against
# the union of their key ranges, so a larger block wastes more (the ranges' staircase) and a
# smaller one makes more calls.
_RANGE_BLOCK = 256


def _block_bounds(lo, firsts: list, block: int):
    """[start, end) of each block of `_ranges_attention`: `block` queries, ended early where a
    bucket starts (lo moves) a block's worth of keys or more past the block's first lo, keys
    that the later queries would compute and discard."""
    moves = (torch.nonzero(lo[1:] != lo[:-1]).flatten() + 1).tolist()
    start = 0
    while start < len(firsts):
        end = min(start + block, len(firsts))
        inside = moves[bisect.bisect_right(moves, start) : bisect.bisect_left(moves, end)]
        end = next((m for m in inside if firsts[m] - firsts[start] >= block), end)
        yield start, end
        start = end


def _range_blocks(lo, hi, dtype, block: int):
    """(queries, keys, additive mask) of each block of `_ranges_attention`: the block's queries
    against the keys from its first lo to its last hi, the rest of each range masked."""
    firsts, lasts = lo.tolist(), hi.tolist()  # a host synchronisation
    for start, end in _block_bounds(lo, firsts, block):
        first, last = firsts[start], lasts[end - 1]
        if last <= first:
            continue
        # Every query of the block keeps the keys from its last lo to its first hi: only the
        # columns outside that span need comparing.
        mask = torch.zeros(end - start, last - first, dtype=dtype, device=lo.device)
        inner = (firsts[end - 1] - first, lasts[start] - first)
        for cols in (range(0, inner[0]), range(max(inner), last - first)):
            keys = torch.arange(first + cols.start, first + cols.stop, device=lo.device)
            kept = (keys >= lo[start:end, None]) & (keys < hi[start:end, None])
            mask[:, cols.start : cols.stop].masked_fill_(~kept, float("-inf"))
        yield slice(start, end), slice(first, last), mask[None, None]


def _ranges_attention(q, k, v, blocks: Callable, scale: float):
    """Queries against key ranges on the CPU, the same for each sequence of a batch, by blocks
    of queries, each against a view of the keys (`blocks()`: the blocks as `_range_blocks`
    yields them).

    q [b, h, E, d], k/v [b, groups, M, d] -> (out [b, h, E, d], lse [b, h, E]). A query in no
    block gets lse -inf; one whose range is empty inside a block gets the kernel's 0.
    """
    out = q.new_zeros(q.shape)
    # float32 at least, as the kernel gives it: a bf16 log-sum-exp would blur the merge's weights
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=lse_dtype, device=q.device)
    for queries, keys, mask in blocks():
        out[..., queries, :], lse[..., queries] = attention_with_lse(
            q[..., queries, :], k[..., keys, :], v[..., keys, :], scale, causal=False, mask=mask
        )
    return out, lse


def _ranges_gradients(d_out, q, k, v, out, lse, blocks: Callable, scale: float):
    """dq, dk, dv of `_ranges_attention` given the merged output and log-sum-exp."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for queries, keys, mask in blocks():
        grads = kernels.cpu_attention_backward(
            *(x[..., queries, :] for x in (d_out, q)),
            *(x[..., keys, :] for x in (k, v)),
            out[..., queries, :],
            lse[..., queries],
            scale,
            causal=False,
            mask=mask,
        )
        for total, place, grad in zip((dq, dk, dv), (queries, keys, keys), grads):
            total[..., place, :] += grad
    return dq, dk, dv


def _heads(x):  # [rows, heads, ...] -> [1, heads, rows, ...], the layout of one kernel call
    return x.transpose(0, 1)[None]


def _unheads(x):  # [1, heads, rows, ...] -> [rows, heads, ...]
    return x[0].transpose(0, 1)


def _range_attention(q, k, v, blocks: Callable, empty, scale: float):
    """`_ranges_attention` on rows: q [E, h, d], k/v [M, groups, d] -> out [E, h, d], lse [E, h],
    -inf where `empty` (the queries whose range is empty)."""
    out, lse = _ranges_attention(*(_heads(x) for x in (q, k, v)), blocks, scale)
    return _unheads(out), _unheads(lse).masked_fill(empty[:, None], float("-inf"))


def _range_gradients(d_out, q, k, v, out, lse, blocks: Callable, scale: float):
    """dq, dk, dv of `_range_attention`, on rows."""
    inputs = (_heads(x) for x in (d_out, q, k, v, out, lse))
    return tuple(map(_unheads, _ranges_gradients(*inputs, blocks, scale)))


def _varlen_buckets(route: _Route, longest: int, members, scale) -> _Part:
    """Slot 0 on CUDA: causal attention inside each bucket, one varlen call over the buckets in
    bucket order (`longest`: a bound on a bucket's size, so no host synchronisation)."""
    cu_seqlens = route.cu_seqlens
    return _Part(
        members,
        members,
        functools.partial(_scatter_rows, index=route.order),
        functools.partial(
            kernels.varlen_causal_attention, cu_seqlens=cu_seqlens, max_len=longest, scale=scale
        ),
        functools.partial(
            kernels.varlen_causal_backward, cu_seqlens=cu_seqlens, max_len=longest, scale=scale
        ),
    )


def _bucket_parts(route: _Route, n: int, scale, dtype, kernel, varlen: bool) -> list:
    """Per top-k slot, each query's attention over its keys of that slot's group, and with sinks
    the sink part. `varlen`: slot 0 as one varlen call (one document per sequence)."""

    def members(x):  # rows -> the keys in bucket order
        return _gather_rows(x, route.order)

    def ranged_part(ranged: _Range) -> _Part:
        lo, hi = ranged.lo, ranged.hi
        if kernel.ranges:
            attend = functools.partial(
                flex.flex_range_attention, lo=lo, hi=hi, scale=scale, blocks=ranged.blocks
            )
            gradients = _recomputed(attend)
        else:
            # Made again in backward: kept, the masks of all blocks would be O(n^2 / K) a layer.
            blocks = functools.partial(_range_blocks, lo, hi, dtype, _RANGE_BLOCK)
            attend = functools.partial(_range_attention, blocks=blocks, empty=hi <= lo, scale=scale)
            gradients = functools.partial(_range_gradients, blocks=blocks, scale=scale)
        return _Part(
            functools.partial(_gather_rows, index=ranged.entries),
            members,
            functools.partial(_scatter_rows, index=ranged.entries),
            attend,
            gradients,
        )

    if not kernel.ranges:
        slot0 = [_causal_buckets(route, scale, dtype)]
    elif varlen:
        slot0 = [_varlen_buckets(route, n, members, scale)]
    else:
        slot0 = []  # the first of route.ranges
    return slot0 + [ranged_part(ranged) for ranged in route.ranges]


# Queries per block of the local part: each block meets the F + B keys ending with it (F: w
# rounded up to B), so a larger B computes more pairs outside the window (w / (w + B) of them
# are window pairs), and a smaller one lays each key out in more blocks' windows: (w + B) / B
# copies of the keys' gradients in backward. 64 costs least in a training step on the CPU
# (benchmarks/focus_sparse_speed.py --train, 4K to 16K) and as little as 16 in the forward.
_LOCAL_BLOCK = 64


class _Windows(torch.autograd.Function):
    """[rows, ...] -> [windows, size, ...]: window m is rows [m B + offset, m B + offset + size),
    a strided view (windows overlap when size > B). Its backward adds each of the size / B
    row blocks of every window back in one shifted slice each, where autograd's as_strided
    backward would scatter element by element."""

    @staticmethod
    def forward(ctx, x, windows: int, block: int, size: int, offset: int):
        ctx.rows, ctx.block, ctx.offset = x.shape[0], block, offset
        strides = x.stride()
        return x.as_strided(
            (windows, size) + x.shape[1:],
            (block * strides[0],) + strides,
            x.storage_offset() + offset * strides[0],
        )

    @staticmethod
    def backward(ctx, grad):
        windows, size = grad.shape[:2]
        block, start = ctx.block, ctx.offset
        out = grad.new_zeros((ctx.rows,) + grad.shape[2:])
        for shift in range(0, size, block):  # the rows `shift` into every window
            rows = out[start + shift : start + shift + windows * block]
            rows.view((windows, block) + rows.shape[1:]).add_(grad[:, shift : shift + block])
        return out, None, None, None, None


def _local_part(groups_q, segment, window: int, scale: float, dtype) -> _Part:
    """Window keys whose top-1 group is not among the query's top-k: O(n (w + B)).

    All sequences are laid end to end, each after F >= w zero positions (F and the sequence
    padded to multiples of B), in one [positions, heads, d] copy; block m's queries are positions
    [mB + F, mB + F + B) and its keys the overlapping window [mB, mB + F + B), a strided view of
    that copy (no copy per block). A mask removes keys out of the window, padding and other
    documents (by `segment`, documents.segments), and keys whose top-1 group is one of the
    query's (the bucket part has those).
    """
    b, n, _ = groups_q.shape
    device = groups_q.device
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
        return _Windows.apply(x, blocks, block, size, offset)

    def heads_first(x, size, offset):  # rows -> [M, heads, size, ...]
        return windows(laid_out(x.unflatten(0, (b, n))), size, offset).transpose(1, 2)

    def rows(x):  # [M, h, B, ...] -> rows
        x = x.transpose(1, 2).flatten(0, 1)  # positions F .. b * L of the layout
        # Sequence s's positions are rows [s L, s L + n) here (n <= L - F: inside the rows).
        x = x.as_strided(
            (b, n) + x.shape[1:], (length * x.stride(0),) + x.stride(), x.storage_offset()
        )
        return x.flatten(0, 1)

    distance = (
        front + torch.arange(block, device=device)[:, None] - torch.arange(keys, device=device)
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
        torch.zeros((), dtype=dtype, device=device),
        torch.full((), float("-inf"), dtype=dtype, device=device),
    ).unsqueeze(1)
    empty = ~keep.any(-1).unsqueeze(1)

    def attend(q, k, v):
        out, lse = attention_with_lse(q, k, v, scale, causal=False, mask=mask)
        return out, lse.masked_fill(empty, float("-inf"))

    def gradients(d_out, q, k, v, out, lse):
        return kernels.cpu_attention_backward(d_out, q, k, v, out, lse, scale, False, mask)

    return _Part(
        functools.partial(heads_first, size=block, offset=front),
        functools.partial(heads_first, size=keys, offset=0),
        rows,
        attend,
        gradients,
    )


def _flex_local_part(groups_q, segment, window: int, scale: float) -> _Part:
    """The local part on a GPU: one FlexAttention call over the band (flex.flex_local_part)."""
    b = groups_q.shape[0]
    attend = functools.partial(
        flex.flex_local_part, groups_q=groups_q, segment=segment, window=window, scale=scale
    )
    heads = functools.partial(_unrows, b=b)
    return _Part(heads, heads, _rows, attend, _recomputed(attend))


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
    kernels.lse_attention (by q's device if None). Gradients reach q, k and v, not the routing
    (its groups are a hard choice)."""
    kernel = kernel or kernels.lse_attention(q.device)
    if kernel.fused and not _fused_failed and routing.groups.shape[-1] < _FUSED_GROUPS:
        try:
            return _fused(q, k, v, routing, window, top_k, scale, sink, kernel)
        except Exception as e:  # noqa: BLE001 -- a compiler's failure; the parts' path remains
            _fused_failed_once(e)
        kernel = kernels.lse_attention(q.device)
    with torch.no_grad():
        parts = _parts(routing, q, window, top_k, scale, sink, kernel)
    return _SparseAttention.apply(q, k, v, parts)


_fused_failed = False
_FUSED_GROUPS = 62  # the fused kernel's bit masks: K groups and the sinks' in 63 bits


def _fused_failed_once(error: Exception):
    """A GPU whose Triton cannot compile the fused kernel: the parts' path from then on, said
    once (the same results, more launches). Under the interpreter (tests) errors are raised."""
    global _fused_failed
    if kernels.triton_interpreted():
        raise error
    _fused_failed = True
    warnings.warn(f"sparse Focus: the fused Triton kernel failed, attending by its parts from "
                  f"now on ({error})")  # fmt: skip


def _fused(q, k, v, routing: Routing, window, top_k, scale, sink, kernel):
    """The hard rule by the fused kernel (triton_sparse): the band, then each top-k slot's
    ranges and the sinks', merged in its epilogues; or, where that measured slower for this
    shape, the whole rule as one part (`_dense_is_faster`). On a GPU, a shape whose forward is
    mostly the host's time (`_host_bound`) is replayed as a CUDA graph once it repeats
    (graphs.py): routing and launches at once; in training its forward and its backward."""
    from megatron_focus.model.kernels import triton_sparse  # imports Triton

    b, _, n, _ = q.shape
    sink = min(sink, n)
    groups = routing.groups.shape[-1]

    def routed(dense: bool, top, doc_start) -> tuple:  # the kernel's parts, docs and bits
        with torch.no_grad():
            if dense:
                parts = [triton_sparse.Part(rule=True)]
                bits = _rule_bits(top, doc_start, groups, sink)
            else:
                route = _routed(q.device, top, doc_start, groups, b * n, sink, window, 0, False)
                parts = [triton_sparse.Part()] + [
                    triton_sparse.Part(r.entries, r.lo, r.hi, route.order) for r in route.ranges
                ]
                bits = route.bits
        return parts, None if doc_start is None else doc_start.contiguous(), bits

    def call(dense: bool, q, k, v, top, doc_start):
        return kernel(q, k, v, *routed(dense, top, doc_start), window=window, scale=scale)

    tensors = (q, k, v, routing.top(top_k), routing.doc_start)
    dense = _dense_is_faster(q, k, routing, top_k, sink, lambda dense: call(dense, *tensors))
    if not _host_bound(q, k, routing, top_k, sink):
        return call(dense, *tensors)
    settings = (dense, window, scale, sink, groups, kernel)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        plan = functools.partial(_plan, functools.partial(routed, dense), window, scale)
        addressable = (triton_sparse.addressable(t) for t in (q, k, v))
        return _GraphedTraining.apply(*addressable, *tensors[3:], plan, settings)
    return _GRAPHS(functools.partial(call, dense), tensors, settings)


def _plan(routed: Callable, window: int, scale: float, q, k, top, doc_start):
    """The fused kernel's launches for these inputs, their routing made on the device."""
    from megatron_focus.model.kernels import triton_sparse

    parts, docs, bits = routed(top, doc_start)
    return triton_sparse.planned(q, k, parts, docs, bits, window=window, scale=scale)


class _GraphedTraining(torch.autograd.Function):
    """The fused kernel in training at a shape bound by the host: its forward (routing and
    launches) one CUDA graph, its backward another (the routing made again inside it rather
    than kept: a few small kernels, where the device waits for the host anyway). The results
    are the eager call's, bit for bit (the same kernels on the same inputs)."""

    @staticmethod
    def forward(ctx, q, k, v, top, doc_start, plan: Callable, settings: tuple):
        from megatron_focus.model.kernels import triton_sparse

        def forward(q, k, v, top, doc_start):
            return triton_sparse.attend(q, k, v, plan(q, k, top, doc_start))

        out, lse = _GRAPHS(forward, (q, k, v, top, doc_start), ("forward", *settings))
        ctx.save_for_backward(q, k, v, top, doc_start, out, lse)
        ctx.plan, ctx.settings = plan, settings
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        from megatron_focus.model.kernels import triton_sparse

        plan = ctx.plan

        def backward(grad, q, k, v, top, doc_start, out, lse):
            return triton_sparse.gradients(grad, q, k, v, out, lse, plan(q, k, top, doc_start))

        grad = triton_sparse.addressable(grad)
        tensors = (grad, *ctx.saved_tensors)
        dq, dk, dv = _GRAPHS(backward, tensors, ("backward", *ctx.settings))
        return dq, dk, dv, None, None, None, None


_GRAPHS = graphs.Graphs()  # the fused kernel's calls bound by the host, by shape
# A forward measured under this (CUDA events, `_dense_is_faster`) is mostly the host's time:
# graphed. A longer one's host runs ahead of the device, and its graph would only add the
# copies into its buffers and hold memory.
GRAPH_BELOW_MS = 1.0


def _host_bound(q, k, routing, top_k, sink) -> bool:
    """Whether this shape's forward, as timed when its way was chosen, is worth a CUDA graph."""
    measured = _DENSE_FASTER.get(_shape_key(q, k, routing, top_k, sink))
    return measured is not None and measured[1] < GRAPH_BELOW_MS


# by shape: (whether the whole rule in one part measured faster, the faster one's ms)
_DENSE_FASTER: dict = {}


def _octave(n: int) -> int:
    """The power of two at or above n: the lengths that share a timing (a model's prefill meets
    every prompt length, and each timing costs some 8 forwards)."""
    return 1 << max(n - 1, 0).bit_length()


def _shape_key(q, k, routing, top_k, sink) -> tuple:
    """A shape whose way is timed, its length by `_octave`."""
    b, heads, n, d = q.shape
    return (b, heads, _octave(n), d, k.shape[1], q.dtype, top_k, routing.groups.shape[-1],
            sink > 0, routing.doc_start is not None)  # fmt: skip


def _dense_is_faster(q, k, routing, top_k, sink, call) -> bool:
    """Whether the masked rule in one part (dense work, one launch a pass) beats the sparse
    parts at this shape: timed once on a GPU (forward, median of 3 after a warm-up, as cuDNN's
    benchmark mode chooses) for the lengths up to the next power of two, said once; elsewhere
    (the interpreter) the sparse parts."""
    b, n = q.shape[0], q.shape[2]
    shape = _shape_key(q, k, routing, top_k, sink)
    if shape not in _DENSE_FASTER:
        if not kernels.compiled(q.device):
            return False
        times = {
            dense: _median_ms(lambda dense=dense: call(dense), q.device) for dense in (False, True)
        }
        chosen = times[True] < times[False]
        _DENSE_FASTER[shape] = chosen, times[chosen]
        name = {True: "the masked rule in one call", False: "the sparse parts"}
        _say(
            f"sparse Focus at {n} tokens, kept for {_octave(n) // 2 + 1} to {_octave(n)} "
            f"(batch {b}, top-{top_k}): {name[chosen]} ({times[chosen]:.2f} ms a forward) "
            f"over {name[not chosen]} ({times[not chosen]:.2f} ms)"
        )
    return _DENSE_FASTER[shape][0]


def _say(line: str):
    """One line, from the first rank only."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_rank() == 0:
        print(line, flush=True)


def _median_ms(run, device: torch.device, repeats: int = 3) -> float:
    """The median time of `run()` after a warm-up: by CUDA events on a GPU, the wall clock
    elsewhere."""
    with torch.no_grad():
        run()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                began = time.perf_counter()
                run()
                times.append((time.perf_counter() - began) * 1e3)
    return sorted(times)[len(times) // 2]


def _parts(routing, q, window, top_k, scale, sink, kernel) -> list:
    """The bucket parts and the local part of the hard rule, from the routing."""
    b, _, n, _ = q.shape
    # One document per sequence unless packed. Then a GPU takes a bound (every token its own
    # document: empty buckets cost a few integers each), where counting them would synchronise
    # with the host; the CPU's padded slot-0 call needs the count.
    if routing.doc_start is None:
        documents = b
    else:
        documents = b * n if kernel.ranges else int(segments(routing.doc_start)[-1, -1]) + 1
    # Varlen needs no host synchronisation with one document per sequence (b * K buckets of at
    # most n tokens); packed documents keep FlexAttention's ranges, which need none either.
    varlen = kernel.varlen and routing.doc_start is None and kernels.varlen_fits(q)
    route = _routed(
        q.device,
        routing.top(top_k),
        routing.doc_start,
        routing.groups.shape[-1],
        documents,
        min(sink, n),
        window,
        0 if kernel.ranges and not varlen else 1,  # the slots attended as ranges
        kernel.ranges,
    )
    parts = _bucket_parts(route, n, scale, q.dtype, kernel, varlen)
    if kernel.ranges:  # a GPU: one call over the band
        return parts + [_flex_local_part(route.groups_q, route.segment, window, scale)]
    return parts + [_local_part(route.groups_q, route.segment, window, scale, q.dtype)]
