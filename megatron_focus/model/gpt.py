"""Flags -> Megatron-Core `TransformerConfig` -> `GPTModel`.

Two families come out of the same flags, as in Megatron-LM: GPT-2 style (LayerNorm, GELU, biases,
learned positions, tied embeddings) by default, and Llama/Mistral style with `--normalization
RMSNorm --swiglu --position-embedding-type rope --group-query-attention --num-query-groups 8
--untie-embeddings-and-output-weights --disable-bias-linear`.

Weights are always initialised on the CPU from the full (unsharded) matrices and then split, which
is how Megatron makes initialisation independent of the tensor-parallel size: for a given seed,
TP=1 and TP=2 start from the same model.
"""

import argparse
import dataclasses
import logging

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.activations import squared_relu
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from megatron_focus import platform
from megatron_focus.model.specs import block_spec
from megatron_focus.variants import variant

# megatron-core 0.19 logs at every GPTModel that it takes only bug fixes from now on (its
# HybridModel builds GPTs from a layer pattern); the layer specs here are GPTModel's.
logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(
    lambda record: not record.getMessage().startswith("GPTModel IS DEPRECATED")
)


def _no_cuda_graphs() -> dict:
    """No CUDA graphs are captured here; megatron-core 0.19 warns at every config that its own
    default scope ("full") is deprecated unless told so in its new field."""
    fields = {field.name for field in dataclasses.fields(TransformerConfig)}
    return {"cuda_graph_modules": []} if "cuda_graph_modules" in fields else {}


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation: GPT-2's `gelu_new`, Megatron-LM's `--openai-gelu`."""
    return F.gelu(x, approximate="tanh")


def activation(args: argparse.Namespace):
    """The MLP's activation: SiLU gating for SwiGLU, else GELU (exact or tanh) or squared ReLU."""
    if args.swiglu:
        return F.silu
    return squared_relu if args.squared_relu else openai_gelu if args.openai_gelu else F.gelu


def padded_vocab_size(vocab_size: int, make_divisible_by: int, tp: int) -> int:
    """Megatron-LM's padding: the embedding rows must split evenly over TP ranks."""
    multiple = make_divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    on_gpu = platform.has_cuda()
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        qk_layernorm=args.qk_layernorm,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=args.swiglu,
        activation_func=activation(args),
        init_method_std=args.init_method_std,
        window_size=args.window_size,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        use_cpu_initialization=True,
        bf16=args.bf16,  # the run's compute precision, as Megatron-LM records it (the fused
        fp16=args.fp16,  # kernels' tiles depend on it); parameters are made in fp32 all the same
        # Megatron's fused bias-GELU is the tanh approximation: the model would compute another
        # function on a GPU than on the CPU and in its HF export, so it stays off.
        bias_activation_fusion=False,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        **_no_cuda_graphs(),
    )


def build_model(args: argparse.Namespace, vocab_size: int) -> GPTModel:
    """The GPT model for this rank's tensor-parallel shard, on this rank's device."""
    config = transformer_config(args)
    attention = variant(args.attention)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(
            attention,
            args.normalization,
            args.num_layers,
            args.xsa_layers,
            attention.settings_from(args),
            qk_layernorm=args.qk_layernorm,
        ),
        vocab_size=padded_vocab_size(
            vocab_size,
            args.make_vocab_size_divisible_by,
            parallel_state.get_tensor_model_parallel_world_size(),
        ),
        max_sequence_length=args.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
    )
    if platform.has_cuda():
        model.cuda(torch.cuda.current_device())
    return model
