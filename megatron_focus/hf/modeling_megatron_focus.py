"""A megatron-focus GPT model in Hugging Face transformers (`trust_remote_code=True`).

Copied next to the weights by `tools/convert_to_hf.py`; needs only torch and transformers. It
computes what the native Megatron-Core model computes, for both model families (GPT-2 style:
LayerNorm, GELU, biases, learned positions; Llama style: RMSNorm, SwiGLU, RoPE, GQA) and for each
layer's attention variant (`config.layer_attention`). Weight names follow Llama's.

An attention variant is a subclass of `Attention` that overrides `attend` (which pairs a query
sees) or `project` (what a head outputs from them), as the native `CoreAttention` does; XSA
overrides `project`. `generate()` keeps keys and values in a `DynamicCache`; XSA needs only the
value of each new token itself, which is computed in the same step.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_megatron_focus import MegatronFocusConfig

XSA_EPS = 1e-6  # as megatron_focus.model.xsa.exclusive_projection


def norm(config: MegatronFocusConfig) -> nn.Module:
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


def rotate(t: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Megatron's (non-interleaved) rotary embedding of `t` `[b, heads, s, d]` at `positions` `[b, s]`."""
    d = t.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32, device=t.device) / d)
    angles = positions[:, None, :, None].float() * inv_freq  # [b, 1, s, d/2]
    angles = torch.cat([angles, angles], dim=-1)
    t1, t2 = t.chunk(2, dim=-1)
    rotated = torch.cat([-t2, t1], dim=-1)
    return t * angles.cos().to(t.dtype) + rotated * angles.sin().to(t.dtype)


class Attention(nn.Module):
    """Causal softmax attention with GQA: query head h shares key/value group h // (heads / groups)."""

    def __init__(self, config: MegatronFocusConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        heads, groups, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, heads * hd, bias=config.bias)
        self.k_proj = nn.Linear(config.hidden_size, groups * hd, bias=config.bias)
        self.v_proj = nn.Linear(config.hidden_size, groups * hd, bias=config.bias)
        self.o_proj = nn.Linear(heads * hd, config.hidden_size, bias=config.bias)

    def forward(self, x, positions, mask, cache):
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.config.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.config.position_embedding_type == "rope":
            base = self.config.rotary_base
            q, k = rotate(q, positions, base), rotate(k, positions, base)
        own_v = v  # the values of this step's tokens, before the cached ones are prepended
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        y = self.project(self.attend(q, k, v, mask), own_v)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))

    def attend(self, q, k, v, mask):
        """Per-head outputs `[b, heads, s, d]`; `mask` `[b, 1, s, keys]` is True where a pair is kept."""
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    def project(self, y, own_v):
        return y


class XSAAttention(Attention):
    """Exclusive self attention: each head's output minus its component along the token's own value."""

    def project(self, y, own_v):
        b, groups, s, d = own_v.shape
        compute = torch.promote_types(y.dtype, torch.float32)
        y_grouped = y.to(compute).view(b, groups, -1, s, d)
        v = own_v.to(compute).unsqueeze(2)
        squared_norm = v.square().sum(-1, keepdim=True).clamp_min(XSA_EPS**2)
        z = y_grouped - (y_grouped * v).sum(-1, keepdim=True) / squared_norm * v
        return z.flatten(1, 2).to(y.dtype)


ATTENTION = {"standard": Attention, "xsa": XSAAttention}


class MLP(nn.Module):
    def __init__(self, config: MegatronFocusConfig):
        super().__init__()
        h, f, bias = config.hidden_size, config.intermediate_size, config.bias
        self.swiglu = config.activation == "swiglu"
        if self.swiglu:
            self.gate_proj = nn.Linear(h, f, bias=bias)
        self.up_proj = nn.Linear(h, f, bias=bias)
        self.down_proj = nn.Linear(f, h, bias=bias)

    def forward(self, x):
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: MegatronFocusConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = norm(config)
        self.self_attn = ATTENTION[config.layer_attention[layer_idx]](config, layer_idx)
        self.post_attention_layernorm = norm(config)
        self.mlp = MLP(config)

    def forward(self, x, positions, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), positions, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class MegatronFocusPreTrainedModel(PreTrainedModel):
    config_class = MegatronFocusConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]


class MegatronFocusModel(MegatronFocusPreTrainedModel):
    def __init__(self, config: MegatronFocusConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding_type == "learned_absolute":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, **kwargs) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        b, s = x.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=x.device).expand(b, s)
        if self.config.position_embedding_type == "learned_absolute":
            x = x + self.embed_positions(position_ids)
        mask = causal_mask(s, past, attention_mask, x.device)
        for layer in self.layers:
            x = layer(x, position_ids, mask, cache if use_cache else None)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x), cache=cache if use_cache else None)


def causal_mask(s: int, past: int, attention_mask, device) -> torch.Tensor:
    """`[b or 1, 1, s, past + s]`, True where query i (at position past + i) may see the key.

    A 2D `attention_mask` (1 keep, 0 padding) removes padded keys; each query always keeps its own
    key, so a padded query's (ignored) output stays finite.
    """
    keys = past + s
    query_pos = torch.arange(past, keys, device=device)[:, None]
    key_pos = torch.arange(keys, device=device)[None, :]
    mask = (key_pos <= query_pos)[None, None]
    if attention_mask is not None:
        mask = (mask & attention_mask[:, None, None, -keys:].bool()) | (key_pos == query_pos)
    return mask


class MegatronFocusForCausalLM(MegatronFocusPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MegatronFocusConfig):
        super().__init__(config)
        self.model = MegatronFocusModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache = None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                         use_cache=use_cache)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels,
                                      vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)


__all__ = ["MegatronFocusForCausalLM", "MegatronFocusModel", "MegatronFocusPreTrainedModel"]
