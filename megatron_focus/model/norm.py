"""LayerNorm / RMSNorm that work under sequence parallelism without Apex or Transformer Engine.

Megatron-Core's local spec uses `WrappedTorchNorm`, which refuses sequence parallelism: under SP a
norm's weight sees only this rank's slice of the sequence, so its gradient is partial and must be
summed over the tensor-parallel group. Megatron's fused norms mark such weights with
`sequence_parallel = True`; we do the same and `parallel.install_sequence_parallel_grad_allreduce`
sums them (Megatron's own optimizer would, DeepSpeed does not). The query and key norms
(`--qk-layernorm`) see only this rank's heads, so theirs are summed whenever TP > 1, as
Megatron's `finalize_model_grads` does.
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """`--apply-layernorm-1p`: the scale is stored as `weight`, applied as `1 + weight`, so weight
    decay pulls it towards 1 rather than 0 (Megatron's `layernorm_zero_centered_gamma`)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm with the scale applied as `1 + weight` (see ZeroCenteredLayerNorm)."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


NORMS = {  # (normalization, zero-centred scale) -> class
    ("LayerNorm", False): torch.nn.LayerNorm,
    ("RMSNorm", False): torch.nn.RMSNorm,
    ("LayerNorm", True): ZeroCenteredLayerNorm,
    ("RMSNorm", True): ZeroCenteredRMSNorm,
}


class Norm:
    """Builds the torch norm named by `config.normalization`, with Megatron's norm signature.

    A factory (like Megatron's `WrappedTorchNorm`) so parameters keep Megatron's names
    (`input_layernorm.weight`), which the HF converters rely on.
    """

    summed_over_tensor_parallel = False  # beyond sequence parallelism

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        key = (config.normalization, bool(config.layernorm_zero_centered_gamma))
        if key not in NORMS:
            raise ValueError(f"unsupported --normalization {config.normalization!r}")
        norm = NORMS[key](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel or cls.summed_over_tensor_parallel
        return norm


class QKNorm(Norm):
    """The norm of each query and key head (`--qk-layernorm`), over the head dimension."""

    summed_over_tensor_parallel = True
