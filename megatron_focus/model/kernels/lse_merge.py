"""Softmax attention over disjoint key sets, merged exactly by log-sum-exp, and the merge's
backward: the math the sparse path (focus_sparse.py) trains through.

With parts p of one query's keys, each giving (O_p, L_p), the merged output is
O = sum_p exp(L_p - L) O_p with L = logaddexp_p L_p. Its backward needs no part's own output: a
pair's probability in the union is exp(S - L) with the merged L, so each part's attention
backward run with the merged output and log-sum-exp (D = rowsum(dO * O)) gives that part's
exact share of the gradients, as ring attention does (`attention_backward`). A kernel that
can only take its own output and log-sum-exp but differentiates the latter (FlexAttention) gets
the same gradients from `part_gradients`.
"""

import torch


def merge_by_lse(outputs, lses):
    """Exact softmax over the union of disjoint key sets, from each set's output and log-sum-exp.

    outputs: list of [b, h, n, d]; lses: list of [b, h, n] (-inf where a set was empty). One
    interpolation per set, the running output towards the set's by the set's share of the mass;
    in float32 at least (float64 stays float64).
    """
    dtype = torch.promote_types(lses[0].dtype, torch.float32)
    out, lse = outputs[0].to(dtype), lses[0].to(dtype)
    for part_out, part_lse in zip(outputs[1:], lses[1:]):
        total = torch.logaddexp(lse, part_lse.to(dtype))
        share = torch.exp(part_lse - total).nan_to_num(0.0)  # both empty so far: nan -> 0
        out, lse = torch.lerp(out, part_out.to(dtype), share.unsqueeze(-1)), total
    return out, lse


def part_gradients(d_out, out, lse, part_out, part_lse):
    """The gradients of one part's (output, log-sum-exp) from the merged output's gradient:
    (w dO, w (rowsum(dO * O_p) - rowsum(dO * O))) with w = exp(L_p - L) its share, 0 where the
    part was empty. Given to a kernel that differentiates its log-sum-exp, they make it compute
    exp(S - L) (dO V^T - rowsum(dO * O)), as `attention_backward` does."""
    share = torch.exp(part_lse - lse).nan_to_num_(0.0)
    d_out = d_out.to(out.dtype)
    rowsum = (d_out * (part_out.to(out.dtype) - out)).sum(-1)
    return (share.unsqueeze(-1) * d_out).to(part_out.dtype), (share * rowsum).to(part_lse.dtype)


def attention_backward(d_out, q, k, v, out, lse, scale: float, causal: bool, mask=None):
    """dq, dk, dv of softmax attention given the output and log-sum-exp it is part of (the
    merged ones), by explicit scores: dS = P (dO V^T - rowsum(dO * O)), P = exp(S - L). kv
    heads may be fewer than q heads (GQA); `mask` additive, broadcastable to the scores."""
    given, dtype = q.dtype, torch.promote_types(q.dtype, torch.float32)
    groups, rep = k.shape[1], q.shape[1] // k.shape[1]
    q, k, v, d_out, out = (x.to(dtype) for x in (q, k, v, d_out, out))
    k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    if causal:
        nq, nk = scores.shape[-2:]
        future = torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = torch.exp(scores - lse.to(dtype).unsqueeze(-1))
    d_scores = probs * (d_out @ v.transpose(-1, -2) - (d_out * out).sum(-1, keepdim=True))
    dq = d_scores @ k * scale
    dk, dv = d_scores.transpose(-1, -2) @ q * scale, probs.transpose(-1, -2) @ d_out

    def per_group(x):  # the rep query heads of a group sum into its key/value head
        return x.unflatten(1, (groups, rep)).sum(2).to(given)

    return dq.to(given), per_group(dk), per_group(dv)
