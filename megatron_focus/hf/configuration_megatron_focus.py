"""Configuration of a megatron-focus GPT model in Hugging Face transformers.

Copied next to the weights by `tools/convert_to_hf.py`; needs only transformers. The fields are
the ones that decide what the native Megatron-Core model computes: its family (norm, MLP
activation, biases, positions), its attention shape (GQA, head size), each layer's attention
variant (`layer_attention`) and, for Focus layers, the `focus_*` settings (`pretrain_gpt.py`'s
`--focus-*` flags). `focus_attention_mode` ("soft" gate or "sparse" hard top-k rule) and
`focus_top_k` are inference settings: set them on a loaded model's config at any time.
"""

from transformers import PreTrainedConfig

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
# gelu: the exact (erf) GELU; gelu_tanh: GPT-2's; relu2: relu(x)^2
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "relu2")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
ATTENTION_VARIANTS = ("standard", "xsa", "focus", "focus+xsa")
FOCUS_MODES = ("soft", "sparse")


class MegatronFocusConfig(PreTrainedConfig):
    model_type = "megatron_focus"

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 12
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    normalization: str = "LayerNorm"
    norm_eps: float = 1e-5
    activation: str = "gelu"
    bias: bool = True  # on every linear layer but the output layer, as Megatron's add_bias_linear
    qkv_bias: bool = False  # on the q, k, v projections even without `bias` (--add-qkv-bias)
    qk_norm: bool = False  # a norm (`normalization`) on each query and key head, before RoPE
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    # Llama 3.1's frequency scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None: plain RoPE
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    layer_attention: list[str] | None = None  # one variant per layer; default all "standard"
    sliding_window: int | None = None  # standard / xsa layers: query i sees keys i - w < j <= i
    # Focus (layers "focus" / "focus+xsa"): K groups, routing dim d_g, local window w, temperature,
    # causal Sinkhorn iterations, lambda of the soft gate and its form; then the inference settings.
    focus_groups: int = 8
    focus_dim: int = 16
    focus_window: int = 128
    focus_tau: float = 0.1
    focus_sinkhorn_iters: int = 10
    focus_gate_scale: float = 1.0
    focus_gate: str = "log"  # or "sigmoid": the paper's multiplicative gate (ablations)
    focus_sink_tokens: int = 0  # the first s tokens (of each unpadded sequence): kept, as local
    focus_top_k: int = 2
    focus_attention_mode: str = "soft"
    initializer_range: float = 0.02
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_attention is None:
            self.layer_attention = ["standard"] * self.num_hidden_layers
        for field, value, choices in (
            ("normalization", self.normalization, NORMALIZATIONS),
            ("activation", self.activation, ACTIVATIONS),
            ("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS),
        ):
            if value not in choices:
                raise ValueError(f"{field}={value!r}; expected one of {choices}")
        unknown = set(self.layer_attention) - set(ATTENTION_VARIANTS)
        if unknown or len(self.layer_attention) != self.num_hidden_layers:
            raise ValueError(f"layer_attention must name one of {ATTENTION_VARIANTS} per layer "
                             f"({self.num_hidden_layers}), got {self.layer_attention}")
        if self.sliding_window is not None and (
                self.sliding_window < 1
                or any(kind.startswith("focus") for kind in self.layer_attention)):
            raise ValueError(f"sliding_window={self.sliding_window}: a positive window, for "
                             "standard and xsa layers (Focus has focus_window)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads must divide num_attention_heads")
        if any(kind.startswith("focus") for kind in self.layer_attention):
            check_focus_inference(self)
        super().__post_init__(**kwargs)


def check_focus_inference(config: MegatronFocusConfig) -> None:
    """The Focus inference settings, checked at load time and again at every forward."""
    if config.focus_attention_mode not in FOCUS_MODES:
        raise ValueError(f"focus_attention_mode={config.focus_attention_mode!r}; expected one of "
                         f"{FOCUS_MODES}")
    if config.focus_gate not in ("log", "sigmoid"):
        raise ValueError(f"focus_gate={config.focus_gate!r}; expected log or sigmoid")
    if not 1 <= config.focus_top_k <= config.focus_groups:
        raise ValueError(f"focus_top_k={config.focus_top_k} must be between 1 and focus_groups "
                         f"({config.focus_groups})")


__all__ = ["MegatronFocusConfig"]
