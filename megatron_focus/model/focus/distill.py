"""The router learns from the attention it serves: distillation, as the systems that ship
learned sparse attention train their selectors (DeepSeek-V3.2's indexer, SeerAttention's gate,
MiniMax's MSA), beside or after a dense warm-up, detached from the language-modelling loss.

A router trained end to end through the soft gate alone ties a frozen random one on text
(docs/routing.md): the gate's gradient says little about which distant keys matter. The
attention says it directly. For query t, the dense causal attention p_tj = softmax_j(q_t . k_j *
scale) (per head, ungated, inside t's document) puts a mass m_t on t's distant keys (those the
gate acts on: outside the window, not sinks); the groups those keys are in, weighted by it,

    M_t = sum_{j distant} p_tj onehot(top1(g_j)) / m_t     (summed over heads, both)

is where t's own assignment g_t should be: at top-1 the hard rule keeps exactly the mass
M_t[top1(g_t)] of its distant keys. The keys count by their top-1 group (the bucket the hard
rule puts them in), not by their soft assignment: against those, every token assigned alike
would be a fixed point (M_t = g_t, a loss of zero, and nothing learned), which the Sinkhorn's
balance does not forbid. The loss is KL(M_t || g_t), averaged over queries weighted by m_t (a
query that attends inside its window has nothing to route). Everything in the target is
detached, and so is the router's input (`FocusAttention` runs the router a second time on the
detached hidden state): the loss trains the routers' W_g and centroids alone, never the model
they serve.

`distant_groups` never holds an n x n tensor: chunks of queries against all keys, as
routing_quality.kept_mass does; heads are summed, so tensor-parallel ranks sum their shares.
"""

import torch

from megatron_focus.model.focus.routing_quality import CHUNK_ELEMENTS

_TINY = 1e-30


def distant_groups(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    window: int,
    scale: float,
    sink: int = 0,
    doc_start=None,
    offset: int = 0,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple:
    """(sum over heads of sum_{j distant} p_tj g_j [b, nq, K], sum over heads of the distant mass
    m_t [b, nq]), in float32, for queries q [b, h, nq, d] at positions [offset, offset + nq)
    against keys k [b, hk, n, d] (hk divides h: GQA) and what the keys carry, g [b, n, K] (their
    top-1 groups, one-hot);
    `doc_start` [b, n]: packed documents, each attending as alone. No gradient."""
    with torch.no_grad():
        b, h, nq, d = q.shape
        hk, n = k.shape[1], k.shape[2]
        dtype = torch.promote_types(q.dtype, torch.float32)
        q = q.to(dtype).reshape(b, hk, h // hk, nq, d)  # a key head's query heads are adjacent
        k = k.to(dtype)[:, :, None]  # [b, hk, 1, n, d]
        g = g.to(dtype)
        pos = torch.arange(n, device=q.device)
        first = pos.new_zeros(b, n) if doc_start is None else doc_start.expand(b, n)
        sums = torch.zeros(b, nq, g.shape[-1], dtype=dtype, device=q.device)
        masses = torch.zeros(b, nq, dtype=dtype, device=q.device)
        rows = max(1, min(nq, chunk_elements // max(1, b * h * n)))
        for start in range(0, nq, rows):
            end = min(start + rows, nq)
            i = pos[offset + start : offset + end]
            doc = first[:, offset + start : offset + end, None]  # [b, c, 1]
            scores = q[..., start:end, :] @ k.transpose(-1, -2) * scale  # [b, hk, r, c, n]
            visible = (pos <= i[:, None]) & (pos >= doc)  # [b, c, n]
            p = scores.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
            distant = visible & (i[:, None] - pos >= window) & (pos >= doc + sink)
            p = (p * distant[:, None, None]).sum((1, 2))  # [b, c, n]: summed over heads
            sums[:, start:end] = p @ g
            masses[:, start:end] = p.sum(-1)
        return sums, masses


def distillation_loss(log_g: torch.Tensor, sums: torch.Tensor, masses: torch.Tensor, heads: int,
                      total_weight=None) -> torch.Tensor:  # fmt: skip
    """KL(M_t || g_t) averaged over queries weighted by their distant mass: log_g [b, nq, K]
    the queries' log-assignments (the router's output, with its gradient), `sums` and `masses`
    `distant_groups`' (summed over `heads` heads). `total_weight`: the weights' sum to divide by
    (default: these queries' own), so that the shares of several context-parallel ranks add up
    to the one process's loss."""
    target = sums / masses.clamp_min(_TINY)[..., None]
    weight = masses / heads
    entropy = torch.xlogy(target, target).sum(-1)  # 0 log 0 = 0
    kl = entropy - (target * log_g.float()).sum(-1)
    total = weight.sum() if total_weight is None else total_weight
    return (weight * kl).sum() / total.clamp_min(_TINY)
