"""What the HF side asks of a `ModelConfig` (`model/config.py`), the one description of a model:
its layers' kinds in the HF model, the layers its variants ship, its settings as the HF config
holds them, and whether it can be represented there exactly (asked once, here or in
`families.py`, before any weight moves).
"""

from typing import Dict, List, Optional

from megatron_focus.model.config import ModelConfig
from megatron_focus.settings import VariantSettings
from megatron_focus.variants import VARIANTS, variant


def check_exportable(model: ModelConfig) -> None:
    """Refuse, by name, what the HF model cannot compute: a variant with no HF layer, partial
    rotary, a setting its HF layer has no place for (exported, it would come back at a
    default)."""
    attention = variant(model.attention)
    if attention.hf_kind is None:
        raise NotImplementedError(
            f"--attention {model.attention}: the HF model has no layer that computes it"
        )
    if model.rotary_percent != 1.0:
        raise NotImplementedError("--rotary-percent below 1 (partial rotary) is not mapped")
    if attention.hf_layer is not None:
        return  # its own layer, whose config carries all its settings
    if attention.hf_attention not in VARIANTS:
        raise NotImplementedError(
            f"--attention {attention.name}: the HF model has no {attention.hf_attention!r} layer"
        )
    taken = set(variant(attention.hf_attention).recorded_keys())
    unmapped = [key for key in attention.recorded_keys() if key not in taken]
    if unmapped:
        raise NotImplementedError(
            f"--attention {attention.name} records {', '.join(unmapped)}, which the HF model's "
            f"{attention.hf_attention!r} layer has no setting for: not exported, as it would "
            "load at a default"
        )


def layer_attention(model: ModelConfig) -> List[str]:
    """Each layer's attention as the HF model names it, first layer first."""
    return [
        variant(model.attention).on_layer(number, model.xsa_layers).hf_kind
        for number in range(1, model.num_layers + 1)
    ]


def shipped_layers(model: ModelConfig) -> Dict[str, str]:
    """{layer kind: "module:Class"} of the HF layers this model's variants ship."""
    return {
        kind: variant(kind).hf_layer
        for kind in dict.fromkeys(layer_attention(model))
        if variant(kind).hf_layer is not None
    }


def routing_settings(model: ModelConfig) -> Optional[VariantSettings]:
    """The settings of a variant that routes (the HF model's `focus_*` fields), else None."""
    return model.settings if variant(model.attention).focus else None


def layer_settings(model: ModelConfig) -> Optional[VariantSettings]:
    """The settings of a variant that ships its HF layer and does not route (all of them go into
    the HF config, under their keys), else None."""
    attention = variant(model.attention)
    return model.settings if attention.hf_layer is not None and not attention.focus else None
