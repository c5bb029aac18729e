"""The HF layer of the temperature variant (tests/toy_temperature.py, docs/extending.md): what its
core attention computes, in the HF model. It needs only torch and transformers: exported, it is
copied into the folder beside the model's code, which it imports from there."""

import torch
from torch import nn

try:  # in an exported folder, beside the model's code
    from .modeling_megatron_focus import Attention
except ImportError:  # registered in the package
    from megatron_focus.hf.modeling_megatron_focus import Attention


class TemperatureAttention(Attention):
    """Causal softmax attention of the scores divided by the layer's learned temperature."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.bound = config.temperature_bound  # the recorded setting, under its recorded key
        self.w = nn.Parameter(torch.zeros(1))  # the core attention's `w`: t = bound ** tanh(w)

    def attend(self, q, k, v, pairs, routing=None):
        return super().attend(q * self.bound ** -torch.tanh(self.w).to(q.dtype), k, v, pairs)
