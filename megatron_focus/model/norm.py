"""LayerNorm / RMSNorm that work under sequence parallelism without Apex or Transformer Engine.

Megatron-Core's local spec uses `WrappedTorchNorm`, which refuses sequence parallelism: under SP a
norm's weight sees only this rank's slice of the sequence, so its gradient is partial and must be
summed over the tensor-parallel group. Megatron's fused norms mark such weights with
`sequence_parallel = True`; we do the same and `parallel.install_sequence_parallel_grad_allreduce`
sums them (Megatron's own optimizer would, DeepSpeed does not).
"""

import torch

from megatron.core.transformer import TransformerConfig


class Norm:
    """Builds the torch norm named by `config.normalization`, with Megatron's norm signature.

    A factory (like Megatron's `WrappedTorchNorm`) so parameters keep Megatron's names
    (`input_layernorm.weight`), which the HF converters rely on.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"unsupported --normalization {config.normalization!r}")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
