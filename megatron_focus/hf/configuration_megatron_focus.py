"""Configuration of a megatron-focus GPT model in Hugging Face transformers.

Copied next to the weights by `tools/convert_to_hf.py`; needs only transformers. The fields are
the ones that decide what the native Megatron-Core model computes: its family (norm, MLP
activation, biases, positions), its attention shape (GQA, head size), each layer's attention
variant (`layer_attention`) and, for Focus layers, the `focus_*` settings (`pretrain_gpt.py`'s
`--focus-*` flags). An attention variant that ships its own layer adds its layer kind
(`variant_layers`, the folder's file and class of each) and its settings, under their recorded
keys (docs/extending.md). `focus_attention_mode` ("soft" gate or "sparse" hard top-k rule) and
`focus_top_k` are inference settings: set them on a loaded model's config at any time.
"""

from transformers import PretrainedConfig  # transformers 4.x's name, kept by 5.x

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# gelu: the exact (erf) GELU; gelu_tanh: GPT-2's; relu2: relu(x)^2
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "relu2")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
ATTENTION_VARIANTS = ("standard", "xsa", "focus", "focus+xsa")
ROUTED = ("focus", "focus+xsa")  # the layer kinds with a router, set by the focus_* fields
FOCUS_MODES = ("soft", "sparse")

# Every field and its default. An explicit __init__ (not 5.x's dataclass fields) is what both
# transformers 4.57+ and 5.x accept from a model folder's code.
DEFAULTS = dict(
    # the stock family this model is a variant of (llama, qwen2, mistral, gpt2): the one it
    # would export to without its XSA, Focus or other extra
    family=None,
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=None,  # default: num_attention_heads
    head_dim=None,  # default: hidden_size // num_attention_heads
    normalization="LayerNorm",
    norm_eps=1e-5,
    activation="gelu",
    bias=True,  # on every linear layer but the output layer, as Megatron's add_bias_linear
    qkv_bias=False,  # on the q, k, v projections even without `bias` (--add-qkv-bias)
    qk_norm=False,  # a norm (`normalization`) on each query and key head, before RoPE
    position_embedding_type="learned_absolute",
    rotary_base=10000.0,
    # Llama 3.1's frequency scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None: plain RoPE. Not `rope_scaling`, which
    # transformers 5 rewrites into its own `rope_parameters`.
    llama3_rope_scaling=None,
    max_position_embeddings=2048,
    layer_attention=None,  # one variant per layer; default all "standard"
    # the layer kinds attention variants ship beside this code: {kind: "file.Class"}, registered
    # by the folder's modeling_megatron_focus_variants.py
    variant_layers=None,
    sliding_window=None,  # standard / xsa layers: query i sees keys i - w < j <= i
    # Focus (layers "focus" / "focus+xsa"): K groups, routing dim d_g, local window w,
    # temperature, causal Sinkhorn iterations, lambda of the soft gate and its form; then the
    # inference settings.
    focus_groups=8,
    focus_dim=16,
    focus_window=128,
    focus_tau=0.1,
    focus_sinkhorn_iters=10,
    focus_gate_scale=1.0,
    focus_gate="log",  # or "sigmoid": the paper's multiplicative gate (ablations)
    focus_sink_tokens=0,  # the first s tokens (of each unpadded sequence): kept, as local
    focus_router="learned",  # how the routers trained (a control's: random); the same compute
    focus_top_k=2,
    focus_attention_mode="soft",
    initializer_range=0.02,
    use_cache=True,
)


class MegatronFocusConfig(PretrainedConfig):
    model_type = "megatron_focus"

    def __init__(self, tie_word_embeddings: bool = True, **kwargs):
        for field, default in DEFAULTS.items():
            setattr(self, field, kwargs.pop(field, default))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_attention is None:
            self.layer_attention = ["standard"] * self.num_hidden_layers
        if self.variant_layers is None:
            self.variant_layers = {}
        self._check()
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def _check(self):
        for field, value, choices in (
            ("normalization", self.normalization, NORMALIZATIONS),
            ("activation", self.activation, ACTIVATIONS),
            ("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS),
        ):
            if value not in choices:
                raise ValueError(f"{field}={value!r}; expected one of {choices}")
        kinds = ATTENTION_VARIANTS + tuple(self.variant_layers)
        unknown = set(self.layer_attention) - set(kinds)
        if unknown or len(self.layer_attention) != self.num_hidden_layers:
            raise ValueError(
                f"layer_attention must name one of {kinds} per layer "
                f"({self.num_hidden_layers}), got {self.layer_attention}"
            )
        if self.sliding_window is not None and (
            self.sliding_window < 1 or any(kind in ROUTED for kind in self.layer_attention)
        ):
            raise ValueError(
                f"sliding_window={self.sliding_window}: a positive window, for "
                "standard and xsa layers (Focus has focus_window)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads must divide num_attention_heads")
        if any(kind in ROUTED for kind in self.layer_attention):
            check_focus_inference(self)


def check_focus_inference(config: MegatronFocusConfig) -> None:
    """The Focus inference settings, checked at load time and again at every forward."""
    if config.focus_attention_mode not in FOCUS_MODES:
        raise ValueError(
            f"focus_attention_mode={config.focus_attention_mode!r}; expected one of {FOCUS_MODES}"
        )
    if config.focus_gate not in ("log", "sigmoid"):
        raise ValueError(f"focus_gate={config.focus_gate!r}; expected log or sigmoid")
    if not 1 <= config.focus_top_k <= config.focus_groups:
        raise ValueError(
            f"focus_top_k={config.focus_top_k} must be between 1 and focus_groups "
            f"({config.focus_groups})"
        )


__all__ = ["MegatronFocusConfig"]
