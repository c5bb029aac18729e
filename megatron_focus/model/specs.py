"""`--attention` -> a Megatron-Core layer spec: the one place that knows which module is which.

We start from Megatron-Core's own local GPT layer spec and swap four slots: the two norms (for
sequence-parallel support), the self-attention module and `core_attention`, both as the attention
variant names them. The core attention says how it is built (`CoreAttention.spec`): Focus's has
its router as a submodule, and its `SelfAttention` subclass hands the core attention the hidden
state the router reads. Everything else (tensor-parallel linears, MLP, bias-dropout-add) stays
Megatron's.
"""

import copy
from typing import Optional, Sequence

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_focus.model.norm import Norm, QKNorm
from megatron_focus.settings import VariantSettings
from megatron_focus.variants import AttentionVariant


def layer_spec(
    attention: AttentionVariant,
    normalization: str,
    settings: Optional[VariantSettings] = None,
    qk_layernorm: bool = False,
) -> ModuleSpec:
    """The spec of one transformer layer with the given attention variant (`settings`: the run's,
    used where the variant has settings)."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization))
    spec.submodules.input_layernorm = Norm
    spec.submodules.pre_mlp_layernorm = Norm
    attn = spec.submodules.self_attention
    if qk_layernorm:
        attn.submodules.q_layernorm = attn.submodules.k_layernorm = QKNorm
    if attention.settings is not None and not isinstance(settings, attention.settings):
        raise ValueError(f"--attention {attention.name} needs a {attention.settings.__name__}")
    attn.module = attention.self_attention_class()
    attn.submodules.core_attention = attention.core_attention_class().spec(
        settings if attention.settings is not None else None
    )
    return spec


def block_spec(
    attention: AttentionVariant,
    normalization: str,
    num_layers: int,
    xsa_layers: Optional[Sequence[int]] = None,
    settings: Optional[VariantSettings] = None,
    qk_layernorm: bool = False,
) -> TransformerBlockSubmodules:
    """Every layer plus the final norm; a per-layer list so variants can differ by layer."""
    return TransformerBlockSubmodules(
        layer_specs=[
            layer_spec(
                attention.on_layer(number, xsa_layers), normalization, settings, qk_layernorm
            )
            for number in range(1, num_layers + 1)
        ],
        layer_norm=Norm,
    )
