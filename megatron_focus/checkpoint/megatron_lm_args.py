"""Megatron-LM's `args` record in a checkpoint, read and written under Megatron-LM's names.

Megatron-LM pickles its whole parsed `args`, after `validate_args`, into every checkpoint; its
`--use-checkpoint-args` (`load_args_from_checkpoint`) and `check_checkpoint_args` read it back.
Its names are its parser's destinations (megatron_lm_flags.txt), which are not always this
trainer's: core_v0.16 stores `--norm-epsilon` as `layernorm_epsilon` and `--apply-layernorm-1p`
as `layernorm_zero_centered_gamma` (its TransformerConfig's names; releases up to 0.15 stored
`norm_epsilon` and `apply_layernorm_1p`), and some values are derived there: without
`--group-query-attention` it keeps `num_query_groups` at its default 1 and builds one group per
head, and `--add-qkv-bias` is set whenever `--add-bias-linear` is.

Every field of the model this trainer builds is read here under Megatron-LM's name (FIELDS);
every field Megatron-LM records that changes the model and is not modelled here (UNMODELLED) is
refused by name unless it is at its "off" value, so a checkpoint never loads as another model.
"""

import argparse
import dataclasses
from typing import Callable, Dict, Optional, Tuple

from megatron_focus.config import compat

# The attention variant of every Megatron-LM checkpoint.
STANDARD = {"attention": "standard", "xsa_layers": None}


@dataclasses.dataclass(frozen=True)
class Field:
    """One model field as Megatron-LM records it: under `names` (this release's first, then
    older releases'), read through `derive` from the whole record where its meaning differs."""

    names: Tuple[str, ...]
    source: str
    derive: Optional[Callable[[argparse.Namespace, object], object]] = None


def _same(name: str, source: str = "its flag's destination") -> Field:
    return Field((name,), source)


def _groups(record: argparse.Namespace, groups):
    """One group per head unless GQA is on (here: `num_query_groups` == heads)."""
    return groups if getattr(record, "group_query_attention", False) else record.num_attention_heads


def _qkv_bias(record: argparse.Namespace, qkv_bias):
    """Here `add_qkv_bias` is a QKV bias beyond `add_bias_linear`'s (Qwen2's)."""
    return bool(qkv_bias) and not getattr(record, "add_bias_linear", True)


# This trainer's model field -> where Megatron-LM (core_v0.16.1) records it.
FIELDS: Dict[str, Field] = {
    **{
        name: _same(name)
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "max_position_embeddings",
            "normalization",
            "swiglu",
            "openai_gelu",
            "squared_relu",
            "qk_layernorm",
            "add_bias_linear",
            "untie_embeddings_and_output_weights",
            "rotary_base",
            "rotary_percent",
            "use_rope_scaling",
            "rope_scaling_factor",
            "window_size",
        )
    },
    "ffn_hidden_size": _same("ffn_hidden_size", "validate_args: 4 x hidden, or 8/3 with SwiGLU"),
    "kv_channels": _same("kv_channels", "validate_args: hidden / heads when unset"),
    "position_embedding_type": _same(
        "position_embedding_type", "validate_args: rope with --use-rotary-position-embeddings"
    ),
    "padded_vocab_size": _same("padded_vocab_size", "build_tokenizer's padding"),
    "tensor_model_parallel_size": _same("tensor_model_parallel_size"),
    "norm_epsilon": Field(
        ("layernorm_epsilon", "norm_epsilon"), "--norm-epsilon (TransformerConfig's name)"
    ),
    "apply_layernorm_1p": Field(
        ("layernorm_zero_centered_gamma", "apply_layernorm_1p"),
        "--apply-layernorm-1p (TransformerConfig's name)",
    ),
    "num_query_groups": Field(
        ("num_query_groups",),
        "core_transformer_config_from_args: one group per head without --group-query-attention",
        _groups,
    ),
    "add_qkv_bias": Field(
        ("add_qkv_bias",), "validate_args: set whenever --add-bias-linear is", _qkv_bias
    ),
}

# Megatron-LM's record of a model this trainer does not build: refused unless at these values
# (Megatron-LM's defaults, which mean "off"; megatron_lm_flags.txt gives the rest).
UNMODELLED = (
    "num_experts",
    "multi_latent_attention",
    "experimental_attention_variant",
    "linear_attention_freq",
    "is_hybrid_model",
    "hybrid_override_pattern",
    "heterogeneous_layers_config_path",
    "heterogeneous_layers_config_encoded_json",
    "spec",
    "use_legacy_models",
    "mtp_num_layers",
    "moe_latent_size",
    "apply_residual_connection_post_layernorm",
    "attention_output_gate",
    "softmax_type",
    "qk_l2_norm",
    "quick_geglu",
    "glu_linear_offset",
    "activation_func_clamp_value",
    "use_fused_weighted_squared_relu",
    "rotary_interleaved",
    "rope_type",
    "rotary_scaling_factor",
    "rotary_seq_len_interpolation_factor",
    "no_rope_freq",
    "mrope_section",
    "window_attn_skip_freq",
)
ALSO_OFF = {"rope_type": ("rope",)}
# Fields whose unset value means something (no sliding window).
OPTIONAL = ("window_size",)


def _value(record: argparse.Namespace, field: str, defaults: Dict[str, object]):
    """A field under its newest recorded name, else Megatron-LM's default for it (a record
    that predates the flag); a required field the record lacks is refused by name."""
    spec = FIELDS[field]
    for name in spec.names:
        if hasattr(record, name):
            value = getattr(record, name)
            break
    else:
        value = defaults.get(spec.names[0])
    if value is None and field not in OPTIONAL:
        raise ValueError(f"Megatron-LM's args record no {spec.names[0]}: its model is unknown")
    return spec.derive(record, value) if spec.derive else value


def _choices() -> Dict[str, tuple]:
    """The values this trainer's model flags take, where they are few."""
    from megatron_focus.config.flags import build_parser

    return {a.dest: a.choices for a in build_parser()._actions if a.dest in FIELDS and a.choices}


def model_args(record: argparse.Namespace) -> dict:
    """The model a Megatron-LM checkpoint's `args` describe, as this trainer records its own
    (`model_args.json`)."""
    defaults = compat.megatron_defaults()
    unmodelled = [
        f"{name} {getattr(record, name)!r}"
        for name in UNMODELLED
        if getattr(record, name, defaults.get(name))
        not in (defaults.get(name), *ALSO_OFF.get(name, ()))
    ]
    values = {field: _value(record, field, defaults) for field in FIELDS}
    unmodelled += [
        f"{field} {values[field]!r}"
        for field, allowed in _choices().items()
        if values[field] not in allowed
    ]
    if unmodelled:
        raise ValueError(
            "Megatron-LM's args describe a model this trainer does not build: "
            + ", ".join(unmodelled)
        )
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    return {**values, **STANDARD}


def record(args: argparse.Namespace) -> Dict[str, object]:
    """This run's model fields under Megatron-LM's names and meanings, for the `args` record
    Megatron-LM reads back (the older releases' names stay beside, as this trainer's)."""
    groups = (
        args.num_query_groups
        if args.group_query_attention
        else compat.megatron_defaults()["num_query_groups"]
    )
    return {
        "num_query_groups": groups,
        "layernorm_epsilon": args.norm_epsilon,
        "layernorm_zero_centered_gamma": args.apply_layernorm_1p,
        "add_qkv_bias": args.add_qkv_bias or args.add_bias_linear,
        "add_position_embedding": args.add_position_embedding,
    }
