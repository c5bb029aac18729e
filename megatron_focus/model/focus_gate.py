"""Which (query, key) pairs Focus keeps, and causal attention with that rule, chunked.

Pair rule, for query i and key j <= i (positions), window w, log-assignments log g:

* local, i - w < j <= i: the pair keeps its logit;
* soft (training): a distant pair gets `+ lambda * log(g_i . g_j)`, a log-space gate: an affinity
  of 0 removes the pair exactly, as the hard rule does (the paper's `q.k * sigmoid(lambda a)` gives
  a removed pair logit 0, which still takes softmax weight);
* hard (sparse inference): a distant pair is kept iff j's top-1 group is among i's top-k groups,
  so every key sits in exactly one group bucket and no pair is counted twice.

`focus_attention` evaluates the rule over query chunks against the keys up to each chunk's end and
recomputes each chunk in backward, so no n x n tensor outlives one chunk: memory is linear in n at
a fixed chunk size.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# g_i . g_j is a dot product of two distributions: below this it is 0 for every purpose, and the
# clamp keeps log() and its gradient finite.
_TINY_AFFINITY = 1e-30


def top_groups(log_g: torch.Tensor, top_k: int) -> torch.Tensor:
    """[..., n, top_k] group indices, most likely first (index 0 is the token's top-1 group)."""
    return log_g.topk(top_k, dim=-1).indices


def _causal_local(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int):
    distance = q_pos[:, None] - k_pos[None, :]
    return distance >= 0, distance < window


def soft_pair_bias(log_g_q: torch.Tensor, log_g_k: torch.Tensor, q_pos: torch.Tensor,
                   k_pos: torch.Tensor, window: int, gate_scale: float) -> torch.Tensor:
    """Additive logit bias [b, nq, nk]: 0 local, lambda * log(g_i . g_j) distant, -inf future."""
    affinity = torch.bmm(log_g_q.exp(), log_g_k.exp().transpose(1, 2))
    log_gate = gate_scale * affinity.clamp_min(_TINY_AFFINITY).log()
    causal, local = _causal_local(q_pos, k_pos, window)
    bias = torch.where(local, torch.zeros((), dtype=log_gate.dtype, device=log_gate.device),
                       log_gate)
    return bias.masked_fill(~causal, float("-inf"))


def hard_pair_mask(groups_q: torch.Tensor, top1_k: torch.Tensor, q_pos: torch.Tensor,
                   k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Kept pairs [b, nq, nk] (bool): causal and (local, or key's top-1 group in query's top-k)."""
    causal, local = _causal_local(q_pos, k_pos, window)
    same_group = (groups_q[:, :, None, :] == top1_k[:, None, :, None]).any(-1)
    return causal & (local | same_group)


def _attend_chunk(q, k, v, log_g_q, log_g_k, start: int, window: int, gate_scale: float,
                  top_k: Optional[int], scale: float, dropout_p: float, gqa: bool):
    """Queries [start, start + nq) against keys [0, nk) under the soft or (top_k given) hard rule."""
    nq, nk = q.shape[2], k.shape[2]
    q_pos = torch.arange(start, start + nq, device=q.device)
    k_pos = torch.arange(nk, device=q.device)
    if top_k is None:
        bias = soft_pair_bias(log_g_q, log_g_k, q_pos, k_pos, window, gate_scale)
        mask = bias.to(q.dtype).unsqueeze(1)
    else:
        groups_q = top_groups(log_g_q, top_k)
        top1_k = top_groups(log_g_k, 1)[..., 0]
        mask = hard_pair_mask(groups_q, top1_k, q_pos, k_pos, window).unsqueeze(1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )


def focus_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_g: torch.Tensor, *,
                    window: int, gate_scale: float, top_k: Optional[int], chunk_size: int,
                    scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal Focus attention. q [b, h, n, d], k/v [b, groups, n, d], log_g [b, n, K] -> [b, h, n, d].

    `top_k=None` is the soft (training) rule; an integer applies the hard rule with that top-k.
    """
    n = q.shape[2]
    gqa = q.shape[1] != k.shape[1]
    log_g = log_g.float()
    outputs = []
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        args = (q[:, :, start:end], k[:, :, :end], v[:, :, :end], log_g[:, start:end],
                log_g[:, :end], start, window, gate_scale, top_k, scale, dropout_p, gqa)
        if torch.is_grad_enabled():
            # Recompute in backward: only this chunk's scores ever exist at once.
            outputs.append(checkpoint(_attend_chunk, *args, use_reentrant=False))
        else:
            outputs.append(_attend_chunk(*args))
    return torch.cat(outputs, dim=2)
