"""A variant registered from outside the package (docs/extending.md): causal softmax attention
by explicit scores, computing what `standard` does, so it exports as the HF model's standard
layers. Loaded by MEGATRON_FOCUS_VARIANTS=toy_variant."""

import torch
import torch.nn.functional as F

from megatron_focus.model.core_attention import CoreAttention
from megatron_focus.variants import AttentionVariant, register


class ExplicitAttention(CoreAttention):
    """softmax(q k^T * scale + causal mask) v, one [s, s] score matrix per head."""

    def attend(self, q, k, v, attention_mask):
        if attention_mask is not None:
            raise ValueError("explicit attention is plain causal attention")
        rep = q.shape[1] // k.shape[1]  # GQA: each key/value head serves `rep` query heads
        k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
        scores = (q @ k.transpose(-1, -2)) * self.softmax_scale
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        return F.dropout(probs, self.dropout_p if self.training else 0.0) @ v


register(AttentionVariant("explicit", "toy_variant:ExplicitAttention", hf_attention="standard"))
