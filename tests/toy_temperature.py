"""A variant with a setting and a parameter of its own (docs/extending.md): each layer learns a
temperature for its attention scores, kept within [1/bound, bound] by `--temperature-bound`,
reported at log steps by its hooks, exported with its HF layer (tests/toy_temperature_hf.py).
Loaded by MEGATRON_FOCUS_VARIANTS=toy_temperature."""

import dataclasses

import torch

from megatron_focus.model.core_attention import CoreAttention
from megatron_focus.model.hooks import VariantHooks
from megatron_focus.parallel.tensor_parallel import sum_grad_over_tensor_parallel
from megatron_focus.settings import VariantSettings, setting
from megatron_focus.variants import AttentionVariant, register


@dataclasses.dataclass(frozen=True)
class TemperatureConfig(VariantSettings, prefix="temperature"):
    bound: float = setting(4.0, "the learned temperature stays within [1/bound, bound]", at_least=1)


class TemperatureAttention(CoreAttention):
    """Causal softmax attention of the scores divided by the layer's learned temperature."""

    def __init__(self, config, layer_number, attn_mask_type, settings: TemperatureConfig, **kw):
        super().__init__(config, layer_number, attn_mask_type, **kw)
        self.bound = settings.bound
        self.w = torch.nn.Parameter(torch.zeros(1))  # t = bound ** tanh(w): 1 at first

    def temperature(self) -> torch.Tensor:
        return self.bound ** torch.tanh(self.w.detach()[0])

    def attend(self, q, k, v, attention_mask):
        w = sum_grad_over_tensor_parallel(self.w)  # every rank's heads train the one w
        return super().attend(q * self.bound ** -torch.tanh(w).to(q.dtype), k, v, attention_mask)


class TemperatureHooks(VariantHooks):
    """Each layer's temperature to TensorBoard, their mean in the log line."""

    def statistics(self, model) -> dict:
        return {
            f"temperature/layer{m.layer_number:02d}/t": m.temperature()
            for m in model.modules()
            if isinstance(m, TemperatureAttention)
        }

    def summary(self, values: dict) -> str:
        return f" | temperature: {sum(values.values()) / len(values):.4f}"


register(
    AttentionVariant(
        "temperature",
        "toy_temperature:TemperatureAttention",
        settings=TemperatureConfig,
        hooks="toy_temperature:TemperatureHooks",
        hf_layer="toy_temperature_hf:TemperatureAttention",
    )
)
