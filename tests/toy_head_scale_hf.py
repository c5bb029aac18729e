"""The HF layer of the head-scale variant (tests/toy_head_scale.py): every head's value of `s`, in
the order of the heads."""

import torch
from torch import nn

try:  # in an exported folder, beside the model's code
    from .modeling_megatron_focus import Attention
except ImportError:  # registered in the package
    from megatron_focus.hf.modeling_megatron_focus import Attention


class HeadScaleAttention(Attention):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.s = nn.Parameter(torch.zeros(config.num_attention_heads))

    def attend(self, q, k, v, pairs, routing=None):
        return super().attend(q * self.s.exp().to(q.dtype)[:, None, None], k, v, pairs)
