"""`ModelConfig` (and a run's parallel and training sections) -> Megatron-Core
`TransformerConfig` -> `GPTModel`.

Two families come out of the same flags, as in Megatron-LM: GPT-2 style (LayerNorm, GELU, biases,
learned positions, tied embeddings) by default, and Llama/Mistral style with `--normalization
RMSNorm --swiglu --position-embedding-type rope --group-query-attention --num-query-groups 8
--untie-embeddings-and-output-weights --disable-bias-linear`.

Weights are always initialised on the CPU from the full (unsharded) matrices and then split, which
is how Megatron makes initialisation independent of the tensor-parallel size: for a given seed,
TP=1 and TP=2 start from the same model.
"""

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.activations import squared_relu
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from megatron_focus import platform
from megatron_focus.model.config import ModelConfig
from megatron_focus.model.specs import block_spec
from megatron_focus.variants import variant

if TYPE_CHECKING:  # a run's config, a layer above (docs/design.md)
    from megatron_focus.config.run_config import RunConfig

# megatron-core 0.19 logs at every GPTModel that it takes only bug fixes from now on (its
# HybridModel builds GPTs from a layer pattern); the layer specs here are GPTModel's.
logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(
    lambda record: not record.getMessage().startswith("GPTModel IS DEPRECATED")
)


def _no_cuda_graphs() -> dict:
    """No CUDA graphs are captured here; megatron-core warns at every config that its own
    default scope ("full") is deprecated unless told the scope: in `cuda_graph_modules` from
    0.19 (where `cuda_graph_scope` is itself deprecated), in `cuda_graph_scope` before."""
    fields = {field.name for field in dataclasses.fields(TransformerConfig)}
    for name in ("cuda_graph_modules", "cuda_graph_scope"):
        if name in fields:
            return {name: []}
    return {}


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation: GPT-2's `gelu_new`, Megatron-LM's `--openai-gelu`."""
    return F.gelu(x, approximate="tanh")


def activation(model: ModelConfig):
    """The MLP's activation: SiLU gating for SwiGLU, else GELU (exact or tanh) or squared ReLU."""
    if model.swiglu:
        return F.silu
    return squared_relu if model.squared_relu else openai_gelu if model.openai_gelu else F.gelu


def padded_vocab_size(vocab_size: int, make_divisible_by: int, tp: int) -> int:
    """Megatron-LM's padding: the embedding rows must split evenly over TP ranks."""
    multiple = make_divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def transformer_config(model: ModelConfig, parallel=None, training=None) -> TransformerConfig:
    """`parallel`, `training`: a run's sections (`RunConfig.parallel`, `.training`); None: one
    process, fp32, nothing recomputed (a tool's model)."""
    on_gpu = platform.has_cuda()
    run = {}
    if parallel is not None:
        run.update(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
            sequence_parallel=parallel.sequence_parallel,
        )
    if training is not None:
        run.update(
            recompute_granularity=training.recompute_granularity,
            recompute_method=training.recompute_method,
            recompute_num_layers=training.recompute_num_layers,
            # the run's compute precision, as Megatron-LM records it (the fused kernels' tiles
            # depend on it); parameters are made in fp32 all the same
            bf16=training.bf16,
            fp16=training.fp16,
        )
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        layernorm_zero_centered_gamma=model.apply_layernorm_1p,
        qk_layernorm=model.qk_layernorm,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        gated_linear_unit=model.swiglu,
        activation_func=activation(model),
        init_method_std=model.init_method_std,
        window_size=model.window_size,
        use_cpu_initialization=True,
        # Megatron's fused bias-GELU is the tanh approximation: the model would compute another
        # function on a GPU than on the CPU and in its HF export, so it stays off.
        bias_activation_fusion=False,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        **run,
        **_no_cuda_graphs(),
    )


def build_model(config: "RunConfig", vocab_size: int) -> GPTModel:
    """The run's GPT model for this rank's tensor-parallel shard, on this rank's device."""
    padded = padded_vocab_size(
        vocab_size,
        config.make_vocab_size_divisible_by,
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    return on_device(build(config.model_config, padded, config.parallel, config.training))


def build(model: ModelConfig, padded_vocab_size: int, parallel=None, training=None) -> GPTModel:
    """The GPT model `model` describes, with `padded_vocab_size` embedding rows (padded for the
    tensor-parallel size), for this rank's shard, on the default device (the meta device in
    `tp_layout.declared_splits`); `parallel`, `training` as `transformer_config` takes them."""
    attention = variant(model.attention)
    gpt = GPTModel(
        config=transformer_config(model, parallel, training),
        transformer_layer_spec=block_spec(
            attention,
            model.normalization,
            model.num_layers,
            model.xsa_layers,
            model.settings,
            qk_layernorm=model.qk_layernorm,
        ),
        vocab_size=padded_vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=model.tied,
        position_embedding_type=model.position_embedding_type,
        rotary_percent=model.rotary_percent,
        rotary_base=model.rotary_base,
        rope_scaling=model.use_rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor,
    )
    return gpt


def on_device(model: GPTModel) -> GPTModel:
    """The model on this rank's GPU, where there is one."""
    if platform.has_cuda():
        model.cuda(torch.cuda.current_device())
    return model
