"""How much of the dense attention the hard rule keeps: a direct measure of routing quality.

`pairs-kept` says what the sparse rule costs; it says nothing of what it loses. The kept mass
does: for query i, the sum over the keys the hard top-k rule keeps (local, sinks, and keys whose
top-1 group is among i's top-k groups; groups.py) of the *dense* causal softmax probability
p_ij = softmax_j(q_i . k_j * scale), per head, without any gate. A router that puts each query
with the keys it attends to keeps most of the mass at a small top-k; a router that never learned
keeps about the share of pairs it keeps. Averaged over heads and over the queries beyond the
window (a query within it keeps every key), at every top-k = 1..K at once: each key's top-1
group has a rank in the query's ranking, and the mass at top-k is the cumulative sum, by rank,
of the probabilities of the distant keys plus that of the local keys and the sinks.
"""

import torch

from megatron_focus.model.focus.groups import Routing

# Score elements one chunk of queries holds (fp32: 64 MiB); every query sees every key
CHUNK_ELEMENTS = 2**24


def kept_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    routing: Routing,
    window: int,
    scale: float,
    sink: int = 0,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """[K]: the mean share of the dense attention's probability mass the hard rule keeps at
    top-k = 1..K (1 where no query is beyond the window).

    q [b, h, nq, d]: the last nq positions of the sequence; k [b, hk, n, d] (hk divides h, GQA),
    both as the layer attends them (after RoPE); `routing` of all n tokens, its `doc_start`
    packed documents, each attending as alone (its own keys, its first `sink` tokens the sinks).
    Computed by chunks of queries against all keys: no [n, n] score matrix is ever held."""
    b, h, nq, d = q.shape
    hk, n = k.shape[1], k.shape[2]
    groups = routing.groups  # [b, n, K], top-1 first
    num_groups = groups.shape[-1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    q = q.to(dtype).reshape(b, hk, h // hk, nq, d)  # a key head's query heads are consecutive
    k = k.to(dtype)[:, :, None]  # [b, hk, 1, n, d]
    pos = torch.arange(n, device=q.device)
    first = pos.new_zeros(b, n) if routing.doc_start is None else routing.doc_start.expand(b, n)
    in_doc = pos - first
    # rank[b, i, g]: where group g stands in token i's ranking
    rank = torch.empty_like(groups).scatter_(
        -1, groups, torch.arange(num_groups, device=groups.device).expand_as(groups)
    )
    key_top1 = groups[..., 0]
    key_sink = in_doc < sink  # [b, n]
    total = torch.zeros(num_groups, dtype=dtype, device=q.device)
    count = torch.zeros((), dtype=dtype, device=q.device)
    rows = max(1, min(nq, chunk_elements // max(1, b * h * n)))
    for start in range(n - nq, n, rows):
        end = min(start + rows, n)
        i = pos[start:end]
        c = end - start
        scores = q[..., start - (n - nq) : end - (n - nq), :] @ k.transpose(-1, -2) * scale
        visible = (pos <= i[:, None]) & (pos >= first[:, start:end, None])  # [b, c, n]
        p = scores.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
        distant = (i[:, None] - pos >= window) & ~key_sink[:, None, :]  # [b, c, n]
        key_rank = rank[:, start:end].gather(-1, key_top1[:, None, :].expand(b, c, n))
        # local keys and sinks count from top-1 on (keys not visible carry no probability)
        key_rank = key_rank.masked_fill(~distant, 0)
        by_rank = torch.zeros(p.shape[:-1] + (num_groups,), dtype=dtype, device=q.device)
        by_rank.scatter_add_(-1, key_rank[:, None, None].expand(p.shape), p)
        beyond = (in_doc[:, start:end] >= window).to(dtype)  # [b, c]
        total += (by_rank.cumsum(-1) * beyond[:, None, None, :, None]).sum((0, 1, 2, 3))
        count += beyond.sum() * h
    return torch.where(count > 0, total / count.clamp(min=1), torch.ones_like(total))
