"""A variant with a parameter split over tensor-parallel ranks (docs/extending.md): each head's
queries scaled by a learned exp(s_h), one value per head, held by the rank that holds the head and
declared so where it is created, as Megatron-Core's layers declare their splits; exported with
its HF layer (tests/toy_head_scale_hf.py). Loaded by MEGATRON_FOCUS_VARIANTS=toy_head_scale."""

import torch
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

from megatron_focus.model.core_attention import CoreAttention
from megatron_focus.variants import AttentionVariant, register


class HeadScaleAttention(CoreAttention):
    """Causal softmax attention of each head's queries scaled by exp(s_h): at first, s = 0,
    standard attention."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.s = torch.nn.Parameter(torch.zeros(self.heads))  # this rank's heads
        set_tensor_model_parallel_attributes(self.s, is_parallel=True, dim=0, stride=1)

    def attend(self, q, k, v, attention_mask):
        scale = self.s.exp().to(q.dtype)[:, None, None]  # q: [b, heads, s, hn]
        return super().attend(q * scale, k, v, attention_mask)


register(
    AttentionVariant(
        "head-scale",
        "toy_head_scale:HeadScaleAttention",
        hf_layer="toy_head_scale_hf:HeadScaleAttention",
    )
)
