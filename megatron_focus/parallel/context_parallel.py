"""Context parallelism: one sequence split over C ranks, in Megatron's layout.

Each sequence is cut in 2C chunks; rank r holds chunks r and 2C - 1 - r, so every rank has as
much causal attention to compute as any other (Megatron-Core's `get_batch_on_this_cp_rank`
slices the batch so, and its rotary embedding the positions). What crosses ranks:

* keys and values: all-gathered in sequence order before attention (the Llama-3 scheme); the
  gather's backward sums each rank's gradient back to the rank that holds the token;
* Focus's assignments of the keys (K per token), gathered the same way, and the document starts;
* the causal Sinkhorn's prefix masses: an exclusive scan across chunks. Each iteration every rank
  all-gathers its two chunks' summaries (their masses since the last document start in them,
  K numbers per sequence, and whether a document starts there); each chunk then adds the masses
  of the chunks before it, back to the start of its tokens' document (chunk_carries). Its backward
  is the reverse scan, through the gather's autograd (the fused kernels' backward calls it as
  such).

Everything here is a pure function of tensors and a process group, but `batch_on_this_rank`.
"""

import inspect
from typing import List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_batch_on_this_cp_rank


def batch_on_this_rank(batch: dict) -> dict:
    """This rank's chunks of every sequence of the batch, cut by Megatron-Core (its 0.18 added
    hybrid context parallelism's `is_hybrid_cp`, and from 0.19 no group means the world's)."""
    group = parallel_state.get_context_parallel_group()
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(batch, cp_group=group)


def chunk_ids(rank: int, size: int) -> tuple:
    """The two chunks (of 2 x size, in sequence order) that context-parallel rank `rank` holds."""
    return rank, 2 * size - 1 - rank


def positions(local_length: int, rank: int, size: int, device=None) -> torch.Tensor:
    """[local_length] positions in the sequence of a rank's tokens (its two chunks, in order)."""
    chunk = local_length // 2
    return torch.cat(
        [torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunk_ids(rank, size)]
    )


def gather_sequence(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The whole sequence, in order, from every rank's two chunks of `x` along `dim`. With a
    gradient, the backward returns each rank the gradient of its own chunks, summed over ranks."""
    parts = _AllGather.apply(x, group) if x.requires_grad else _all_gather(x, group)
    return torch.cat(_in_order([part.chunk(2, dim=dim) for part in parts]), dim=dim)


def _all_gather(x: torch.Tensor, group) -> list:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


class _AllGather(torch.autograd.Function):
    """Every rank's `x`; the backward sums each part's gradient over the ranks and returns each
    rank its own part's (an all-reduce: gloo has no reduce-scatter, and torch's differentiable
    all-gather emulates it with scatters that address group ranks as global ones)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return tuple(_all_gather(x, group))

    @staticmethod
    def backward(ctx, *grads):
        stacked = torch.stack(grads)
        dist.all_reduce(stacked, group=ctx.group)
        return stacked[dist.get_rank(ctx.group)], None


def _in_order(per_rank: list) -> list:
    """Every rank's (first, second) chunk, as the sequence's chunks in order."""
    size = len(per_rank)
    chunks: List[Optional[torch.Tensor]] = [None] * (2 * size)
    for rank, pair in enumerate(per_rank):
        for chunk, part in zip(chunk_ids(rank, size), pair):
            chunks[chunk] = part
    return chunks


def chunk_carries(values: torch.Tensor, through: torch.Tensor, group, reverse=False):
    """An exclusive scan across the sequence's chunks, in order (reverse: from the last): what
    flows into each of this rank's two chunks from the others.

    `values` [2, b, K]: what each of this rank's chunks passes on (the causal Sinkhorn's
    forward: its prefix masses at its last token, counted from its start or from its last
    document start; its backward: the gradients' suffix sums at its first token, to its first
    document end); `through` [2, b] (bool): whether what flows into the chunk flows on past it
    (no document starts in it; reverse: its first token's document goes on past it). Returns
    [2, b, K]: what each of this rank's chunks adds to its tokens whose document began before it
    (reverse: goes on past it).
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    flags = _in_order(_all_gather(through, group))
    parts = _in_order(_AllGather.apply(values, group))
    order = range(2 * size - 1, -1, -1) if reverse else range(2 * size)
    carries = {}
    flowing = torch.zeros_like(values[0])
    for chunk in order:
        carries[chunk] = flowing
        flowing = parts[chunk] + flowing * flags[chunk].to(values.dtype)[..., None]
    return torch.stack([carries[c] for c in chunk_ids(rank, size)])
