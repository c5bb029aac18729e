"""What a GPT model is, independent of where its weights live: the bridge between the two formats.

A native checkpoint describes its model in `model_args.json` (Megatron-LM's flag names); an HF
folder in `config.json`. Both convert to and from an `Architecture`, so every check of "can this
be represented there, exactly?" is made once, here or in `families.py`, before any weight moves.
"""

import dataclasses
from typing import Dict, List, Optional, Tuple

from megatron_focus.config.run_config import RunConfig
from megatron_focus.settings import VariantSettings
from megatron_focus.variants import VARIANTS, FocusConfig, variant


@dataclasses.dataclass(frozen=True)
class Architecture:
    vocab_size: int  # the tokenizer's, without Megatron's padding
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    normalization: str  # "LayerNorm" | "RMSNorm"
    norm_epsilon: float
    swiglu: bool  # SwiGLU MLP; otherwise GELU (exact, erf)
    add_bias_linear: bool
    position_embedding_type: str  # "learned_absolute" | "rope"
    rotary_base: int
    max_position_embeddings: int
    untie_embeddings_and_output_weights: bool
    openai_gelu: bool = False  # GELU MLP with the tanh approximation (GPT-2's gelu_new)
    attention: str = "standard"
    xsa_layers: Optional[Tuple[int, ...]] = None  # 1-based; None: every layer (when xsa)
    window_size: Optional[Tuple[int, int]] = None  # sliding window (left, 0): keys i - left .. i
    add_qkv_bias: bool = False  # a QKV bias without add_bias_linear (Qwen2)
    apply_layernorm_1p: bool = False  # norm scales stored as weight, applied as 1 + weight
    qk_layernorm: bool = False  # a norm on each query and key head
    squared_relu: bool = False  # relu(x)^2 MLP
    use_rope_scaling: bool = False  # Llama 3.1's RoPE frequency scaling, by rope_scaling_factor
    rope_scaling_factor: float = 8.0
    focus: Optional[FocusConfig] = None  # exactly when the attention variant routes
    # The settings of a variant that ships its HF layer (`hf_layer`), has settings and does not
    # route (a router's are `focus`): all of them go into the HF config, under their keys.
    settings: Optional[VariantSettings] = None

    def __post_init__(self):
        attention = variant(self.attention)
        if attention.hf_kind is None:
            raise NotImplementedError(
                f"--attention {self.attention}: the HF model has no layer that computes it"
            )
        if (self.focus is not None) != attention.focus:
            raise ValueError(f"--attention {self.attention} with Focus settings {self.focus}")
        if (self.settings is not None) != _carries_settings(attention):
            raise ValueError(f"--attention {self.attention} with settings {self.settings}")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"unknown normalization {self.normalization!r}")
        if self.position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(f"unknown position embedding {self.position_embedding_type!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"{self.num_query_groups} query groups do not divide "
                f"{self.num_attention_heads} heads"
            )

    @property
    def tied(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def layer_attention(self) -> List[str]:
        """Each layer's attention as the HF model names it, first layer first."""
        return [
            variant(self.attention).on_layer(number, self.xsa_layers).hf_kind
            for number in range(1, self.num_layers + 1)
        ]

    def shipped_layers(self) -> Dict[str, str]:
        """{layer kind: "module:Class"} of the HF layers this model's variants ship."""
        return {
            kind: variant(kind).hf_layer
            for kind in dict.fromkeys(self.layer_attention())
            if variant(kind).hf_layer is not None
        }

    @classmethod
    def from_model_args(
        cls,
        model_args: dict,
        vocab_size: int,
        focus_top_k: Optional[int] = None,
        focus_attention_mode: Optional[str] = None,
    ) -> "Architecture":
        """From a checkpoint's `model_args.json`; refuses settings the conversion cannot map.

        `focus_top_k` / `focus_attention_mode`: a Focus model's inference settings (not recorded;
        default `pretrain_gpt.py`'s).
        """
        from megatron_focus.checkpoint.format import with_unrecorded_defaults

        model_args = with_unrecorded_defaults(model_args)  # what older checkpoints computed
        own = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in ("vocab_size", "focus", "settings")
        ]
        missing = [name for name in own if name not in model_args]
        if missing:
            raise ValueError(
                f"model_args.json lacks {', '.join(missing)}: the checkpoint was "
                "saved by a megatron-focus that did not record them yet"
            )
        if model_args.get("rotary_percent", 1.0) != 1.0:
            raise NotImplementedError("--rotary-percent below 1 (partial rotary) is not mapped")
        _refuse_unmapped_settings(model_args)
        kwargs = {name: model_args[name] for name in own}
        for name in ("xsa_layers", "window_size"):
            if kwargs[name] is not None:
                kwargs[name] = tuple(kwargs[name])
        if variant(kwargs["attention"]).focus:
            kwargs["focus"] = variant(kwargs["attention"]).settings.from_model_args(
                model_args, top_k=focus_top_k, attention_mode=focus_attention_mode
            )
        if _carries_settings(variant(kwargs["attention"])):
            kwargs["settings"] = variant(kwargs["attention"]).settings.from_model_args(model_args)
        return cls(vocab_size=vocab_size, **kwargs)

    def flags(self) -> List[str]:
        """The `pretrain_gpt.py` model flags of this model."""
        flags = [
            "--num-layers",
            self.num_layers,
            "--hidden-size",
            self.hidden_size,
            "--ffn-hidden-size",
            self.ffn_hidden_size,
            "--num-attention-heads",
            self.num_attention_heads,
            "--kv-channels",
            self.kv_channels,
            "--normalization",
            self.normalization,
            "--norm-epsilon",
            repr(self.norm_epsilon),
            "--position-embedding-type",
            self.position_embedding_type,
            "--rotary-base",
            self.rotary_base,
            "--max-position-embeddings",
            self.max_position_embeddings,
            "--attention",
            self.attention,
        ]
        if self.num_query_groups != self.num_attention_heads:
            flags += ["--group-query-attention", "--num-query-groups", self.num_query_groups]
        if self.swiglu:
            flags.append("--swiglu")
        if self.openai_gelu:
            flags.append("--openai-gelu")
        if self.squared_relu:
            flags.append("--squared-relu")
        if self.apply_layernorm_1p:
            flags.append("--apply-layernorm-1p")
        if self.qk_layernorm:
            flags.append("--qk-layernorm")
        if self.use_rope_scaling:
            flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(self.rope_scaling_factor)]
        if not self.add_bias_linear:
            flags.append("--disable-bias-linear")
        if self.add_qkv_bias:
            flags.append("--add-qkv-bias")
        if not self.tied:
            flags.append("--untie-embeddings-and-output-weights")
        if self.xsa_layers is not None:
            flags += ["--xsa-layers", *self.xsa_layers]
        if self.window_size is not None:
            flags += ["--window-size", ",".join(map(str, self.window_size))]
        if self.focus is not None:
            flags += self.focus.flags()
        if self.settings is not None:
            flags += self.settings.flags()
        return [str(flag) for flag in flags]

    def native_args(
        self, tensor_model_parallel_size: int = 1, make_vocab_size_divisible_by: int = 128
    ) -> RunConfig:
        """The run config of `pretrain_gpt.py`'s flags for this model, validated as a training
        run's are."""
        from megatron_focus.config.flags import build_parser
        from megatron_focus.config.validation import validate_args

        args = build_parser().parse_args(
            self.flags()
            + [
                "--tensor-model-parallel-size",
                str(tensor_model_parallel_size),
                "--make-vocab-size-divisible-by",
                str(make_vocab_size_divisible_by),
                "--seq-length",
                str(self.max_position_embeddings),  # any length the model can take
            ]
        )
        return validate_args(args, world_size=tensor_model_parallel_size, training=False)


def _refuse_unmapped_settings(model_args: dict) -> None:
    """An HF layer kind computes what the package's variant of that name computes, so it takes
    that variant's settings and no others: a variant recording a setting its HF layer has no
    place for is refused by the setting's name (exported, it would come back at a default)."""
    attention = variant(model_args["attention"])
    if attention.hf_kind is None:
        return  # refused by name when the Architecture is built
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


def _carries_settings(attention) -> bool:
    """The variant ships its HF layer and has settings other than Focus's (`focus` carries
    those)."""
    return attention.hf_layer is not None and attention.settings is not None and not attention.focus
