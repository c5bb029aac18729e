"""The torch calls that are private or version-specific, each behind one named, guarded function.

setup.py accepts torch 2.11 to 2.15; the suite runs on 2.11 and 2.13 (and its fast part on 2.15).
What could move between releases lives here, so a new torch is one file to check:

* the CPU flash kernel's (output, log-sum-exp), a private aten op: the sparse path's CPU kernel;
  where a torch lacks it, the same result from explicit scores (correct, slower);
* dynamo's recompile limit (named `cache_size_limit` before torch 2.6).
"""

import torch

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def has_cpu_flash_with_lse() -> bool:
    return _CPU_FLASH is not None


def cpu_attention_with_lse(q, k, v, scale: float, causal: bool, mask=None):
    """(output, natural log-sum-exp [b, h, nq]) of softmax attention on the CPU; kv heads may be
    fewer than q heads (GQA); `mask` additive, broadcastable to the scores. A query with no key
    left gets output 0 and log-sum-exp 0, as the fused kernel gives."""
    if _CPU_FLASH is not None:
        return _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]
    return explicit_attention_with_lse(q, k, v, scale, causal, mask)


def explicit_attention_with_lse(q, k, v, scale: float, causal: bool, mask=None):
    """`cpu_attention_with_lse` by explicit scores (an nq x nk tensor per head)."""
    rep = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    if causal:
        nq, nk = scores.shape[-2:]
        future = torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(1)  # as SDPA's
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0).unsqueeze(-1))
    out = (probs @ v.float()).to(q.dtype)
    return out, lse.masked_fill(empty, 0.0)


def raise_recompile_limit(limit: int) -> None:
    """At least `limit` compiled variants per frame before dynamo falls back to eager."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))
