"""The HF model classes a native model maps to, each with its config and its weight rules.

Export picks the stock class that computes exactly what the native model computes:
`LlamaForCausalLM` (RMSNorm, SwiGLU, RoPE; biases via `attention_bias`/`mlp_bias`),
`Qwen2ForCausalLM` (the same with a QKV bias alone, `--add-qkv-bias`), `MistralForCausalLM` (the
same without biases, with a sliding window, `--window-size`) or `GPT2LMHeadModel` (LayerNorm,
exact GELU, biases, learned positions, tied embeddings, no GQA); anything else, XSA and Focus
included, goes to this project's own `MegatronFocusForCausalLM`, which covers both families and
every attention variant. Import reads Llama, Mistral, Qwen2,
GPT-2 and megatron_focus configs, and refuses what the native model cannot compute exactly.

Weight names (`.weight`, and `.bias` where there is one; layer i's names continue its prefix):

    Megatron                          Llama / megatron_focus           GPT-2
    embedding.word_embeddings         model.embed_tokens               transformer.wte
    embedding.position_embeddings     model.embed_positions (1)        transformer.wpe
    decoder.layers.i.                 model.layers.i.                  transformer.h.i.
      input_layernorm                   input_layernorm                  ln_1
      self_attention.linear_qkv         self_attn.{q,k,v}_proj (2)       attn.c_attn (3)
      self_attention.linear_proj        self_attn.o_proj                 attn.c_proj (4)
      pre_mlp_layernorm                 post_attention_layernorm         ln_2
      mlp.linear_fc1                    mlp.{gate,up}_proj (5)           mlp.c_fc (4)
      mlp.linear_fc2                    mlp.down_proj                    mlp.c_proj (4)
      self_attention.core_attention.
        router.proj                     self_attn.router.proj (6)
        router.centroids                self_attn.router.centroids (6)
    decoder.final_layernorm           model.norm                       transformer.ln_f
    output_layer (untied only)        lm_head                          (always tied)

(1) megatron_focus with learned positions only. (2) cut out of Megatron's fused QKV, whose rows
are, per query group, that group's query heads, then its key, then its value. (3) all query
heads, then all keys, then all values, transposed. (4) transposed (GPT-2's Conv1D is `[in, out]`).
(5) SwiGLU's fused fc1 is `[gate; up]`; with GELU, fc1 is `mlp.up_proj`. (6) Focus layers only
(megatron_focus); `centroids` is a parameter, not a module, and has no `.weight` suffix.
"""

import dataclasses
import re
from typing import List, Optional, Tuple

import torch

from megatron_focus.hf.architecture import (
    layer_attention,
    layer_settings,
    routing_settings,
    shipped_layers,
)
from megatron_focus.hf.mapping import Rule, copy, merge_qkv, split_qkv, transposed, zero_bias
from megatron_focus.model.config import ModelConfig
from megatron_focus.settings import VariantSettings
from megatron_focus.variants import INFERENCE, MODEL, VARIANTS, FocusConfig, variant

LLAMA, QWEN2, MISTRAL, GPT2, CUSTOM = "llama", "qwen2", "mistral", "gpt2", "megatron_focus"
HF_CLASS = {
    LLAMA: "LlamaForCausalLM",
    QWEN2: "Qwen2ForCausalLM",
    MISTRAL: "MistralForCausalLM",
    GPT2: "GPT2LMHeadModel",
    CUSTOM: "MegatronFocusForCausalLM",
}


@dataclasses.dataclass(frozen=True)
class HFBiases:
    """Which linear layers of the HF model have biases (Megatron's `add_bias_linear` is one
    flag)."""

    qkv: bool
    proj: bool
    mlp: bool

    @classmethod
    def every(cls, flag: bool) -> "HFBiases":
        return cls(flag, flag, flag)

    @classmethod
    def of(cls, arch: ModelConfig) -> "HFBiases":
        """The biases the native model has."""
        return cls(
            arch.add_bias_linear or arch.add_qkv_bias, arch.add_bias_linear, arch.add_bias_linear
        )


# --- which family --------------------------------------------------------------------------------


def _not_llama_like(arch: ModelConfig) -> Optional[str]:
    if set(layer_attention(arch)) != {"standard"}:
        return f"--attention {arch.attention}"
    if arch.qk_layernorm:
        return "query and key norms"
    if (arch.normalization, arch.swiglu, arch.position_embedding_type) != ("RMSNorm", True, "rope"):
        return "not RMSNorm + SwiGLU + RoPE"
    if arch.hidden_size % arch.num_attention_heads:
        return "hidden size not divisible by the heads (LlamaConfig refuses it)"
    return None


def _not_llama(arch: ModelConfig) -> Optional[str]:
    if arch.window_size is not None:
        return "sliding-window attention"
    return _not_llama_like(arch)


def _not_qwen2(arch: ModelConfig) -> Optional[str]:
    if arch.window_size is not None:
        return "sliding-window attention (Qwen2's applies to upper layers only)"
    if arch.kv_channels * arch.num_attention_heads != arch.hidden_size:
        return "head size x heads != hidden size (Qwen2Config has no head_dim)"
    return _not_llama_like(arch)


def _not_mistral(arch: ModelConfig) -> Optional[str]:
    if arch.add_bias_linear:
        return "biases (Mistral has none)"
    return _not_llama_like(arch)


def _not_gpt2(arch: ModelConfig) -> Optional[str]:
    if set(layer_attention(arch)) != {"standard"}:
        return f"--attention {arch.attention}"
    if arch.window_size is not None:
        return "sliding-window attention"
    if arch.qk_layernorm or arch.squared_relu:
        return "query and key norms" if arch.qk_layernorm else "squared ReLU"
    gpt2 = (
        arch.normalization == "LayerNorm"
        and not arch.swiglu
        and arch.add_bias_linear
        and arch.position_embedding_type == "learned_absolute"
        and arch.tied
    )
    if not gpt2:
        return "not LayerNorm + GELU + biases + learned positions + tied embeddings"
    if arch.num_query_groups != arch.num_attention_heads:
        return "grouped-query attention"
    if arch.kv_channels * arch.num_attention_heads != arch.hidden_size:
        return "head size x heads != hidden size"
    return None


def nearest_family(arch: ModelConfig) -> str:
    """The stock family whose shape `arch` has (its norm, biases and window), exact or not."""
    if arch.normalization != "RMSNorm":
        return GPT2
    if arch.add_qkv_bias and not arch.add_bias_linear:
        return QWEN2
    return MISTRAL if arch.window_size is not None else LLAMA


def choose_family(arch: ModelConfig) -> Tuple[str, str]:
    """`(family, why)`: the stock class when it is exact, else the custom one and the reason."""
    family = nearest_family(arch)
    why_not = {LLAMA: _not_llama, QWEN2: _not_qwen2, MISTRAL: _not_mistral, GPT2: _not_gpt2}[
        family
    ](arch)
    if why_not is None:
        return family, f"exactly a {HF_CLASS[family]}"
    return CUSTOM, f"not a stock {HF_CLASS[family]} ({why_not}): needs trust_remote_code=True"


# --- configs -------------------------------------------------------------------------------------


def hf_config(family: str, arch: ModelConfig, special_tokens: dict):
    """The HF config of `arch` in `family`; `special_tokens`: bos/eos/pad_token_id."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig

    llama_like = dict(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_query_groups,
        hidden_act="silu",
        max_position_embeddings=arch.max_position_embeddings,
        rms_norm_eps=arch.norm_epsilon,
        tie_word_embeddings=arch.tied,
        **rope_fields(_rope_parameters(arch)),
        **special_tokens,
    )
    if family == LLAMA:
        return LlamaConfig(
            **llama_like,
            head_dim=arch.kv_channels,
            attention_bias=arch.add_bias_linear,
            mlp_bias=arch.add_bias_linear,
        )
    if family == QWEN2:
        return Qwen2Config(**llama_like, use_sliding_window=False)
    if family == MISTRAL:  # HF counts a window's keys, Megatron the ones before i
        return MistralConfig(
            **llama_like, head_dim=arch.kv_channels, sliding_window=arch.window_size[0] + 1
        )
    if family == GPT2:
        return GPT2Config(
            vocab_size=arch.vocab_size,
            n_positions=arch.max_position_embeddings,
            n_embd=arch.hidden_size,
            n_layer=arch.num_layers,
            n_head=arch.num_attention_heads,
            # None: GPT-2's own way of saying 4 x n_embd, as its released configs write it
            n_inner=None if arch.ffn_hidden_size == 4 * arch.hidden_size else arch.ffn_hidden_size,
            activation_function="gelu_new" if arch.openai_gelu else "gelu",  # as F.gelu
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=arch.norm_epsilon,
            tie_word_embeddings=True,
            **special_tokens,
        )
    return MegatronFocusConfig(
        family=nearest_family(arch),
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_query_groups,
        head_dim=arch.kv_channels,
        normalization=arch.normalization,
        norm_eps=arch.norm_epsilon,
        activation=(
            "swiglu"
            if arch.swiglu
            else "gelu_tanh"
            if arch.openai_gelu
            else "relu2"
            if arch.squared_relu
            else "gelu"
        ),
        bias=arch.add_bias_linear,
        qkv_bias=arch.add_qkv_bias,
        qk_norm=arch.qk_layernorm,
        llama3_rope_scaling={"factor": arch.rope_scaling_factor, **LLAMA3_ROPE}
        if arch.use_rope_scaling
        else None,
        position_embedding_type=arch.position_embedding_type,
        rotary_base=float(arch.rotary_base),
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tied,
        layer_attention=layer_attention(arch),
        # HF counts a window's keys (as Mistral's sliding_window), Megatron the ones before i
        sliding_window=None if arch.window_size is None else arch.window_size[0] + 1,
        **_focus_config(routing_settings(arch)),
        **_shipped_layers_config(arch),
        **special_tokens,
    )


# Megatron-Core's Llama 3.1 RoPE scaling: these fixed, the factor a flag (--rope-scaling-factor).
LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _rope_parameters(arch: ModelConfig) -> dict:
    """HF's `rope_parameters` (its names for --rotary-base and --use-rope-scaling)."""
    if not arch.use_rope_scaling:
        return {"rope_type": "default", "rope_theta": float(arch.rotary_base)}
    return {
        "rope_type": "llama3",
        "rope_theta": float(arch.rotary_base),
        "factor": arch.rope_scaling_factor,
        **LLAMA3_ROPE,
    }


def rope_fields(rope: dict) -> dict:
    """A stock config's RoPE keywords: `rope_parameters` for transformers 5, `rope_theta` and
    `rope_scaling` for 4.x (which ignores `rope_parameters`)."""
    from transformers import __version__

    if int(__version__.split(".")[0]) >= 5:
        return {"rope_parameters": rope}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if scaling["rope_type"] == "default" else scaling,
    }


def _hf_rope(config) -> dict:
    """A stock config's RoPE as transformers 5's `rope_parameters`, whichever version read it."""
    rope = getattr(config, "rope_parameters", None)
    if rope is not None:
        return rope
    scaling = dict(getattr(config, "rope_scaling", None) or {})  # Mistral 4.x has none
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    return {**scaling, "rope_type": kind, "rope_theta": config.rope_theta}


def _rope_scaling(rope: Optional[dict]) -> dict:
    """ModelConfig fields of HF `rope_parameters`; refuses a scaling the native model lacks."""
    kind = (rope or {}).get("rope_type", "default")
    if kind == "default":
        return {}
    _require(
        kind == "llama3", f"RoPE scaling {kind!r} (only plain RoPE and Llama 3.1's are native)"
    )
    _require(
        all(float(rope.get(key, -1)) == value for key, value in LLAMA3_ROPE.items()),
        f"Llama 3.1 RoPE scaling other than Megatron-Core's {LLAMA3_ROPE}: {rope}",
    )
    return {"use_rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}


def _focus_config(focus: Optional[FocusConfig]) -> dict:
    """MegatronFocusConfig's `focus_*` fields (its defaults without Focus: they are then unused)."""
    return {} if focus is None else focus.keys(MODEL, INFERENCE)


def shipped_file(layer: str) -> Tuple[str, str]:
    """(module file name, class name) of a shipped HF layer's "module:Class" in the folder."""
    module, _, name = layer.partition(":")
    return module.rpartition(".")[2], name


def _shipped_layers_config(arch: ModelConfig) -> dict:
    """MegatronFocusConfig's `variant_layers` ({kind: "file.Class"} of the layers the variants
    ship beside the model's code) and those variants' settings under their recorded keys; a key
    the config already uses for a setting of its own is refused by name."""
    from megatron_focus.hf.configuration_megatron_focus import MegatronFocusConfig

    layers = shipped_layers(arch)
    if not layers:
        return {}
    settings = {} if layer_settings(arch) is None else layer_settings(arch).keys(MODEL, INFERENCE)
    own = MegatronFocusConfig().to_dict()
    taken = [key for key in settings if key in own or hasattr(MegatronFocusConfig, key)]
    if taken:
        raise NotImplementedError(
            f"--attention {arch.attention} records {', '.join(taken)}, which the HF config "
            "already uses for a setting of its own: not exported"
        )
    return {
        "variant_layers": {kind: ".".join(shipped_file(layer)) for kind, layer in layers.items()},
        **settings,
    }


def _require(ok: bool, why: str) -> None:
    if not ok:
        raise NotImplementedError(f"cannot import exactly: {why}")


def from_hf_config(config) -> Tuple[str, ModelConfig, HFBiases]:
    """`(family, architecture, biases)` of an HF config; refuses what is not exactly native."""
    kind = config.model_type
    if kind in ("llama", "mistral", "qwen2"):
        return _from_llama_like(config)
    if kind == "gpt2":
        return GPT2, _from_gpt2(config), HFBiases.every(True)
    if kind == CUSTOM:
        arch = _from_custom(config)
        return CUSTOM, arch, HFBiases.of(arch)
    raise NotImplementedError(
        f"HF model type {kind!r} is not supported; supported: llama, "
        "mistral, qwen2, gpt2, megatron_focus"
    )


def _from_llama_like(config) -> Tuple[str, ModelConfig, HFBiases]:
    kind = config.model_type
    _require(config.hidden_act == "silu", f"hidden_act {config.hidden_act!r} (SwiGLU needs silu)")
    rope = _hf_rope(config)
    theta = rope["rope_theta"]
    _require(float(theta).is_integer(), f"rope_theta {theta} is not an integer (--rotary-base)")
    window, family = None, LLAMA
    if kind == "mistral":  # sliding_window keys, the query's own included (None: all)
        window = None if config.sliding_window is None else (config.sliding_window - 1, 0)
        family, biases = MISTRAL, HFBiases.every(False)
    elif kind == "qwen2":
        _require(
            not config.use_sliding_window,
            "use_sliding_window (Qwen2's window applies "
            "to upper layers only): native attention has one window for all layers",
        )
        family, biases = QWEN2, HFBiases(qkv=True, proj=False, mlp=False)
    else:
        biases = HFBiases(config.attention_bias, config.attention_bias, config.mlp_bias)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    arch = ModelConfig(
        vocab_size=config.vocab_size,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads or config.num_attention_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        norm_epsilon=config.rms_norm_eps,
        swiglu=True,
        add_bias_linear=biases.proj or biases.mlp,
        add_qkv_bias=biases.qkv and not (biases.proj or biases.mlp),
        position_embedding_type="rope",
        rotary_base=int(theta),
        max_position_embeddings=config.max_position_embeddings,
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        window_size=window,
        **_rope_scaling(rope),
    )
    return family, arch, biases


# HF GPT-2's activation names -> our --openai-gelu (both tanh names are the same function)
GPT2_GELU = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


def _from_gpt2(config) -> ModelConfig:
    _require(
        config.activation_function in GPT2_GELU,
        f"activation_function {config.activation_function!r}: only the exact GELU ('gelu') "
        "and its tanh approximation ('gelu_new', --openai-gelu) are mapped",
    )
    _require(
        config.scale_attn_weights and not config.scale_attn_by_inverse_layer_idx,
        "GPT-2 attention scaling other than 1/sqrt(head size)",
    )
    _require(not config.add_cross_attention, "cross attention")
    _require(config.tie_word_embeddings, "untied GPT-2 embeddings")
    return ModelConfig(
        vocab_size=config.vocab_size,
        num_layers=config.n_layer,
        hidden_size=config.n_embd,
        ffn_hidden_size=config.n_inner or 4 * config.n_embd,
        num_attention_heads=config.n_head,
        num_query_groups=config.n_head,
        kv_channels=config.n_embd // config.n_head,
        normalization="LayerNorm",
        norm_epsilon=config.layer_norm_epsilon,
        swiglu=False,
        add_bias_linear=True,
        position_embedding_type="learned_absolute",
        rotary_base=10000,
        max_position_embeddings=config.n_positions,
        untie_embeddings_and_output_weights=False,
        openai_gelu=GPT2_GELU[config.activation_function],
    )


def _from_custom(config) -> ModelConfig:
    from megatron_focus.hf.configuration_megatron_focus import ATTENTION_VARIANTS

    kinds = config.layer_attention
    shipped = [v.name for v in VARIANTS.values() if v.hf_layer is not None]
    unknown = sorted(set(kinds) - set(ATTENTION_VARIANTS) - set(shipped))
    declared = getattr(config, "variant_layers", None) or {}
    unregistered = [kind for kind in unknown if kind in declared]
    if unregistered:
        raise ValueError(
            f"layer_attention {', '.join(map(repr, unregistered))}: the layer of attention "
            f"variant {unregistered[0]!r} ({declared[unregistered[0]]}), which is not "
            "registered here; register it (MEGATRON_FOCUS_VARIANTS) to import the model"
        )
    if unknown:
        raise ValueError(
            f"layer_attention {', '.join(map(repr, unknown))}: a layer kind the importer does not "
            f"know; it knows {', '.join([*ATTENTION_VARIANTS, *shipped])}"
        )
    if set(kinds) - set(ATTENTION_VARIANTS):  # a variant's own layers
        _require(len(set(kinds)) == 1, f"layers of several kinds ({kinds})")
        attention, xsa = kinds[0], []
    else:
        # The native variant: the kind with XSA where layers have it (--xsa-layers picks them
        # among layers of that variant without XSA), else the one kind of every layer.
        with_xsa = sorted({kind for kind in kinds if variant(kind).xsa})
        _require(len(with_xsa) <= 1, f"layers of several kinds ({kinds})")
        attention = with_xsa[0] if with_xsa else kinds[0]
        without = variant(attention).without_xsa if with_xsa else attention
        _require(set(kinds) <= {attention, without}, f"layers of several kinds ({kinds})")
        xsa = [i + 1 for i, kind in enumerate(kinds) if kind == attention] if with_xsa else []
    _require(float(config.rotary_base).is_integer(), "a rotary_base that is not an integer")
    return ModelConfig(
        vocab_size=config.vocab_size,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim,
        normalization=config.normalization,
        norm_epsilon=config.norm_eps,
        swiglu=config.activation == "swiglu",
        openai_gelu=config.activation == "gelu_tanh",
        squared_relu=config.activation == "relu2",
        qk_layernorm=config.qk_norm,
        add_bias_linear=config.bias,
        add_qkv_bias=config.qkv_bias and not config.bias,
        position_embedding_type=config.position_embedding_type,
        rotary_base=int(config.rotary_base),
        max_position_embeddings=config.max_position_embeddings,
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        attention=attention,
        xsa_layers=None if len(xsa) in (0, config.num_hidden_layers) else tuple(xsa),
        window_size=None if config.sliding_window is None else (config.sliding_window - 1, 0),
        **_rope_scaling(
            config.llama3_rope_scaling and {"rope_type": "llama3", **config.llama3_rope_scaling}
        ),
        settings=_shipped_settings(config, variant(attention)),
    )


def _shipped_settings(config, attention) -> Optional[VariantSettings]:
    """The variant's settings as the HF config holds them under their keys; a model setting it
    lacks is refused by name (it would come back at a default)."""
    if attention.settings is None:
        return None
    cls = attention.settings
    missing = [cls.key(name) for name in cls.names(MODEL) if not hasattr(config, cls.key(name))]
    if missing:
        raise ValueError(
            f"the HF config lacks {', '.join(missing)}, which --attention {attention.name} "
            "records: not imported, as it would come back at a default"
        )
    return cls(
        **{
            name: getattr(config, cls.key(name))
            for name in cls.names(MODEL, INFERENCE)
            if hasattr(config, cls.key(name))
        }
    )


# --- weights -------------------------------------------------------------------------------------

# A shipped HF layer holds its core attention's own tensors under their native names, as Focus's
# layer holds its router: decoder.layers.i.self_attention.core_attention.X is
# model.layers.i.self_attn.X
_NATIVE_OWN = re.compile(r"decoder\.layers\.(\d+)\.self_attention\.core_attention\.(.+)")
_HF_OWN = re.compile(r"model\.layers\.(\d+)\.self_attn\.(.+)")


def shipped_layer_rules(
    arch: ModelConfig, taken: List[Rule], native_names=(), hf_names=()
) -> List[Rule]:
    """The rules of the tensors of the layers `arch`'s variants ship that `taken` leaves, named
    from the weights at hand (`native_names` exporting, `hf_names` importing): a layer's own
    tensors are the variant's to name, and the HF model built around them refuses, by name, any
    its layer does not hold or lacks."""
    kinds = shipped_layers(arch)
    layers = {i for i, kind in enumerate(layer_attention(arch)) if kind in kinds}
    native_taken = {rule.native for rule in taken}
    hf_taken = {name for rule in taken for name in rule.hf}
    out = []
    for name in native_names:
        match = _NATIVE_OWN.fullmatch(name)
        if match and int(match[1]) in layers and name not in native_taken:
            out.append(copy(name, f"model.layers.{match[1]}.self_attn.{match[2]}"))
    for name in hf_names:
        match = _HF_OWN.fullmatch(name)
        if match and int(match[1]) in layers and name not in hf_taken:
            native = f"decoder.layers.{match[1]}.self_attention.core_attention.{match[2]}"
            out.append(copy(native, name))
    return out


def rules(family: str, arch: ModelConfig, biases: HFBiases) -> List[Rule]:
    """The weight rules of `arch` in `family` (see the table above)."""
    return _gpt2_rules(arch) if family == GPT2 else _llama_style_rules(arch, biases)


def _norm(arch: ModelConfig, native: str, hf: str) -> List[Rule]:
    """A norm's scale (as applied: `1 + weight` under --apply-layernorm-1p) and bias."""
    out = [
        Rule(f"{native}.weight", (f"{hf}.weight",), lambda t: (t + 1,), lambda t: t - 1)
        if arch.apply_layernorm_1p
        else copy(f"{native}.weight", f"{hf}.weight")
    ]
    if arch.normalization == "LayerNorm":
        out.append(copy(f"{native}.bias", f"{hf}.bias"))
    return out


def _linear(
    native_bias: bool,
    native: str,
    hf: List[str],
    hf_bias: bool,
    out_features: int,
    split=lambda t: (t,),
    merge=lambda t: t,
) -> List[Rule]:
    """Weight and bias of one Megatron linear layer, as one or more HF linear layers."""
    out = [Rule(f"{native}.weight", tuple(f"{m}.weight" for m in hf), split, merge)]
    if native_bias and hf_bias:
        out.append(Rule(f"{native}.bias", tuple(f"{m}.bias" for m in hf), split, merge))
    elif native_bias:
        out.append(zero_bias(f"{native}.bias", out_features))
    return out


def _llama_style_rules(arch: ModelConfig, biases: HFBiases) -> List[Rule]:
    hidden, hn = arch.hidden_size, arch.kv_channels
    qkv_rows = (arch.num_attention_heads + 2 * arch.num_query_groups) * hn
    out = [copy("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    if arch.position_embedding_type == "learned_absolute":
        out.append(copy("embedding.position_embeddings.weight", "model.embed_positions.weight"))
    for i in range(arch.num_layers):
        native, hf = f"decoder.layers.{i}", f"model.layers.{i}"
        out += _norm(arch, f"{native}.input_layernorm", f"{hf}.input_layernorm")
        ours = HFBiases.of(arch)
        out += _linear(
            ours.qkv,
            f"{native}.self_attention.linear_qkv",
            [f"{hf}.self_attn.{p}_proj" for p in "qkv"],
            biases.qkv,
            qkv_rows,
            lambda t: split_qkv(t, arch),
            lambda q, k, v: merge_qkv(q, k, v, arch),
        )
        if arch.qk_layernorm:
            out += [
                rule
                for p in "qk"
                for rule in _norm(
                    arch, f"{native}.self_attention.{p}_layernorm", f"{hf}.self_attn.{p}_norm"
                )
            ]
        out += _linear(
            ours.proj,
            f"{native}.self_attention.linear_proj",
            [f"{hf}.self_attn.o_proj"],
            biases.proj,
            hidden,
        )
        out += _norm(arch, f"{native}.pre_mlp_layernorm", f"{hf}.post_attention_layernorm")
        if arch.swiglu:
            out += _linear(
                ours.mlp,
                f"{native}.mlp.linear_fc1",
                [f"{hf}.mlp.gate_proj", f"{hf}.mlp.up_proj"],
                biases.mlp,
                2 * arch.ffn_hidden_size,
                lambda t: t.chunk(2),
                lambda gate, up: torch.cat([gate, up]),
            )
        else:
            out += _linear(
                ours.mlp,
                f"{native}.mlp.linear_fc1",
                [f"{hf}.mlp.up_proj"],
                biases.mlp,
                arch.ffn_hidden_size,
            )
        out += _linear(
            ours.mlp, f"{native}.mlp.linear_fc2", [f"{hf}.mlp.down_proj"], biases.mlp, hidden
        )
        if routing_settings(arch) is not None:
            out += [
                copy(
                    f"{native}.self_attention.core_attention.router.{p}",
                    f"{hf}.self_attn.router.{p}",
                )
                for p in ("proj.weight", "centroids")
            ]
    out += _norm(arch, "decoder.final_layernorm", "model.norm")
    if not arch.tied:
        out.append(copy("output_layer.weight", "lm_head.weight"))
    return out


def _fused_qkv(arch: ModelConfig, native: str, hf: str) -> Rule:
    """GPT-2's `c_attn`: all query heads, then all keys, then all values; weight transposed."""
    flip = lambda t: t.t() if t.ndim == 2 else t  # noqa: E731
    rows = [arch.num_attention_heads * arch.kv_channels] * 3
    return Rule(
        native,
        (hf,),
        lambda t: (flip(torch.cat(split_qkv(t, arch))).contiguous(),),
        lambda t: merge_qkv(*flip(t).split(rows), arch),
    )


def _gpt2_rules(arch: ModelConfig) -> List[Rule]:
    out = [
        copy("embedding.word_embeddings.weight", "transformer.wte.weight"),
        copy("embedding.position_embeddings.weight", "transformer.wpe.weight"),
    ]
    for i in range(arch.num_layers):
        native, hf = f"decoder.layers.{i}", f"transformer.h.{i}"
        out += _norm(arch, f"{native}.input_layernorm", f"{hf}.ln_1")
        out += _norm(arch, f"{native}.pre_mlp_layernorm", f"{hf}.ln_2")
        for p in ("weight", "bias"):
            out += [
                _fused_qkv(
                    arch, f"{native}.self_attention.linear_qkv.{p}", f"{hf}.attn.c_attn.{p}"
                ),
                transposed(f"{native}.self_attention.linear_proj.{p}", f"{hf}.attn.c_proj.{p}"),
                transposed(f"{native}.mlp.linear_fc1.{p}", f"{hf}.mlp.c_fc.{p}"),
                transposed(f"{native}.mlp.linear_fc2.{p}", f"{hf}.mlp.c_proj.{p}"),
            ]
    out += _norm(arch, "decoder.final_layernorm", "transformer.ln_f")
    return out
