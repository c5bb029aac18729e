"""`--attention` -> a Megatron-Core layer spec: the one place that knows which module is which.

We start from Megatron-Core's own local GPT layer spec and swap three slots: the two norms (for
sequence-parallel support) and `core_attention` (the attention variant). Focus's core attention
has the router as its submodule, and `SelfAttention` becomes a subclass that hands the core
attention the hidden state the router reads. Everything else (tensor-parallel linears,
MLP, bias-dropout-add) stays Megatron's.
"""

import copy
from typing import Optional, Sequence

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_focus.model.focus import FocusAttentionSubmodules, FocusSelfAttention, Router
from megatron_focus.model.norm import Norm, QKNorm
from megatron_focus.variants import AttentionVariant, FocusConfig


def layer_spec(
    attention: AttentionVariant,
    normalization: str,
    focus: Optional[FocusConfig] = None,
    qk_layernorm: bool = False,
) -> ModuleSpec:
    """The spec of one transformer layer with the given attention variant."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization))
    spec.submodules.input_layernorm = Norm
    spec.submodules.pre_mlp_layernorm = Norm
    attn = spec.submodules.self_attention
    if qk_layernorm:
        attn.submodules.q_layernorm = attn.submodules.k_layernorm = QKNorm
    attn.submodules.core_attention = attention.core_attention_class()
    if attention.focus:
        if focus is None:
            raise ValueError(f"--attention {attention.name} needs a FocusConfig")
        attn.module = FocusSelfAttention
        attn.submodules.core_attention = ModuleSpec(
            attention.core_attention_class(),
            params={"focus": focus},
            submodules=FocusAttentionSubmodules(router=Router),
        )
    return spec


def block_spec(
    attention: AttentionVariant,
    normalization: str,
    num_layers: int,
    xsa_layers: Optional[Sequence[int]] = None,
    focus: Optional[FocusConfig] = None,
    qk_layernorm: bool = False,
) -> TransformerBlockSubmodules:
    """Every layer plus the final norm; a per-layer list so variants can differ by layer."""
    return TransformerBlockSubmodules(
        layer_specs=[
            layer_spec(attention.on_layer(number, xsa_layers), normalization, focus, qk_layernorm)
            for number in range(1, num_layers + 1)
        ],
        layer_norm=Norm,
    )
