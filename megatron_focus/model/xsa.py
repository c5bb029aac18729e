"""XSA, exclusive self attention (arXiv 2603.09078): remove from each head's output its own value.

Per head and token, `z = y - (y . v_hat) v_hat` with `v_hat = v / max(||v||, eps)`: the attention
output `y` keeps only what is orthogonal to the token's own value vector, so a head cannot spend
its output on copying the token to itself. No parameters, and it acts per head before heads are
merged, so tensor parallelism (heads split over ranks) and sequence parallelism (the sequence is
whole inside core attention) need nothing more.
"""

import torch

from megatron_focus import platform
from megatron_focus.model.core_attention import CoreAttention
from megatron_focus.model.kernels import kernels


def exclusive_projection(y: torch.Tensor, v: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`y` `[b, heads, s, hn]` minus its component along `v` `[b, groups, s, hn]`, per head.

    Megatron orders a rank's query heads group by group (its fused QKV is `[q.., k, v]` per group,
    and its DotProductAttention `repeat_interleave`s keys/values), so head h uses group
    h // (heads / groups). Viewing the heads as `[groups, heads per group]` and broadcasting `v`
    over the second axis does that without materialising repeated values. Half precision is
    computed in fp32 (the dot product sums hn products) and returned in the input dtype.

    Written as `y - (y . v) / max(||v||, eps)^2 * v`, the same thing, so that what autograd keeps
    for the backward is `y`, `v` (which attention keeps anyway) and per-token scalars, not a
    normalised copy of `v`.
    """
    groups = v.shape[1]
    compute = torch.promote_types(y.dtype, torch.float32)
    y_grouped = y.to(compute).unflatten(1, (groups, -1))  # [b, groups, heads per group, s, hn]
    v = v.to(compute).unsqueeze(2)  # [b, groups, 1, s, hn]
    squared_norm = v.square().sum(-1, keepdim=True).clamp_min(eps**2)
    z = y_grouped - (y_grouped * v).sum(-1, keepdim=True) / squared_norm * v
    return z.flatten(1, 2).to(y.dtype)


class XSAMixin:
    """Adds XSA to a core attention: `class X(XSAMixin, SomeCoreAttention)`.

    It only overrides `project`, which `CoreAttention.forward` calls on the per-head outputs of
    `attend`, so whatever pairs the base attention attends to, XSA applies to its output. On a GPU
    the projection is one fused Triton kernel each way (triton_xsa.py).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.xsa = kernels.xsa(platform.setup().device)

    def project(self, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.xsa(super().project(y, v), v)


class XSAAttention(XSAMixin, CoreAttention):
    """Standard causal attention, XSA on its output (`--attention xsa`)."""
