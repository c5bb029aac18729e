"""The FLOPs a training step of a model costs, and the GPUs' peaks to compare them with (MFU).

Light (no torch): the run's own throughput log (training/metrics.py) and the planner
(planner.py) count with the same formula.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # counted from the run's config, a layer above (docs/design.md)
    from megatron_focus.config.run_config import RunConfig

# Dense bf16 peak of common training GPUs, for MFU; unknown devices report TFLOP/s only.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def flops_per_token(config: "RunConfig", vocab_size: int) -> float:
    """Training FLOPs (forward + backward = 3 x forward) per token, as Megatron-LM counts them.

    Matmuls cost 2 FLOPs per weight per token; causal attention scores and the weighted sum
    cost 2 x 2 x (s/2) x heads x head_dim per token per layer (half the square is computed).
    A retrofit computes no gradients of its frozen weights, only of their inputs: its weight
    matmuls cost 2 x forward (the routers' own are negligible and not counted).
    """
    model = config.model
    h, heads, groups, d = (
        model.hidden_size,
        model.num_attention_heads,
        model.num_query_groups,
        model.kv_channels,
    )
    qkv_proj = h * (heads + 2 * groups) * d + heads * d * h
    mlp = h * model.ffn_hidden_size * (3 if model.swiglu else 2)
    matmul_weights = model.num_layers * (qkv_proj + mlp) + h * vocab_size
    attention = model.num_layers * 2 * model.seq_length * heads * d
    weight_passes = 2 if config.checkpoint.retrofit else 3
    return weight_passes * 2 * matmul_weights + 3 * attention
