"""Which (query, key) pairs Focus keeps, and causal attention with that rule, chunked.

Pair rule, for query i and key j <= i (positions), window w, sink s, log-assignments log g:

* local, i - w < j <= i, or a sink, j < s (the first s tokens, `--focus-sink-tokens`, visible to
  every query): the pair keeps its logit;
* soft (training): a distant pair gets `+ lambda * log(g_i . g_j)`, a log-space gate: an affinity
  of 0 removes the pair exactly, as the hard rule does. The paper's gate, `q.k * sigmoid(lambda
  g_i . g_j)`, is an option for ablations (`gate="sigmoid"`): it gives a removed pair logit 0,
  which still takes softmax weight, and an unrelated pair half its logit;
* hard (sparse mode): a distant pair is kept iff j's top-1 group is among i's top-k groups
  (ranked by groups.rank_groups, ties to the lowest index), so every key sits in exactly one
  group bucket and no pair is counted twice.

With packed documents (`Routing.doc_start`, documents.py) a pair is causal only inside one
document, and the sinks are each document's first s tokens: every document attends as it would
alone (its assignments restart too, sinkhorn.py).

`focus_attention` evaluates the rule over query chunks against the keys up to each chunk's end, so
no n x n tensor outlives one chunk: memory is linear in n at a fixed chunk size. The soft rule
without dropout runs as `_SoftFocusAttention`, flash-attention style: the fused kernel and its
log-sum-exp forward, each chunk's probabilities rebuilt from them in backward. Otherwise (dropout,
or the hard rule, which sparse mode computes by its kept pairs (focus_sparse.py) except under
context parallelism) each chunk is a masked SDPA call recomputed in backward. On a GPU
the soft rule runs fused instead: a Triton kernel (triton_gate.py), or a FlexAttention
`score_mod` (flex.py).
"""

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron_focus.model.focus.groups import Routing
from megatron_focus.model.kernels import kernels
from megatron_focus.model.kernels.flex import TINY_AFFINITY
from megatron_focus.variants import FOCUS_GATES

# The soft rule's kernels (kernels.soft_gate): the fused Triton one, FlexAttention's, or the
# chunked one below. Its gates on distant pairs (FOCUS_GATES): ours in log space, or the
# paper's one.


def _causal_local(q_pos, k_pos, window: int, sink: int = 0, doc_start=None):
    """(causal, local) [nq, nk]: local is the window, i - w < j, or a sink key, j < s.

    With the queries' document starts [b, nq]: [b, nq, nk], causal only inside the query's
    document, and the sinks its document's first s tokens.
    """
    distance = q_pos[:, None] - k_pos[None, :]
    if doc_start is None:
        return distance >= 0, (distance < window) | (k_pos[None, :] < sink)
    first = doc_start[..., None]
    return (distance >= 0) & (k_pos >= first), (distance < window) | (k_pos < first + sink)


def _near_diagonal(start: int, end: int, window: int, device, sink: int = 0, doc_start=None):
    """For queries [start, end) against keys [0, end): the first key `edge` that is in a window or
    in the future for some query (every key before it is causal for all of them, and distant
    unless a sink: keys [0, min(sink, edge)) are the sinks there), and the (causal, local) masks
    of keys [edge, end). With documents (the queries' starts), every key is masked: edge 0."""
    edge = 0 if doc_start is not None else max(0, start - window + 1)
    causal, local = _causal_local(
        torch.arange(start, end, device=device),
        torch.arange(edge, end, device=device),
        window,
        sink,
        doc_start,
    )
    return edge, causal, local


def log_gate(
    affinity: torch.Tensor,
    start: int,
    window: int,
    gate_scale: float,
    sink: int = 0,
    doc_start=None,
) -> torch.Tensor:
    """Additive logit bias [b, c, e] of queries [start, start + c) against keys [0, e) from their
    affinities g_i . g_j: lambda * log(affinity) distant, 0 local (window or sink), -inf future
    (or another document's: `doc_start`, the queries' [b, c] document starts)."""
    bias = affinity.clamp_min(TINY_AFFINITY).log_().mul_(gate_scale)
    edge, causal, local = _near_diagonal(
        start, affinity.shape[1] + start, window, affinity.device, sink, doc_start
    )
    bias[:, :, edge:].masked_fill_(local, 0.0).masked_fill_(~causal, float("-inf"))
    bias[:, :, : min(sink, edge)] = 0.0
    return bias


def soft_pair_bias(
    log_g_q: torch.Tensor,
    log_g_k: torch.Tensor,
    start: int,
    window: int,
    gate_scale: float,
    sink: int = 0,
    doc_start=None,
) -> torch.Tensor:
    """The soft rule's bias [b, c, e] for queries [start, start + c) against keys [0, e)."""
    affinity = torch.bmm(log_g_q.exp(), log_g_k.exp().transpose(1, 2))
    return log_gate(affinity, start, window, gate_scale, sink, doc_start)


def sigmoid_gate(
    log_g_q: torch.Tensor, log_g_k: torch.Tensor, local: torch.Tensor, gate_scale: float
) -> torch.Tensor:
    """The paper's gate, a factor [b, c, e] on the logits: sigmoid(lambda * g_i . g_j) distant,
    1 local (causality is the caller's mask)."""
    affinity = torch.bmm(log_g_q.exp(), log_g_k.exp().transpose(1, 2))
    return torch.where(local, 1.0, torch.sigmoid(gate_scale * affinity))


def hard_pair_mask(
    groups_q: torch.Tensor,
    top1_k: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    window: int,
    sink: int = 0,
    doc_start=None,
) -> torch.Tensor:
    """Kept pairs [b, nq, nk] (bool): causal and (local or a sink, or key's top-1 group in
    query's top-k); `doc_start`: the queries' document starts."""
    causal, local = _causal_local(q_pos, k_pos, window, sink, doc_start)
    same_group = (groups_q[:, :, None, :] == top1_k[:, None, :, None]).any(-1)
    return causal & (local | same_group)


def attention_with_lse(q, k, v, scale: float, causal: bool, mask=None):
    """(output, log-sum-exp) of softmax attention; kv heads may be fewer than q heads (GQA).

    `mask`: additive float mask broadcastable to the scores (-inf removes a pair). Beware: for a
    query with no key left, the CPU kernel returns output 0 with log-sum-exp 0 (FlexAttention:
    -inf).
    """
    return kernels.lse_attention(q.device)(q, k, v, scale, causal, mask)


def _soft_chunk(
    q,
    k,
    v,
    log_g_q,
    log_g_k,
    start: int,
    window: int,
    sink: int,
    gate_scale: float,
    scale: float,
    dropout_p: float,
    gqa: bool,
    gate: str,
    doc_start,
):
    """Queries [start, start + nq) against keys [0, nk) under the soft rule."""
    if gate == "sigmoid":  # a factor on the logits: explicit scores
        causal, local = _causal_local(
            torch.arange(start, start + q.shape[2], device=q.device),
            torch.arange(k.shape[2], device=q.device),
            window,
            sink,
            doc_start,
        )
        if gqa:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        logits = (q @ k.transpose(-1, -2)).float().mul_(scale) * sigmoid_gate(
            log_g_q, log_g_k, local, gate_scale
        ).unsqueeze(1)
        probs = logits.masked_fill_(~causal.unsqueeze(-3), float("-inf")).softmax(-1)
        return F.dropout(probs, dropout_p).to(v.dtype) @ v
    mask = soft_pair_bias(log_g_q, log_g_k, start, window, gate_scale, sink, doc_start)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask.to(q.dtype).unsqueeze(1),
        dropout_p=dropout_p,
        scale=scale,
        enable_gqa=gqa,
    )


def _hard_chunk(
    q,
    k,
    v,
    groups_q,
    top1_k,
    start: int,
    window: int,
    sink: int,
    scale: float,
    dropout_p: float,
    gqa: bool,
    doc_start,
):
    """Queries [start, start + nq) (top-k groups `groups_q`) against keys [0, nk) (top-1 groups
    `top1_k`) under the hard rule."""
    mask = hard_pair_mask(
        groups_q,
        top1_k,
        torch.arange(start, start + q.shape[2], device=q.device),
        torch.arange(k.shape[2], device=q.device),
        window,
        sink,
        doc_start,
    ).unsqueeze(1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )


def focus_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    routing: Routing,
    *,
    window: int,
    gate_scale: float,
    top_k: Optional[int],
    chunk_size: int,
    scale: float,
    dropout_p: float = 0.0,
    kernel: Union[str, kernels.Kernel] = "auto",
    gate: str = "log",
    sink: int = 0,
    offset: int = 0,
) -> torch.Tensor:
    """Causal Focus attention. q [b, h, n, d], k/v [b, groups, n, d], routing's tensors [b, n, K]
    (and its documents) -> [b, h, n, d]. With an `offset` (context parallelism's chunks), the
    queries are positions [offset, offset + nq) of the keys' sequence, k/v [b, groups, offset +
    nq, d], and the routing covers the keys.

    `top_k=None` is the soft (training) rule, with `gate` (FOCUS_GATES) on distant pairs, by
    `kernel` (the layer's kernels.soft_gate, or a name to choose one by); an integer applies the
    hard rule with that top-k, by masked chunks. The first `sink` tokens are kept for every
    query, as local pairs are.
    """
    if gate not in FOCUS_GATES:
        raise ValueError(f"unknown Focus gate {gate!r}; choose from {FOCUS_GATES}")
    log_g, doc_start = routing.log_g.float(), routing.doc_start
    if top_k is None:
        if isinstance(kernel, str):
            kernel = kernels.soft_gate(
                kernel, q.device, dropout_p, chunk_size, head_dim=q.shape[-1], dtype=q.dtype
            )
        if torch.is_grad_enabled() and not kernel.backward:
            raise ValueError(
                f"the {kernel.name} soft-gate kernel has no backward on {q.device.type}: "
                "--focus-kernel auto or chunked"
            )
        dropout = {"dropout_p": dropout_p} if kernel.dropout else {}
        return kernel(
            q,
            k,
            v,
            log_g,
            window=window,
            gate_scale=gate_scale,
            scale=scale,
            gate=gate,
            sink=sink,
            doc_start=doc_start,
            **dropout,
            **({"offset": offset} if offset else {}),
        )
    groups_q, top1 = routing.top(top_k), routing.groups[..., 0]

    def rule(start, end, docs):
        settings = (start, window, sink, scale, dropout_p, q.shape[1] != k.shape[1], docs)
        return _hard_chunk, (groups_q[:, start:end], top1[:, :end]) + settings

    return _by_chunks(q, k, v, rule, chunk_size, doc_start, offset)


def chunked_soft_focus(
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
    doc_start=None,
    dropout_p: float = 0.0,
    chunk_size: int = 128,
    offset: int = 0,
):
    """The soft rule by query chunks (the CPU's kernel, and any with dropout): flash-style with
    a recomputing backward for the log gate without dropout; otherwise each chunk's masked SDPA
    call, recomputed in backward. The sigmoid gate has no fused CPU kernel: its chunks build
    their scores explicitly (an ablation's speed)."""
    if gate == "log" and dropout_p == 0.0 and torch.is_grad_enabled():
        return _SoftFocusAttention.apply(
            q, k, v, log_g, window, gate_scale, chunk_size, scale, sink, doc_start, offset
        )

    def rule(start, end, docs):
        settings = (window, sink, gate_scale, scale, dropout_p, q.shape[1] != k.shape[1], gate)
        return _soft_chunk, (log_g[:, start:end], log_g[:, :end], start) + settings + (docs,)

    return _by_chunks(q, k, v, rule, chunk_size, doc_start, offset)


def _by_chunks(q, k, v, rule, chunk_size: int, doc_start, offset: int = 0):
    """Queries by chunks against the keys up to each chunk's end; `rule(start, end, docs)` gives
    a chunk's function and its arguments after q, k, v, for the chunk's positions [start, end)
    (the queries are positions [offset, offset + nq))."""
    outputs = []
    for start, end in _chunks(q.shape[2], chunk_size):
        first, last = offset + start, offset + end
        docs = None if doc_start is None else doc_start[:, first:last]
        attend, args = rule(first, last, docs)
        args = (q[:, :, start:end], k[:, :, :last], v[:, :, :last]) + args
        if torch.is_grad_enabled():
            # Recompute in backward: only this chunk's scores ever exist at once.
            outputs.append(checkpoint(attend, *args, use_reentrant=False))
        else:
            outputs.append(attend(*args))
    return torch.cat(outputs, dim=2)


def _chunks(n: int, chunk_size: int):
    for start in range(0, n, chunk_size):
        yield start, min(start + chunk_size, n)


class _SoftFocusAttention(torch.autograd.Function):
    """Soft-gate Focus attention with a chunked, recomputing backward (dropout 0).

    Backward, per query chunk c against keys [0, end): P = exp(S + bias - lse), the usual
    dV += P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K scale, dK += dS^T Q scale; the
    bias gets dS summed over heads, and through bias = lambda * log(G_q G_k^T) on distant pairs
    the assignments get d log g = G * (dA G), dA = lambda * dbias / A.
    """

    @staticmethod
    def forward(
        ctx, q, k, v, log_g, window, gate_scale, chunk_size, scale, sink, doc_start, offset
    ):
        n = q.shape[2]
        outs, lses = [], []
        for start, end in _chunks(n, chunk_size):
            first, last = offset + start, offset + end  # the chunk's positions
            bias = soft_pair_bias(
                log_g[:, first:last],
                log_g[:, :last],
                first,
                window,
                gate_scale,
                sink,
                None if doc_start is None else doc_start[:, first:last],
            )
            out, lse = attention_with_lse(
                q[:, :, start:end],
                k[:, :, :last],
                v[:, :, :last],
                scale,
                causal=False,
                mask=bias.to(q.dtype).unsqueeze(1),
            )
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, log_g, out, lse)
        ctx.settings = (window, gate_scale, chunk_size, scale, sink, offset)
        ctx.doc_start = doc_start  # not a tensor autograd tracks (integers)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, log_g, out, lse = ctx.saved_tensors
        # Megatron hands q, k, v as permuted views of [s, b, heads, d] (saved as such: no extra
        # memory between forward and backward): one copy each here, not one per chunk and matmul.
        q, k, v, grad_out = (t.contiguous() for t in (q, k, v, grad_out))
        window, gate_scale, chunk_size, scale, sink, offset = ctx.settings
        b, h, n, d = q.shape
        groups = k.shape[1]
        rep = h // groups

        # Query heads as [b * kv group, rep * positions, d]: a group's heads share its keys, so
        # every product is one batched matmul and dK, dV sum over the group's heads by
        # themselves (no repeated keys). The softmax scale is applied to dQ and dK at the end;
        # each [.., c, e] tensor is built by a matmul that also subtracts, then updated in place.
        def grouped(t):  # [b, h, n, ...] -> [b * groups, rep, n, ...]
            return t.float().unflatten(1, (groups, rep)).flatten(0, 1)

        qg, og, lse_g = grouped(q), grouped(grad_out), grouped(lse)
        delta = (og * grouped(out)).sum(-1)  # [b * g, rep, n]
        kf, vf = k.float().flatten(0, 1), v.float().flatten(0, 1)  # [b * g, n, d]
        dq = torch.empty_like(qg)
        dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
        g = log_g.exp()
        dg = torch.zeros_like(g)
        for start, end in _chunks(n, chunk_size):
            c = end - start
            first, last = offset + start, offset + end  # the chunk's positions
            docs = None if ctx.doc_start is None else ctx.doc_start[:, first:last]
            affinity = torch.bmm(g[:, first:last], g[:, :last].transpose(1, 2))  # [b, c, e]
            bias = log_gate(affinity, first, window, gate_scale, sink, docs)
            qc, go = (x[:, :, start:end].flatten(1, 2) for x in (qg, og))  # [b * g, rep * c, d]
            kc, vc = kf[:, :last], vf[:, :last]
            # P = exp(scale * Q K^T - lse + bias); dS = P * (dO V^T - delta)
            probs = torch.baddbmm(
                -lse_g[:, :, start:end].reshape(-1, rep * c, 1), qc, kc.transpose(1, 2), alpha=scale
            )
            probs.view(b, groups * rep, c, last).add_(bias[:, None]).exp_()
            dscores = torch.baddbmm(
                -delta[:, :, start:end].reshape(-1, rep * c, 1), go, vc.transpose(1, 2)
            ).mul_(probs)
            dv[:, :last].baddbmm_(probs.transpose(1, 2), go)
            del probs
            dq[:, :, start:end] = torch.bmm(dscores, kc).view(-1, rep, c, d)
            dk[:, :last].baddbmm_(dscores.transpose(1, 2), qc)
            # d affinity = lambda * d bias / affinity on distant pairs above the clamp, else 0
            daffinity = dscores.view(b, groups * rep, c, last).sum(1).mul_(gate_scale)
            del dscores
            daffinity.div_(affinity).masked_fill_(affinity <= TINY_AFFINITY, 0.0)
            edge, causal, local = _near_diagonal(first, last, window, q.device, sink, docs)
            daffinity[:, :, edge:].masked_fill_(local | ~causal, 0.0)
            daffinity[:, :, : min(sink, edge)] = 0.0
            dg[:, first:last] += torch.bmm(daffinity, g[:, :last])
            dg[:, :last] += torch.bmm(daffinity.transpose(1, 2), g[:, first:last])
        dq = dq.mul_(scale).view(b, h, n, d)
        dk, dv = dk.mul_(scale).view(k.shape), dv.view(v.shape)
        return (
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            (dg * g).to(log_g.dtype),
            *(None,) * 7,
        )
