"""`--attention` -> a Megatron-Core layer spec: the one place that knows which module is which.

We start from Megatron-Core's own local GPT layer spec and swap three slots: the two norms (for
sequence-parallel support) and `core_attention` (the attention variant). Everything else
(`SelfAttention`, tensor-parallel linears, MLP, bias-dropout-add) stays Megatron's.
"""

import copy

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_focus.arguments import ATTENTION_VARIANTS
from megatron_focus.model.core_attention import CoreAttention
from megatron_focus.model.norm import Norm

CORE_ATTENTION = {
    "standard": CoreAttention,
}


def layer_spec(attention: str, normalization: str) -> ModuleSpec:
    """The spec of one transformer layer with the given attention variant."""
    if attention not in ATTENTION_VARIANTS:
        raise ValueError(f"unknown --attention {attention!r}; choose from {ATTENTION_VARIANTS}")
    if attention not in CORE_ATTENTION:
        raise NotImplementedError(f"--attention {attention} is not implemented yet")
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization=normalization))
    spec.submodules.input_layernorm = Norm
    spec.submodules.pre_mlp_layernorm = Norm
    spec.submodules.self_attention.submodules.core_attention = CORE_ATTENTION[attention]
    return spec


def block_spec(attention: str, normalization: str, num_layers: int) -> TransformerBlockSubmodules:
    """Every layer plus the final norm; a per-layer list so variants can differ by layer."""
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(attention, normalization) for _ in range(num_layers)],
        layer_norm=Norm,
    )
