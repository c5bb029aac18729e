"""What a GPT model is: one typed, frozen description, built once and read by everything that
builds, saves, converts or evaluates a model (as Megatron-Core's and OLMo-core's
`TransformerConfig` are).

A run builds it from its validated flags (`RunConfig.model_config`); a checkpoint's
`model_args.json` is its `record` and comes back by `from_record`, with no command-line parser in
between; the HF bridge converts it to and from an HF config (`hf/families.py`). The attention
variant's settings, whatever the variant, are one `settings` object (`settings.py`).
"""

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from megatron_focus.settings import INFERENCE, MODEL, RUN, VariantSettings
from megatron_focus.variants import VARIANTS, variant

# The record's keys that follow the layout that wrote it rather than the model.
LAYOUT_KEYS = ("tensor_model_parallel_size", "padded_vocab_size")
# Recorded for the tools and never compared: the sequence length the model was trained at (it
# runs at any length up to its positions, and may continue training at another).
RECORDED_ONLY = ("seq_length",)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A GPT model of Megatron-Core's layers: the fields are `pretrain_gpt.py`'s model flags by
    their names (and `model_args.json`'s keys)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # key/value heads (= heads without GQA)
    kv_channels: int  # head dim
    max_position_embeddings: int
    normalization: str = "LayerNorm"  # "LayerNorm" | "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False  # SwiGLU MLP; otherwise GELU (exact, erf)
    openai_gelu: bool = False  # GELU with the tanh approximation (GPT-2's gelu_new)
    squared_relu: bool = False  # relu(x)^2 MLP
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # a QKV bias without add_bias_linear (Qwen2)
    apply_layernorm_1p: bool = False  # norm scales stored as weight, applied as 1 + weight
    qk_layernorm: bool = False  # a norm on each query and key head
    position_embedding_type: str = "learned_absolute"  # | "rope" | "none"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    use_rope_scaling: bool = False  # Llama 3.1's RoPE frequency scaling
    rope_scaling_factor: float = 8.0
    untie_embeddings_and_output_weights: bool = False
    window_size: Optional[Tuple[int, int]] = None  # sliding window (left, 0): keys i - left .. i
    attention: str = "standard"  # the attention variant (variants.py)
    xsa_layers: Optional[Tuple[int, ...]] = None  # 1-based; None: every layer (when XSA)
    settings: Optional[VariantSettings] = None  # the variant's, exactly when it has any
    # Training's, not the weights': not recorded.
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    # The tokenizer's vocabulary, unpadded, where the description needs it (the HF bridge's);
    # a run pads it for its tensor-parallel size. Not part of the record (tokenizer_args.json).
    vocab_size: Optional[int] = None

    def __post_init__(self):
        for name in ("window_size", "xsa_layers"):  # a record's lists, as tuples
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        attention = variant(self.attention)
        expected = attention.settings
        if (self.settings is None) != (expected is None) or (
            expected is not None and not isinstance(self.settings, expected)
        ):
            raise ValueError(f"--attention {self.attention} with settings {self.settings}")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"unknown normalization {self.normalization!r}")
        if self.position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(f"unknown position embedding {self.position_embedding_type!r}")
        self.check_heads(self.num_attention_heads, self.num_query_groups)
        if self.xsa_layers is not None:
            if not attention.xsa:
                xsa = " or ".join(v.name for v in VARIANTS.values() if v.xsa)
                raise ValueError(f"--xsa-layers needs --attention {xsa}, not {self.attention}")
            missing = [n for n in self.xsa_layers if not 1 <= n <= self.num_layers]
            if missing:
                raise ValueError(
                    f"--xsa-layers {' '.join(map(str, missing))}: no such layer; layers are "
                    f"numbered 1 to --num-layers {self.num_layers}"
                )
        if self.window_size is not None:
            if len(self.window_size) != 2 or self.window_size[1] != 0 or self.window_size[0] < 0:
                raise ValueError(
                    f"--window-size {self.window_size}: give LEFT,0 with LEFT >= 0 "
                    "(a causal window of LEFT + 1 keys)"
                )
            if attention.focus:
                raise ValueError(
                    "--window-size is for standard and xsa attention: Focus has its own "
                    "local window (--focus-window)"
                )

    @property
    def tied(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @classmethod
    def described(cls) -> Tuple[str, ...]:
        """The fields that describe the weights and what they compute (recorded, compared)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in _NOT_RECORDED)

    @classmethod
    def of(cls, flags: Any) -> "ModelConfig":
        """From a run's validated flags (a `RunConfig`, or its namespace)."""
        own = ("settings", "vocab_size")
        names = [f.name for f in dataclasses.fields(cls) if f.name not in own]
        return cls(
            **{name: getattr(flags, name) for name in names},
            settings=variant(flags.attention).settings_from(flags),
        )

    def record(
        self, padded_vocab_size: int, tensor_model_parallel_size: int, seq_length: Optional[int]
    ) -> Dict[str, Any]:
        """`model_args.json`: the described fields and the variant's model settings (compared
        on load), the layout's keys and the sequence length trained at (tuples as lists)."""
        values = {name: getattr(self, name) for name in self.described()}
        if self.settings is not None:
            values.update(self.settings.keys(MODEL))
        values.update(
            padded_vocab_size=padded_vocab_size,
            tensor_model_parallel_size=tensor_model_parallel_size,
            seq_length=seq_length,
        )
        return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}

    @staticmethod
    def completed(record: Dict[str, Any]) -> Dict[str, Any]:
        """A record with the settings it predates at what its checkpoint computed."""
        record = {**BEFORE_RECORDED, **record}
        if record.get("attention") in VARIANTS:
            record = {**variant(record["attention"]).before_recorded(), **record}
        return record

    @classmethod
    def from_record(
        cls, record: Dict[str, Any], vocab_size: Optional[int] = None, **settings
    ) -> "ModelConfig":
        """The model a `model_args.json` records; `settings`: the variant's settings it does not
        record (inference and run ones), by key (`focus_top_k=1`; None: the default)."""
        record = cls.completed(record)
        attention = variant(record["attention"]) if "attention" in record else None
        keys = list(cls.described()) + list(attention.recorded_keys() if attention else ())
        missing = [key for key in keys if key not in record]
        if missing:
            raise ValueError(
                f"model_args.json lacks {', '.join(missing)}: the checkpoint was "
                "saved by a megatron-focus that did not record them yet"
            )
        chosen = attention.settings
        settings = {key: value for key, value in settings.items() if value is not None}
        unknown = [key for key in settings if chosen is None or not _is_setting(chosen, key)]
        if unknown:
            raise ValueError(f"--attention {attention.name} has no setting {unknown[0]!r}")
        return cls(
            **{name: record[name] for name in cls.described()},
            settings=None
            if chosen is None
            else chosen(
                **{name: record[chosen.key(name)] for name in chosen.names(MODEL)},
                **{
                    name: settings[chosen.key(name)]
                    for name in chosen.names(INFERENCE, RUN)
                    if settings.get(chosen.key(name)) is not None
                },
            ),
            vocab_size=vocab_size,
        )

    def flags(self) -> List[str]:
        """The `pretrain_gpt.py` flags of this model (what an import prints to train it)."""
        flags = [
            *("--num-layers", self.num_layers, "--hidden-size", self.hidden_size),
            *("--ffn-hidden-size", self.ffn_hidden_size),
            *("--num-attention-heads", self.num_attention_heads, "--kv-channels", self.kv_channels),
            *("--normalization", self.normalization, "--norm-epsilon", repr(self.norm_epsilon)),
            *("--position-embedding-type", self.position_embedding_type),
            *("--rotary-base", self.rotary_base),
            *("--max-position-embeddings", self.max_position_embeddings),
            *("--attention", self.attention),
        ]
        if self.num_query_groups != self.num_attention_heads:
            flags += ["--group-query-attention", "--num-query-groups", self.num_query_groups]
        for switch in ("swiglu", "openai_gelu", "squared_relu", "apply_layernorm_1p"):
            if getattr(self, switch):
                flags.append("--" + switch.replace("_", "-"))
        if self.qk_layernorm:
            flags.append("--qk-layernorm")
        if self.use_rope_scaling:
            flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(self.rope_scaling_factor)]
        if self.rotary_percent != 1.0:
            flags += ["--rotary-percent", repr(self.rotary_percent)]
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
        if self.settings is not None:
            flags += self.settings.flags()
        return [str(flag) for flag in flags]

    def check_tensor_parallel(self, size: int) -> None:
        """Refuse, by the flags' names, a tensor-parallel size that does not split the model."""
        self.check_heads(self.num_attention_heads, self.num_query_groups, size)

    def splits_over(self, size: int) -> bool:
        """Whether `size` tensor-parallel ranks split the model's heads (check_tensor_parallel)."""
        return _heads_refusal(self.num_attention_heads, self.num_query_groups, size) is None

    @staticmethod
    def check_heads(heads: int, groups: int, tp: int = 1) -> None:
        """Megatron-Core's rules: query groups divide the heads, TP divides the heads, and the
        groups are a multiple of TP or a divisor of it (each then replicated over ranks)."""
        refusal = _heads_refusal(heads, groups, tp)
        if refusal is not None:
            raise ValueError(refusal)


# Recorded since: what a checkpoint saved before a key was recorded computed.
BEFORE_RECORDED = {
    "window_size": None,
    "add_qkv_bias": False,
    "apply_layernorm_1p": False,
    "qk_layernorm": False,
    "squared_relu": False,
    "use_rope_scaling": False,
    "rope_scaling_factor": 8.0,
}


# The variant's settings are recorded by their keys; the rest is training's or the tokenizer's.
_NOT_RECORDED = ("settings", "hidden_dropout", "attention_dropout", "init_method_std", "vocab_size")


def _heads_refusal(heads: int, groups: int, tp: int) -> Optional[str]:
    if heads % groups:
        return f"--num-query-groups {groups} does not divide --num-attention-heads {heads}"
    if heads % tp:
        return (
            f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}"
        )
    if groups % tp and tp % groups:
        return (
            f"--num-query-groups {groups} must be a multiple or a divisor of "
            f"--tensor-model-parallel-size {tp}"
        )
    return None


def _is_setting(settings: type, key: str) -> bool:
    return any(settings.key(name) == key for name in settings.names(MODEL, INFERENCE, RUN))
