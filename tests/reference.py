"""Dense references the tests compare Focus against, written out independently of the package.

Every reference decides pair by pair (or with one dense mask) and computes in fp64; none calls
the code under test. The group ranking here is its own: a group's rank is the number of groups
with a larger assignment plus the number of equal ones with a lower index (the tie rule of
megatron_focus/model/focus/groups.py, by counting instead of sorting).
"""

import torch


def reference_ranking(log_g: torch.Tensor) -> torch.Tensor:
    """[..., K] group indices, by decreasing assignment, ties to the lowest index (by counting)."""
    value, other = log_g[..., :, None], log_g[..., None, :]  # [..., K (this), K (other)]
    index = torch.arange(log_g.shape[-1])
    lower = index[None, :] < index[:, None]  # other's index below this one's
    rank = ((other > value) | ((other == value) & lower)).sum(-1)  # [..., K], a permutation
    return torch.empty_like(rank).scatter_(-1, rank, index.expand_as(rank))


def reference_focus(q, k, v, log_g, window, gate_scale, top_k, scale, gate="log", sink=0):
    """Dense causal attention with the Focus rule; which pairs are which is decided pair by pair.
    `gate="sigmoid"`: the paper's gate, distant logits times sigmoid(lambda g_i . g_j); `sink`:
    the first tokens are local to every query."""
    b, h, n, d = q.shape
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    local = torch.zeros(b, n, n, dtype=torch.bool)
    distant = torch.zeros(b, n, n, dtype=torch.bool)  # distant pairs the rule keeps
    for bi in range(b):
        ranked = reference_ranking(log_g[bi].detach()).tolist() if top_k else None
        for i in range(n):
            for j in range(i + 1):
                if i - j < window or j < sink:
                    local[bi, i, j] = True
                else:
                    distant[bi, i, j] = top_k is None or ranked[j][0] in ranked[i][:top_k]
    g = log_g.double().exp()
    affinity = torch.einsum("bik,bjk->bij", g, g)
    scores = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) * scale
    if gate == "sigmoid":
        scores = torch.where(
            distant[:, None], scores * (gate_scale * affinity).sigmoid()[:, None], scores
        )
        log_gate = 0.0
    else:
        log_gate = gate_scale * affinity.log() if top_k is None else 0.0
    bias = torch.where(local, 0.0, torch.where(distant, log_gate, float("-inf")))
    scores = scores + bias[:, None]
    return (scores.softmax(-1) @ v.double()).to(q.dtype)


def dense_hard_rule(q, k, v, log_g, window, top_k, scale, sink=0, doc_start=None):
    """The hard rule as one masked softmax over all pairs (fp64). `doc_start` [b, n]: packed
    documents, each attending as alone (its keys from its start, its own first `sink`)."""
    n = q.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    ranked = reference_ranking(log_g.detach().cpu()).to(q.device)
    tops = ranked[..., :top_k]
    pos = torch.arange(n, device=q.device)
    first = torch.zeros(1, n, dtype=torch.long) if doc_start is None else doc_start
    first = first[:, :, None]  # [b, n (query), 1]
    distance = pos[:, None] - pos[None, :]
    same = (tops[:, :, None, :] == ranked[:, None, :, :1]).any(-1)  # key's top-1 in query's top-k
    sinks = pos[None, None, :] < first + sink
    keep = (distance >= 0) & ((distance < window) | same | sinks) & (pos[None, None, :] >= first)
    scores = torch.einsum("bhid,bhjd->bhij", q.double(), k) * scale
    scores = scores.masked_fill(~keep[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).to(q.dtype)


def assignments(b, n, groups, gen, how="random"):
    """Log-assignments [b, n, K] of a kind that stresses the dispatch (raw, unbalanced ones are
    allowed): "random"; "one-group" (every token's top-1 is group 0); "lonely" (group 1 holds
    one token per sequence); and exact ties: "uniform" (every row uniform), "duplicated"
    (groups 2j and 2j + 1 equal in every row), "coarse" (values from a few levels: ties
    everywhere, between any groups)."""
    scores = torch.randn(b, n, groups, generator=gen)
    if how == "random":
        scores = scores * 3
    elif how == "one-group":
        scores[..., 0] += 100
    elif how == "lonely":
        scores[..., 0] += 50
        scores[:, n // 2, 1] += 200
    elif how == "uniform":
        scores = torch.zeros(b, n, groups)
    elif how == "duplicated":
        scores = scores[..., ::2].repeat_interleave(2, -1)[..., :groups]
    elif how == "coarse":
        scores = torch.randint(0, 3, (b, n, groups), generator=gen).float()
    else:
        raise ValueError(how)
    return torch.log_softmax(scores, -1)
