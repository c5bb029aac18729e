"""A megatron-focus GPT model in Hugging Face transformers (`trust_remote_code=True`).

Copied next to the weights by `tools/convert_to_hf.py`; needs only torch and transformers (on a
GPU where megatron-focus is installed, a sparse Focus prefill takes its fused kernel). It
computes what the native Megatron-Core model computes, for both model families (GPT-2 style:
LayerNorm, GELU, biases, learned positions; Llama style: RMSNorm, SwiGLU, RoPE, GQA) and for each
layer's attention variant (`config.layer_attention`: standard, xsa, focus, focus+xsa). Weight
names follow Llama's; a Focus layer adds `self_attn.router.{proj.weight,centroids}`.

An attention variant is a subclass of `Attention` that overrides `route` (what it computes from the
layer's input besides q, k, v), `attend` (which pairs a query sees) or `project` (what a head
outputs from them), as the native `CoreAttention` does; XSA overrides `project`, Focus `route` and
`attend`. `generate()` keeps keys and values in a `DynamicCache`, whose entries grow in place
(`AppendingLayer`; with `sliding_window`, transformers' window layer), or, asked
(`cache_implementation="static"`), in a StaticCache's fixed slots, Focus's routing beside them
(`FocusStaticLayer`), so that a decoding step is one compiled graph; XSA needs only the value of
each new token itself, which is computed in the same step.

Focus (megatron_focus/model/focus/{sinkhorn,focus,focus_gate}.py): the router's causal Sinkhorn
makes token i's assignment depend on tokens <= i only, through one K-vector per Sinkhorn
iteration, the log-sum of exp(L) over the prefix. A Focus layer's cache entry keeps, per cached
token, those prefix sums, so decoding token by token gives the assignments of a full forward.
`config.focus_attention_mode` ("soft" gate or "sparse" hard top-k rule) and
`config.focus_top_k` are read at every forward: change them on a loaded model
(`model.set_focus_mode("sparse")`); a cache filled in one mode goes on in that mode only. The
soft gate is the log-space one, or with `config.focus_gate = "sigmoid"` the paper's (an ablation
setting); its cache (`FocusCacheLayer`) keeps every key in token order and each token's
log-assignment. In sparse mode a layer computes only the pairs the rule keeps
(`sparse_rule_attention`: the window, the sinks, and each group's distant keys for the queries
ranking it in their top-k), in prefill and at every decoding step alike, and its cache
(`FocusSparseCacheLayer`) keeps the keys by top-1 group (`KeyBuckets`), so that a step reads its
groups' keys in place.
"""

import math

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache, StaticLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_megatron_focus import MegatronFocusConfig, check_focus_inference

try:  # transformers 5: initialisers that skip weights already loaded
    from transformers import initialization as init
except ImportError:  # transformers 4
    from torch.nn import init

# What model outputs call the cache: `cache` from transformers 5.24, `past_key_values` before.
CACHE_FIELD = (
    "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
)

# transformers 5's crop takes the tokens to remove (0: none); 4's, the length to keep
CROP_REMOVES = int(transformers.__version__.split(".")[0]) >= 5

XSA_EPS = 1e-6  # as megatron_focus.model.xsa.exclusive_projection


def norm(config: MegatronFocusConfig, size: int = None) -> nn.Module:
    size = size or config.hidden_size
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(size, eps=config.norm_eps)
    return nn.LayerNorm(size, eps=config.norm_eps)


def llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's RoPE frequencies: long wavelengths divided by `factor`, short ones kept, the
    band between interpolated smoothly."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, smoothed, scaled)


def rotary(positions: torch.Tensor, config: MegatronFocusConfig, dtype) -> tuple:
    """(cos, sin) `[b, 1, s, d]` of Megatron's (non-interleaved) rotary embedding at `positions`
    `[b, s]`: computed once per forward, every layer's queries and keys rotate by them."""
    d = config.head_dim
    inv_freq = 1.0 / config.rotary_base ** (
        torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d
    )
    if config.llama3_rope_scaling is not None:
        inv_freq = llama3_scaled(inv_freq, config.llama3_rope_scaling)
    angles = positions[:, None, :, None].float() * inv_freq  # [b, 1, s, d/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(t: torch.Tensor, rope: tuple) -> torch.Tensor:
    """`t` `[b, heads, s, d]` rotated by `rotary`'s (cos, sin)."""
    cos, sin = rope
    t1, t2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat([-t2, t1], dim=-1) * sin


def eager_attention_forward(
    module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs
):
    """transformers' attention-function interface, computed here: softmax(q k^T * scaling +
    attention_mask) v with scores and softmax in fp32, GQA by repeated keys and values; the
    output `[b, s, heads, d]`. `attention_mask` `[b, 1, s, keys]` is additive."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    scores = (query @ key.transpose(-1, -2)).float() * scaling + attention_mask.float()
    return (scores.softmax(-1).to(value.dtype) @ value).transpose(1, 2), None


def additive(keep: torch.Tensor, dtype, bias: torch.Tensor = None) -> torch.Tensor:
    """`bias` (default 0) where `keep`, the dtype's lowest value elsewhere: the additive mask
    that every attention backend takes (the own key is always kept, so no row is empty)."""
    bias = torch.zeros((), dtype=dtype, device=keep.device) if bias is None else bias.to(dtype)
    return bias.masked_fill(~keep, torch.finfo(dtype).min)


class Attention(nn.Module):
    """Causal softmax attention with GQA: query head h shares key/value group h // (heads / groups).

    The softmax runs where `config._attn_implementation` says (`attn_implementation=` at load,
    `model.set_attn_implementation`): "eager" is `eager_attention_forward`; "sdpa",
    "flex_attention" and kernels registered with transformers' `AttentionInterface` go through
    that interface, each given the layer's pairs (and Focus's soft gate) as one additive mask.
    Focus's sparse rule is the exception: it computes its kept pairs alone, in parts merged by
    log-sum-exp, which no backend returns (`sparse_rule_attention`).
    """

    is_causal = True  # read by transformers' attention functions

    def __init_subclass__(cls, **kwargs):
        """A subclass computes more than the layer's pairs through the interface (a gate, a
        rule, scaled queries): it gets a `forward` of its own, so that an engine serving the
        layers whose `forward` calls the attention interface with its own dense attention
        (vLLM's Transformers backend) does not take it for one. `dense_interface = True`
        declares one it may take (XSA: its projection follows the call, in `forward`)."""
        super().__init_subclass__(**kwargs)
        if "forward" not in cls.__dict__ and not cls.__dict__.get("dense_interface", False):
            cls.forward = _own_forward

    def __init__(self, config: MegatronFocusConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        heads, groups, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_key_value_groups = heads // groups  # transformers' name: query heads per group
        self.scaling = hd**-0.5
        qkv_bias = config.bias or config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, groups * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, groups * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * hd, config.hidden_size, bias=config.bias)
        if config.qk_norm:
            self.q_norm, self.k_norm = norm(config, hd), norm(config, hd)

    def forward(self, x, rope, pairs, cache, attention_mask=None):
        b, s, _ = x.shape
        routing = self.route(x, cache, attention_mask)  # before the cache takes this step's keys
        q, k, v = self.qkv(x, rope)
        own_v = v  # the values of this step's tokens, before the cached ones are prepended
        if cache is not None:
            # a sliding-window layer (a DynamicCache made from a config with sliding_window)
            # returns only the last keys
            cache_layer(cache, self.layer_idx, AppendingLayer)
            k, v = cache.update(k, v, self.layer_idx)
        if type(self).attend is Attention.attend:  # the pairs alone: the interface, called here
            backend = self.config._attn_implementation
            function = _transformers4_interface(backend)
            if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):  # transformers 5
                function = ALL_ATTENTION_FUNCTIONS.get_interface(backend, eager_attention_forward)
            bias = _backend_mask(pairs.additive(k.shape[2], q.dtype), q, backend)
            y, _ = function(self, q, k, v, bias, dropout=0.0, scaling=self.scaling)
            # [b, s, heads, d] (an engine's own function may give [b, s, heads * d])
            y = y.reshape(b, s, -1, self.config.head_dim).transpose(1, 2)
        else:
            y = self.attend(q, k, v, pairs, routing)
        y = self.project(y, own_v)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))

    def qkv(self, x, rope) -> tuple:
        """This step's q, k, v `[b, heads, s, d]` of `x`, normed and rotated (an engine serving
        the layer with its own attention computes them by this too)."""
        b, s, _ = x.shape
        q, k, v = (
            proj(x).view(b, s, -1, self.config.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope)
        return q, k, v

    def route(self, x, cache, attention_mask):
        """What `attend` needs from the layer's input besides q, k, v (Focus: assignments)."""
        return None

    def attend(self, q, k, v, pairs, routing=None):
        """Per-head outputs `[b, heads, s, d]` over the `CausalPairs` the keys `k` allow."""
        return self.softmax_attention(q, k, v, pairs.additive(k.shape[2], q.dtype))

    def softmax_attention(self, q, k, v, bias):
        """softmax(q k^T / sqrt(d) + bias) v `[b, heads, s, d]` on the configured backend (as
        `forward` calls it for the pairs alone)."""
        backend = self.config._attn_implementation
        function = _transformers4_interface(backend)
        if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):  # transformers 5
            function = ALL_ATTENTION_FUNCTIONS.get_interface(backend, eager_attention_forward)
        out, _ = function(self, q, k, v, _backend_mask(bias, q, backend), dropout=0.0,
                          scaling=self.scaling)  # fmt: skip
        return out.transpose(1, 2)

    def project(self, y, own_v):
        return y


def _own_forward(self, x, rope, pairs, cache, attention_mask=None):
    """Attention.forward, under a subclass's own name (Attention.__init_subclass__)."""
    return Attention.forward(self, x, rope, pairs, cache, attention_mask)


def _transformers4_interface(backend):
    """The backend's attention function in transformers 4 (5 looks it up by get_interface)."""
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface") or backend in (None, "eager"):
        return eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[backend]


def _backend_mask(bias, q, backend):
    """An additive mask as the backend takes it: per row, as a view (no copy), and a tensor of
    its own for flex_attention, which reads it as one."""
    bias = bias.expand(q.shape[0], -1, -1, -1)
    return bias.contiguous() if backend == "flex_attention" else bias


class XSAAttention(Attention):
    """Exclusive self attention: each head's output minus its component along the token's own
    value."""

    dense_interface = True  # the projection follows the interface's call, in `forward`

    def project(self, y, own_v):
        b, groups, s, d = own_v.shape
        compute = torch.promote_types(y.dtype, torch.float32)
        y_grouped = y.to(compute).view(b, groups, -1, s, d)
        v = own_v.to(compute).unsqueeze(2)
        squared_norm = v.square().sum(-1, keepdim=True).clamp_min(XSA_EPS**2)
        z = y_grouped - (y_grouped * v).sum(-1, keepdim=True) / squared_norm * v
        return z.flatten(1, 2).to(y.dtype)


# --- Focus ---------------------------------------------------------------------------------------
# Each function mirrors the native code its docstring names (megatron_focus/model/focus/...), the
# reference that the tests compare this file with.

_TINY_AFFINITY = 1e-30  # as megatron_focus/model/focus/focus_gate.py


def causal_sinkhorn(scores, iters, keep=None, prefix=None):
    """Causal Sinkhorn in log space (megatron_focus/model/focus/sinkhorn.py), continuing a prefix.

    For the scores S `[b, s, K]` of s tokens, L^0 = log_softmax(S) over groups and, t = 1..iters,

        token side:  L'_i  = L^{t-1}_i - (log sum_{j<=i} exp(L^{t-1}_j) - log c_i)
        group side:  L^t_i = log_softmax(L'_i)

    with c_i the number of tokens up to i. log c_i is the same for every group, so the group
    side's softmax cancels it: only the sums are computed. The sum over j <= i is all token i
    needs of earlier tokens: `prefix` `[b, iters, K]` holds it, per iteration, for the tokens
    before these s (None: there are none), and the scan continues from it. `keep` `[b, s]`
    (False: padding) leaves tokens out of the sums.

    Returns the log-assignments `[b, s, K]` and, up to each token, the log-sums
    `[b, s, iters, K]`, whose last row is the next call's `prefix`.
    """
    b, s, groups = scores.shape
    log_g = torch.log_softmax(scores, dim=-1)
    padding = None if keep is None else ~keep[..., None]
    before = () if prefix is None else prefix[:, :, None].unbind(1)  # per iteration `[b, 1, K]`
    sums = []
    for t in range(iters):
        if s == 1 and prefix is not None:  # a decoding step: the prefix's sum and this token's
            terms = log_g if padding is None else log_g.masked_fill(padding, float("-inf"))
            running = torch.logaddexp(before[t], terms)
        else:
            running = log_prefix_sums(log_g, padding, before[t] if before else None)
        sums.append(running)
        # A padding token normalises by itself alone: finite, and never attended to.
        own = running if padding is None else torch.where(padding, log_g, running)
        log_g = torch.log_softmax(log_g - own, dim=-1)
    sums = torch.stack(sums, dim=2) if sums else scores.new_zeros(b, s, 0, groups)
    return log_g, sums


_LOG_MASS_FLOOR = -700.0  # as sinkhorn.py: float64's exp underflows below -745


def log_prefix_sums(log_g, padding=None, prefix=None):
    """log(exp(prefix) + sum_{j<=i} exp(log_g_j)) over the tokens of `[b, s, K]`, padding left
    out, as megatron_focus/model/focus/sinkhorn.py `log_prefix_sums`: float64 cumulative sums
    of the masses, a log-mass below -700 counted as -700 (faster than logcumsumexp on the
    CPU). `prefix` `[b, 1, K]`: the log-sum before these tokens (None: there are none)."""
    masses = log_g.double().clamp_min(_LOG_MASS_FLOOR).exp()
    if padding is not None:
        masses = masses.masked_fill(padding, 0.0)
    sums = masses.cumsum(dim=1)
    if prefix is not None:
        sums = sums + prefix.double().exp()
    return sums.log().to(log_g.dtype)


def first_real(real: torch.Tensor, count: int) -> torch.Tensor:
    """`[b, n]`: which tokens are the sinks, each row's first `count` real ones (`real`, padding
    False), as the native rule counts them."""
    return real & (real.long().cumsum(-1) <= count)


def rank_groups(log_g):
    """`[..., K]` group indices by decreasing assignment, the lowest index first among equals
    (megatron_focus/model/focus/groups.py): a token's top-1 group is the same for every top-k
    asked."""
    return torch.sort(log_g, dim=-1, descending=True, stable=True).indices


def local_pairs(query_pos: torch.Tensor, keys: int, window: int):
    """`[queries, keys]`: key j within the window of the query at position i, i - w < j."""
    return (query_pos[:, None] - torch.arange(keys, device=query_pos.device)[None, :]) < window


def soft_gate(log_g_q, log_g_k, local, gate_scale: float):
    """Additive logit bias `[b, s, keys]`: 0 local, lambda * log(g_i . g_j) distant.

    The log-space gate of megatron_focus/model/focus/focus_gate.py `soft_pair_bias`: an affinity
    of 0 removes the pair exactly (causality is the caller's mask).
    """
    affinity = torch.bmm(log_g_q.exp(), log_g_k.exp().transpose(1, 2))
    log_gate = gate_scale * affinity.clamp_min(_TINY_AFFINITY).log()
    return torch.where(
        local, torch.zeros((), dtype=log_gate.dtype, device=log_gate.device), log_gate
    )


def sigmoid_gate(log_g_q, log_g_k, local, gate_scale: float):
    """The paper's gate, a factor `[b, s, keys]` on the logits: 1 local, sigmoid(lambda * g_i . g_j)
    distant (megatron_focus/model/focus/focus_gate.py `sigmoid_gate`, `--focus-gate sigmoid`)."""
    affinity = torch.bmm(log_g_q.exp(), log_g_k.exp().transpose(1, 2))
    return torch.where(local, 1.0, torch.sigmoid(gate_scale * affinity))


# PyTorch's fused CPU attention, which returns the log-sum-exp beside the output (an internal
# op of torch.nn.functional.scaled_dot_product_attention; without it, explicit scores)
FUSED_CPU_ATTENTION = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def partial_attention(q, k, v, allowed, scale: float):
    """softmax(q k^T * scale) v over the `allowed` pairs `[n or 1, m, keys]` only (None: all),
    in fp32, with its log-sum-exp: q `[n, heads, m, d]`, k and v `[n, kv heads, keys, d]` (GQA:
    heads share them in groups), n independent batches of queries. A query with no allowed key
    gets output 0 and log-sum-exp -inf."""
    n, kv_heads, keys, d = k.shape
    heads, m = q.shape[1:3]
    q, k, v = q.float(), k.float(), v.float()
    if q.device.type == "cpu" and FUSED_CPU_ATTENTION is not None:
        if heads != kv_heads:
            k, v = (
                t[:, :, None].expand(-1, -1, heads // kv_heads, -1, -1).reshape(n, heads, keys, d)
                for t in (k, v)
            )
        if allowed is None:
            return FUSED_CPU_ATTENTION(q, k, v, scale=scale)[:2]
        bias = torch.where(allowed, 0.0, float("-inf"))[:, None]
        out, lse = FUSED_CPU_ATTENTION(q, k, v, attn_mask=bias, scale=scale)[:2]
        return out, lse.masked_fill(~allowed.any(-1)[:, None], float("-inf"))
    scores = q.view(n, kv_heads, -1, m, d) @ k.transpose(-1, -2)[:, :, None] * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    lse = scores.logsumexp(-1)
    probs = (scores - lse.nan_to_num(neginf=0.0)[..., None]).exp()
    return (probs @ v[:, :, None]).view(n, heads, m, d), lse.view(n, heads, m)


def lse_merge(out, lse, part_out, part_lse):
    """Two softmax attentions over disjoint keys as one, by log-sum-exp
    (megatron_focus/model/kernels/lse_merge.py): (out `[..., d]`, lse `[...]`). `lse` must be
    finite (the window's holds each query's own key; a bucket's unmasked part every query's
    keys); a part's -inf (no key for that query) adds nothing. The part's share of the merged
    softmax is exp(part_lse - logaddexp(lse, part_lse)) = sigmoid(part_lse - lse)."""
    share = torch.sigmoid(part_lse - lse)
    return torch.lerp(out, part_out, share[..., None]), torch.logaddexp(lse, part_lse)


def merge_into(out, lse, queries, part_out, part_lse):
    """`lse_merge` of a part into the queries' running result `out` `[heads, s, d]`, `lse`
    `[heads, s]`, in place; `queries` indices or a slice of the s."""
    out[:, queries], lse[:, queries] = lse_merge(
        out[:, queries], lse[:, queries], part_out, part_lse
    )


def window_attention(q, k, v, pairs, row, window: int, scale: float):
    """Each query's attention over the keys within its window (its own among them), for batch
    row `row`: q `[heads, s, d]`, k and v `[kv heads, n, d]` the last n keys in position order.

    By blocks of B = min(window / 4, s) queries, all in one call: block i's queries read the
    window + B - 1 keys from the window before its first query to its last query, a strided
    view of the keys (padded in front where the sequence starts); the pairs outside each
    query's window are masked. Work: s * (window + B - 1) pairs."""
    heads, s, d = q.shape
    first = int(pairs.query_pos[0])  # the first query's position
    offset = pairs.keys - k.shape[1]  # the position of k's first key
    step = min(max(window // 4, 1), s)  # a quarter window: fewer masked pairs, calls still few
    blocks, span = -(-s // step), window + step - 1
    front = max(window - 1 - (first - offset), 0)  # keys before the sequence's start
    start = first - offset - (window - 1) + front
    back = blocks * step - s

    def padded(t, before, after):  # along the tokens' axis
        return torch.nn.functional.pad(t, (0, 0, before, after)) if before or after else t

    def by_block(t):  # [kv heads, keys, d] -> [blocks, kv heads, span, d]
        t = padded(t[:, start:], front, back)
        return t[None] if blocks == 1 else t.unfold(1, span, step).permute(1, 0, 3, 2)

    queries = padded(q, 0, back).view(heads, blocks, step, d)
    allowed = None  # a decoding step past the sequence's first window, without padding
    if front or step > 1 or pairs.real is not None:
        # block i's query a at position first + i*B + a, its key j at first + i*B - window + 1 + j
        a, j = torch.arange(step, device=q.device)[:, None], torch.arange(span, device=q.device)
        key_pos = first + step * torch.arange(blocks, device=q.device)[:, None] - window + 1 + j
        in_window = (j >= a) & (j <= a + window - 1)  # [B, span]
        present = (key_pos >= 0) & (key_pos < pairs.keys)  # beyond: the padded queries'
        if pairs.real is not None:
            present = present & pairs.real[row, key_pos.clamp(0, pairs.keys - 1)]
        allowed = (in_window & present[:, None, :]) | (j == a + window - 1)
    out, lse = partial_attention(queries.transpose(0, 1), by_block(k), by_block(v), allowed, scale)
    return (
        out.transpose(0, 1).reshape(heads, -1, d)[:, :s],
        lse.transpose(0, 1).reshape(heads, -1)[:, :s],
    )


def sparse_rule_attention(q, k, v, pairs, groups_q, buckets, window, top_k, block=256):
    """Attention over the pairs the hard top-k rule keeps, computing only those (the native
    sparse dispatch's plan, megatron_focus/model/focus/focus_sparse.py): the window's keys
    (`window_attention`), then the sinks' bucket and, group by group, the buckets of the groups
    among a query's top-k, for those queries alone, by blocks of `block`; the parts merged by
    log-sum-exp.

    q `[b, heads, s, d]`; k, v `[b, kv heads, n, d]`: the last n keys in position order (at
    least the window's of every query; Focus layers take no sliding window); `groups_q` the
    queries' ranked groups `[b, s, K]`; `buckets` (`KeyBuckets`) every key beyond them. A
    bucket holds its keys in position order, so a query's distant keys in it are a prefix, read
    in place. Work: about s * 2 * window pairs, plus top_k * s^2 / K; a decoding step reads
    the window's keys, the sinks' and its groups'.
    """
    b, heads, s, d = q.shape
    query_pos, scale = pairs.query_pos, d**-0.5
    if s == 1 and pairs.real is None:
        return decoding_rule_attention(q, k, v, pairs.keys - 1, groups_q, buckets, window, top_k)
    rows = []
    for row in range(b):
        out, lse = window_attention(q[row], k[row], v[row], pairs, row, window, scale)

        def add_bucket(queries, bucket):
            """`queries` (a slice or indices, by position) against the bucket's keys that are
            distant for the last of them (a bucket holds no padding): those distant for the
            first query too unmasked, the rest under a mask."""
            qp = query_pos[queries]
            held = buckets.read(row, bucket, int(qp[-1]) - window + 1)
            if held is None:
                return
            keys, values, key_pos = held
            q_asking = q[row][None, :, queries]
            # the keys distant for the first query are every query's: no mask
            shared = int(torch.searchsorted(key_pos, int(qp[0]) - window + 1))
            parts = []
            if shared:
                parts.append(
                    partial_attention(
                        q_asking, keys[None, :, :shared], values[None, :, :shared], None, scale
                    )
                )
            if shared < len(key_pos):
                tail = key_pos[None, None, shared:] <= qp[None, :, None] - window
                parts.append(
                    partial_attention(
                        q_asking, keys[None, :, shared:], values[None, :, shared:], tail, scale
                    )
                )
            part_out, part_lse = parts[0] if len(parts) == 1 else lse_merge(*parts[0], *parts[1])
            merge_into(out, lse, queries, part_out[0], part_lse[0])

        add_bucket(slice(0, s), buckets.sinks)
        chosen = groups_q[row, :, :top_k]
        if s == 1:  # a decoding step: its own groups, each once
            for group in chosen[0].tolist():
                add_bucket(slice(0, 1), group)
        else:
            for group in chosen.unique().tolist():
                asking = (chosen == group).any(-1).nonzero()[:, 0]
                for start in range(0, len(asking), block):
                    add_bucket(asking[start : start + block], group)
        rows.append(out)
    return torch.stack(rows).to(q.dtype)


def decoding_rule_attention(q, k, v, position, groups_q, buckets, window, top_k):
    """`sparse_rule_attention` of a decoding step without padding, at `position`: every row's
    window is k's last `window` keys, attended in one call, and every key a bucket gives is
    kept, so no part needs a mask; each part merges into the window's result in place."""
    scale = q.shape[-1] ** -0.5
    out, lse = partial_attention(q, k[:, :, -window:], v[:, :, -window:], None, scale)
    for row, chosen in enumerate(groups_q[:, 0, :top_k].tolist()):
        for bucket in [buckets.sinks, *chosen]:
            held = buckets.read(row, bucket, position - window + 1)
            if held is not None:
                part_out, part_lse = partial_attention(
                    q[row, None], held[0][None], held[1][None], None, scale
                )
                merge_into(out[row], lse[row], slice(None), part_out[0], part_lse[0])
    return out.to(q.dtype)


def slot_rule_pairs(pairs, chosen, key_bucket, window: int, sinks: int) -> torch.Tensor:
    """`[b, 1, s, slots]`: the pairs the hard rule keeps over a static cache's slots, as one
    mask: a key in the query's window, or in the sinks' bucket, or whose top-1 group is among
    the query's `chosen` `[b, s, top_k]`; `key_bucket` `[b, slots]` each slot's bucket
    (`KeyBuckets`' numbering, -1 none). Fixed shapes, no host read: a decoding step's graph."""
    slots = key_bucket.shape[1]
    buckets = torch.arange(sinks + 1, device=chosen.device)
    asked = (chosen[..., None] == buckets).any(-2) | (buckets == sinks)  # [b, s, K + 1]
    index = key_bucket.clamp_min(0)[:, None].expand(-1, chosen.shape[1], -1)
    distant = asked.gather(2, index) & (key_bucket >= 0)[:, None]
    near = local_pairs(pairs.query_pos, slots, window)
    return pairs.dense(slots) & (near | distant)[:, None]


def _focus_kernels(q):
    """megatron-focus's kernel choices (megatron_focus/model/kernels/kernels.py) for q on a
    GPU, where that package is installed; else None."""
    if q.device.type != "cuda":
        return None
    try:
        from megatron_focus.model.kernels import kernels
    except ImportError:
        return None
    return kernels


def fused_sparse_kernel(q):
    """megatron-focus's fused sparse Focus kernel (Triton), where that package is installed and
    q's GPU, head dim and dtype have a tile for it; else None (this file's own path). A prompt's
    prefill is then the native model's few launches, where `sparse_rule_attention` takes
    several per group and block."""
    kernels = _focus_kernels(q)
    kernel = kernels.sparse(q.device, q.shape[-1], q.dtype) if kernels is not None else None
    return kernel if kernel is not None and kernel.fused else None


def slot_decode_kernel(q):
    """megatron-focus's decoding step over a static cache's slots (a Triton kernel, a torch op
    torch.compile keeps in the step's graph), where that package is installed and q's GPU,
    head dim and dtype have a tile for it; else None (`slot_rule_pairs`' mask). It reads the
    kept slots' keys alone, where the mask's attention reads every slot."""
    kernels = _focus_kernels(q)
    return kernels.slot_decode(q.device, q.shape[-1], q.dtype) if kernels is not None else None


def fused_rule_attention(q, k, v, groups_q, config, kernel):
    """The hard rule over a whole prompt (no cache before it, no padding) by the native model's
    sparse dispatch on `kernel` (megatron_focus/model/focus/focus_sparse.py)."""
    from megatron_focus.model.focus.focus_sparse import sparse_focus_attention
    from megatron_focus.model.focus.groups import Routing

    return sparse_focus_attention(
        q, k, v, Routing(None, groups_q), window=config.focus_window,
        top_k=config.focus_top_k, scale=q.shape[-1] ** -0.5,
        sink=config.focus_sink_tokens, kernel=kernel,
    )  # fmt: skip


class KeyBuckets:
    """A Focus layer's keys and values by bucket: one per group (the keys whose top-1 group it
    is) and one more for the sinks; padding is in none.

    Within a bucket keys stay in position order, so what a query keeps of a bucket (the keys a
    window or more before it) is a prefix: a decoding step reads its groups' keys where they
    lie, no compare over every cached key, no gather. A bucket's keys are `[b, kv heads,
    capacity, d]`, grown by an eighth when full (at first exactly to size), with the
    positions `[b, capacity]`; `counts[row][bucket]` says how many of each row's are held.
    """

    def __init__(self, groups: int):
        self.sinks = groups  # the sinks' bucket, after the groups'
        self.stores = [None] * (groups + 1)  # per bucket: (keys, values, positions)
        self.counts = []

    def append(self, keys, values, positions, bucket):
        """Keys and values `[b, kv heads, s, d]` of the tokens at `positions` `[s]`, each to
        its bucket (`bucket` `[b, s]`, -1: none)."""
        if not self.counts:
            self.counts = [[0] * len(self.stores) for _ in range(keys.shape[0])]
        for row, ids in enumerate(bucket):
            if ids.numel() == 1:  # a decoding step: one key, no sort
                if int(ids) >= 0:
                    self._write(row, int(ids), keys[row], values[row], positions)
                continue
            order = torch.argsort(ids, stable=True)  # by bucket, in position order within
            sizes = torch.bincount(ids + 1, minlength=len(self.stores) + 1).tolist()
            k, v, p = keys[row][:, order], values[row][:, order], positions[order]
            start = sizes[0]  # the padding's, first
            for bucket_id, size in enumerate(sizes[1:]):
                if size:
                    run = slice(start, start + size)
                    self._write(row, bucket_id, k[:, run], v[:, run], p[run])
                start += size

    def _write(self, row, bucket, keys, values, positions):
        n, m = self.counts[row][bucket], positions.numel()
        store = self.stores[bucket]
        capacity = 0 if store is None else store[2].shape[1]
        if n + m > capacity:
            grown = n + m if store is None else max(n + m, capacity + capacity // 8 + 16)
            rows = len(self.counts)
            new = (
                keys.new_empty(rows, keys.shape[0], grown, keys.shape[-1]),
                values.new_empty(rows, values.shape[0], grown, values.shape[-1]),
                positions.new_empty(rows, grown),
            )
            if store is not None:
                for old, fresh, dim in zip(store, new, (2, 2, 1)):
                    fresh.narrow(dim, 0, capacity).copy_(old)
            self.stores[bucket] = store = new
        store[0][row, :, n : n + m] = keys
        store[1][row, :, n : n + m] = values
        store[2][row, n : n + m] = positions
        self.counts[row][bucket] = n + m

    def read(self, row, bucket, before: int):
        """(keys `[kv heads, m, d]`, values, positions `[m]`) of the bucket's keys at positions
        before `before`, in place; None if there are none."""
        n = self.counts[row][bucket] if self.counts else 0
        if n == 0:
            return None
        keys, values, positions = self.stores[bucket]
        m = int(torch.searchsorted(positions[row, :n], before))
        return (keys[row, :, :m], values[row, :, :m], positions[row, :m]) if m else None

    def select(self, rows: torch.Tensor):
        """The batch rows `rows` (beam reordering, batch expansion and selection), copied."""
        self.stores = [
            None if store is None else tuple(t.index_select(0, rows.to(t.device)) for t in store)
            for store in self.stores
        ]
        self.counts = [list(self.counts[row]) for row in rows.tolist()]

    def crop(self, length: int):
        """Forgets the keys at positions from `length` on."""
        for row, counts in enumerate(self.counts):
            for bucket, n in enumerate(counts):
                if n:
                    positions = self.stores[bucket][2][row, :n]
                    counts[bucket] = int(torch.searchsorted(positions, length))

    def gather(self, first: int, end: int, like_keys, like_values):
        """The keys and values at positions first..end-1 in position order `[b, kv heads,
        end - first, d]` (padding, in no bucket: zeros), as the window's cache needs them after
        a crop."""
        keys, values = (
            like.new_zeros(like.shape[0], like.shape[1], end - first, like.shape[3])
            for like in (like_keys, like_values)
        )
        for row, counts in enumerate(self.counts):
            for bucket, n in enumerate(counts):
                if n:
                    k, v, positions = (t[row] for t in self.stores[bucket])
                    bounds = torch.tensor([first, end], device=positions.device)
                    lo, hi = torch.searchsorted(positions[:n], bounds).tolist()
                    at = positions[lo:hi] - first
                    keys[row][:, at], values[row][:, at] = k[:, lo:hi], v[:, lo:hi]
        return keys, values


class Router(nn.Module):
    """A layer's W_g and K centroids (megatron_focus/model/focus/focus.py `Router`): token ->
    scores."""

    def __init__(self, config: MegatronFocusConfig):
        super().__init__()
        self.tau = config.focus_tau
        self.proj = nn.Linear(config.hidden_size, config.focus_dim, bias=False)
        self.centroids = nn.Parameter(torch.empty(config.focus_groups, config.focus_dim))

    def forward(self, x):
        """Scores `[b, s, K]` (fp32) = (W_g x) C^T / tau."""
        return (self.proj(x).float() @ self.centroids.float().t()) / self.tau


def appended(store, held: torch.Tensor, new: torch.Tensor, dim: int):
    """`held` and `new` along `dim`, written into `store` behind `held` when `held` is a slice
    of it along `dim` with room behind (else into a new store an eighth longer than both):
    appending costs the new tokens alone, where torch.cat copies every held one at every
    decoding step. Returns (store, the whole: a slice of the store)."""
    dim %= held.dim()  # the shapes are compared on every other axis
    n, m = held.shape[dim], new.shape[dim]
    start = slice_start(store, held, dim)
    if start is None or start + n + m > store.shape[dim]:
        shape = list(new.shape)
        shape[dim] = n + m + (n + m) // 8 + 16
        store, start = new.new_empty(shape), 0
        store.narrow(dim, 0, n).copy_(held)
    store.narrow(dim, start + n, m).copy_(new)
    return store, store.narrow(dim, start, n + m)


def slice_start(store, held: torch.Tensor, dim: int):
    """Where `held` starts in `store` if it is `store.narrow(dim, start, n)`, else None."""
    if (
        store is None
        or held.untyped_storage().data_ptr() != store.untyped_storage().data_ptr()
        or held.stride() != store.stride()
        or any(a != b for i, (a, b) in enumerate(zip(held.shape, store.shape)) if i != dim)
    ):
        return None
    start, rest = divmod(held.storage_offset() - store.storage_offset(), store.stride(dim))
    return start if rest == 0 and start >= 0 else None


class AppendingLayer(DynamicLayer):
    """A layer's cache entry whose keys and values grow in place (`appended`), where
    transformers' DynamicLayer copies the whole cache at every decoding step (torch.cat)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._stores = {}  # each cached tensor's store, with room to grow

    def _append(self, name: str, new: torch.Tensor, dim: int) -> torch.Tensor:
        held = getattr(self, name)
        if held is None:
            setattr(self, name, new)
            return new
        self._stores[name], whole = appended(self._stores.get(name), held, new, dim)
        setattr(self, name, whole)
        return whole

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            return super().update(key_states, value_states, *args, **kwargs)
        return self._append("keys", key_states, -2), self._append("values", value_states, -2)

    def reset(self):
        self._stores = {}
        super().reset()


def cache_layer(cache: Cache, layer_idx: int, make) -> DynamicLayer:
    """`cache`'s entry of layer `layer_idx`, made `make()` while it is still an empty stock
    DynamicLayer: generate() and the model build DynamicCaches of those (from the config, or
    grown lazily). Any other entry is returned as it is (a sliding window's, or one filled
    before)."""
    layers = cache.layers
    while len(layers) <= layer_idx and cache.layer_class_to_replicate is not None:
        layers.append(cache.layer_class_to_replicate())
    if layer_idx >= len(layers):
        return None
    if type(layers[layer_idx]) is DynamicLayer and layers[layer_idx].get_seq_length() == 0:
        layers[layer_idx] = make()
    return layers[layer_idx]


class FocusCacheLayer(AppendingLayer):
    """A Focus layer's cache entry in soft mode: keys and values, and the routing state of every
    cached token.

    `log_g` `[b, n, K]`: each cached token's log-assignment (the soft gate's g_j); `groups`
    `[b, n, K]`: its ranked groups. `sums` `[b, n, iters, K]`: per causal-Sinkhorn iteration,
    the log-sum of exp(L) over the tokens up to this one; the last row is all the next token
    needs. All are per token, as keys and values are, so cropping, beam reordering and batch
    expansion (below) treat them as DynamicLayer treats keys and values.
    """

    keeps_focus_routing = True  # duck-typed: this file may be imported twice (package, remote code)
    mode = "soft"
    routing = ("log_g", "groups", "sums")  # the per-token state it keeps

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._clear_routing()

    def _clear_routing(self):
        for name in self.routing:
            setattr(self, name, None)

    def routing_prefix(self):
        """`[b, iters, K]`: the causal Sinkhorn's running log-sums after the cached tokens."""
        return None if self.sums is None or self.sums.shape[1] == 0 else self.sums[:, -1]

    def update_routing(self, **state):
        """Appends the new tokens' state (each of `routing`, `[b, s, ...]`); returns every
        cached token's."""
        return {name: self._append(name, new, 1) for name, new in state.items()}

    def _map_routing(self, fn):
        for name in self.routing:
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))

    def reset(self):
        self._clear_routing()
        super().reset()

    def crop(self, length: int):
        # transformers 5: tokens to remove (< 0); 4: the length to keep, or < 0 as 5
        super().crop(length)
        self._map_routing(lambda t: t[:, : self.get_seq_length()])

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self._map_routing(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._map_routing(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self._map_routing(lambda t: t[indices])


class FocusSparseCacheLayer(FocusCacheLayer):
    """A Focus layer's cache entry in sparse mode: keys and values by bucket (`KeyBuckets`: each
    key under its top-1 group, or the sinks'), and, in position order, only the last `window`
    of them (`keys`, `values`), which the window's part of the rule reads; of the routing state,
    only the Sinkhorn's running sums.

    A decoding step so reads the window, the sinks and its top-k groups' keys, each a slice in
    place. Its bytes are a standard cache's (every key once) plus the window and the sums.
    """

    mode = "sparse"
    routing = ("sums",)

    def __init__(self, groups: int, window: int, **kwargs):
        super().__init__(**kwargs)
        self.buckets, self.window, self.length = KeyBuckets(groups), window, 0

    def update(self, key_states, value_states, *args, **kwargs):
        """The window's held keys and values with the new ones, in position order (what the
        window's part reads); keeps the last `window`. The buckets are filled by the layer."""
        if not self.is_initialized:
            self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
            self.device, self.is_initialized = key_states.device, True
        keys, values = (
            self._append("keys", key_states, -2),
            self._append("values", value_states, -2),
        )
        self.length += key_states.shape[-2]
        # the next step's held keys: a slice of the store, which grows behind it
        held = keys[..., -self.window :, :], values[..., -self.window :, :]
        if key_states.shape[-2] > 1:  # a chunk's store is the chunk's size: keep the window alone
            held = tuple(t.clone() for t in held)
            self._stores.pop("keys"), self._stores.pop("values")
        self.keys, self.values = held
        return keys, values

    def get_seq_length(self, *args) -> int:
        return self.length

    def reset(self):
        groups = self.buckets.sinks
        super().reset()  # transformers 4 zeroes the window's keys in place: drop them instead
        self.keys = self.values = None
        self.is_initialized, self.buckets, self.length = False, KeyBuckets(groups), 0

    def crop(self, length: int):
        # transformers 5: tokens to remove (< 0), 0 none; 4: the length to keep, or < 0 as 5
        if length < 0:
            keep = max(self.length + length, 0)
        else:
            keep = self.length if length == 0 and CROP_REMOVES else length
        if not self.is_initialized or keep >= self.length:
            return
        self.buckets.crop(keep)
        self.keys, self.values = self.buckets.gather(
            max(keep - self.window, 0), keep, self.keys, self.values
        )
        self.length = keep
        self._map_routing(lambda t: t[:, :keep])

    def _select(self, rows: torch.Tensor):
        """Keeps the batch rows `rows` (beams reordered, a batch expanded or selected)."""
        if not self.is_initialized:
            return
        self.keys, self.values = (
            t.index_select(0, rows.to(t.device)) for t in (self.keys, self.values)
        )
        self.buckets.select(rows)
        self._map_routing(lambda t: t[rows.to(t.device)])

    def reorder_cache(self, beam_idx):
        self._select(beam_idx.cpu())

    def batch_repeat_interleave(self, repeats: int):
        self._select(self._rows().repeat_interleave(repeats))

    def batch_select_indices(self, indices):
        self._select(self._rows()[indices.cpu() if torch.is_tensor(indices) else indices])

    def _rows(self) -> torch.Tensor:
        return torch.arange(self.keys.shape[0] if self.is_initialized else 0)


def focus_cache_layer(cache: Cache, layer_idx: int, config) -> FocusCacheLayer:
    """`cache`'s entry of a Focus layer: the mode's Focus cache layer, which also keeps routing
    (in sparse mode, its keys by group). A cache filled in one mode cannot go on in the other."""
    mode = config.focus_attention_mode

    def make(static=None):
        if static is not None:
            return FocusStaticLayer(static.max_cache_len, mode)
        if mode == "sparse":
            return FocusSparseCacheLayer(config.focus_groups, config.focus_window)
        return FocusCacheLayer()

    layer = cache_layer(cache, layer_idx, make)
    if type(layer) is StaticLayer and not layer.is_initialized:  # a StaticCache's stock entry
        layer = cache.layers[layer_idx] = make(layer)
    if not getattr(layer, "keeps_focus_routing", False):  # duck-typed: see FocusCacheLayer
        raise ValueError(
            f"Focus layer {layer_idx} needs a DynamicCache or StaticCache entry to keep "
            f"its routing state, not {type(layer).__name__}"
        )
    if layer.mode == mode:
        return layer
    if layer.get_seq_length() > 0:
        raise ValueError(
            f"this cache holds Focus layer {layer_idx}'s keys for {layer.mode} mode; "
            f"{mode} mode needs a new cache (generate() makes one)"
        )
    cache.layers[layer_idx] = make(layer if isinstance(layer, FocusStaticLayer) else None)
    return cache.layers[layer_idx]


# a fresh static Focus entry's routing state, per name: no Sinkhorn mass, no bucket
_STATIC_FILL = {"sums": float("-inf"), "log_g": 0.0, "bucket": -1}


class FocusStaticLayer(StaticLayer):
    """A Focus layer's entry in a StaticCache (`focus_cache_layer` puts it in the stock
    entry's place): keys and values in `max_cache_len` slots, as transformers' StaticLayer,
    and per slot the routing state its mode reads: the causal Sinkhorn's running sums and,
    soft, the log-assignments; sparse, the key's bucket (`KeyBuckets`' numbering: its top-1
    group, the sinks', -1 none).

    Every tensor keeps its shape and address and is written in place at the new tokens'
    slots, so a decoding step is one compiled graph, replayed (CUDA graphs) at every step. A
    sparse step reads the slots the rule keeps alone through megatron-focus's kernel where it
    runs (`slot_decode_kernel`); elsewhere it pays the static cache's price, every slot read
    (one mask over them, `slot_rule_pairs`).
    """

    keeps_focus_routing = True  # duck-typed, as FocusCacheLayer

    def __init__(self, max_cache_len: int, mode: str, **kwargs):
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self.mode, self.state = mode, {}
        self.step_kernel = None  # sparse: `slot_decode_kernel`'s, chosen by an eager call

    def slots(self, s: int, device) -> torch.Tensor:
        """The slots (positions) of the next `s` tokens."""
        return torch.arange(s, device=device) + self.cumulative_length.to(device)

    def routing_prefix(self, first: torch.Tensor):
        """`[b, iters, K]`: the running log-sums before slot `first` (-inf at slot 0); None
        before any token was routed."""
        sums = self.state.get("sums")
        if sums is None:
            return None
        before = sums.index_select(1, (first - 1).clamp_min(0).reshape(1))[:, 0]
        return torch.where(first > 0, before, float("-inf"))

    def update_routing(self, slots: torch.Tensor, **state) -> dict:
        """Writes the new tokens' state (each `[b, s, ...]`) at `slots`; returns every slot's."""
        for name, new in state.items():
            if name not in self.state:
                held = new.new_full((new.shape[0], self.max_cache_len, *new.shape[2:]),
                                    _STATIC_FILL[name])  # fmt: skip
                if not torch.compiler.is_compiling():  # a fixed address: no recompile, graphs
                    torch._dynamo.mark_static_address(held)
                self.state[name] = held
            self.state[name].index_copy_(1, slots, new)
        return self.state

    def reset(self):
        super().reset()
        for name, held in self.state.items():
            held.fill_(_STATIC_FILL[name])

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        for name, held in self.state.items():
            self.state[name] = held.index_select(0, beam_idx.to(held.device))


# transformers whose StaticLayer counts its own tokens (5): a static cache needs no positions
STATIC_COUNTS_TOKENS = hasattr(StaticLayer(max_cache_len=1), "cumulative_length")


def static_slots(cache: StaticCache, config: MegatronFocusConfig, end=None) -> int:
    """How many slots a static cache holds; refused where its slots are not positions, or
    (checked outside a compiled graph, which reads nothing back) fewer than `end`, the tokens
    it would hold after this call."""
    if not STATIC_COUNTS_TOKENS:
        raise ValueError(
            f"a static cache needs transformers 5 (this is {transformers.__version__}); use "
            f"the default cache_implementation"
        )
    if config.sliding_window is not None:
        raise ValueError("a static cache with sliding_window is not supported; use the default "
                         "cache_implementation")  # fmt: skip
    slots = cache.get_max_length()
    if end is not None and not torch.compiler.is_compiling() and int(end) > slots:
        raise ValueError(f"this static cache holds {slots} tokens; this call would make it "
                         f"{int(end)} (a larger max_cache_len)")  # fmt: skip
    return slots


class FocusAttention(Attention):
    """Causal attention under the Focus pair rule (megatron_focus/model/focus/focus.py): the
    router's assignments gate distant pairs softly (`focus_attention_mode` "soft") or keep only
    those of the hard top-k rule ("sparse"); pairs in the local window are always kept."""

    def __init__(self, config: MegatronFocusConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.router = Router(config)

    def route(self, x, cache, attention_mask):
        """Soft mode: ((log-assignments, ranked groups) of these tokens `[b, s, K]`, the same of
        every key `[b, keys, K]`, which keys are sinks `[b, keys]`). Sparse mode: (the queries'
        ranked groups, each new key's bucket `[b, s]` (`KeyBuckets`), the buckets the keys are
        added to). The groups are ranked once, here, for every use. The sinks are the first
        `focus_sink_tokens` tokens of each sequence, padding not counted."""
        b, s, _ = x.shape
        config = self.config
        layer = focus_cache_layer(cache, self.layer_idx, config) if cache is not None else None
        if isinstance(layer, FocusStaticLayer):
            return self.route_into_slots(x, layer, attention_mask)
        past = layer.get_seq_length() if layer is not None else 0
        keep = None
        if attention_mask is not None:  # padding (the model drops a mask of ones)
            if attention_mask.shape[-1] != past + s:
                raise ValueError(
                    f"attention_mask covers {attention_mask.shape[-1]} tokens, the "
                    f"cache and the input {past + s}"
                )
            keep = attention_mask[:, past:].bool()  # these tokens' (False: padding)
        log_g, sums = causal_sinkhorn(
            self.router(x),
            config.focus_sinkhorn_iters,
            keep,
            layer.routing_prefix() if layer is not None else None,
        )
        groups = rank_groups(log_g)
        if config.focus_attention_mode == "sparse":  # the new keys' buckets
            if layer is not None:
                layer.update_routing(sums=sums)
            buckets = layer.buckets if layer is not None else KeyBuckets(config.focus_groups)
            bucket = groups[..., 0]
            if keep is not None:
                sink = first_real(attention_mask.bool(), config.focus_sink_tokens)[:, past:]
                bucket = bucket.masked_fill(sink, buckets.sinks).masked_fill(~keep, -1)
            elif past < config.focus_sink_tokens:
                sink = torch.arange(past, past + s, device=x.device) < config.focus_sink_tokens
                bucket = bucket.masked_fill(sink, buckets.sinks)
            return groups, bucket, buckets
        real = (
            attention_mask[:, -(past + s) :].bool()
            if attention_mask is not None
            else torch.ones(b, past + s, dtype=torch.bool, device=x.device)
        )
        sinks = first_real(real, config.focus_sink_tokens)
        cached = (
            layer.update_routing(log_g=log_g, groups=groups, sums=sums)
            if layer is not None
            else dict(log_g=log_g, groups=groups)
        )
        return (log_g, groups), (cached["log_g"], cached["groups"]), sinks

    def route_into_slots(self, x, layer: FocusStaticLayer, attention_mask):
        """`route` with a static cache: the same state, written at the tokens' slots; in sparse
        mode every slot's bucket and, in the buckets' place, the layer.
        `attention_mask` covers every slot (the model pads it)."""
        b, s, _ = x.shape
        config = self.config
        slots = layer.slots(s, x.device)
        keep = None if attention_mask is None else attention_mask.bool()[:, slots]  # these'
        log_g, sums = causal_sinkhorn(
            self.router(x), config.focus_sinkhorn_iters, keep, layer.routing_prefix(slots[0])
        )
        groups = rank_groups(log_g)
        real = (  # [b, slots]
            attention_mask.bool()
            if attention_mask is not None
            else torch.ones(b, layer.max_cache_len, dtype=torch.bool, device=x.device)
        )
        sinks = first_real(real, config.focus_sink_tokens)
        if config.focus_attention_mode == "sparse":
            bucket = groups[..., 0].masked_fill(sinks[:, slots], config.focus_groups)
            if keep is not None:
                bucket = bucket.masked_fill(~keep, -1)
            state = layer.update_routing(slots, sums=sums, bucket=bucket)
            return groups, state["bucket"], layer
        state = layer.update_routing(slots, sums=sums, log_g=log_g)
        return (log_g, groups), (state["log_g"], None), sinks

    def attend_slots(self, q, k, v, pairs, groups_q, bucket, layer: FocusStaticLayer):
        """The hard rule over a static cache's slots. Eagerly (a prompt, a chunk, a step outside
        a graph) the kernel for later steps is chosen, and a prompt or chunk takes
        `attend_filled_slots`; a step takes that kernel, or one mask over the slots."""
        config = self.config
        chosen = groups_q[..., : config.focus_top_k]
        if not torch.compiler.is_compiling():
            layer.step_kernel = slot_decode_kernel(q)
            if q.shape[2] > 1:
                return self.attend_filled_slots(q, k, v, pairs, groups_q, bucket)
        if q.shape[2] == 1 and layer.step_kernel is not None:
            return layer.step_kernel(q, k, v, bucket, chosen[:, 0], pairs.query_pos,
                                     config.focus_window, config.focus_groups,
                                     q.shape[-1] ** -0.5)  # fmt: skip
        keep = slot_rule_pairs(pairs, chosen, bucket, config.focus_window, config.focus_groups)
        return self.softmax_attention(q, k, v, additive(keep, q.dtype))

    def attend_filled_slots(self, q, k, v, pairs, groups_q, bucket):
        """A prompt or chunk into a static cache, run eagerly: the sparse rule's own parts (the
        fused kernel on a GPU) over the slots filled so far, their keys bucketed as a dynamic
        cache holds them, where a slot mask would cost every query every slot."""
        s = q.shape[2]
        end = int(pairs.query_pos[-1]) + 1
        past = end - s
        real = None if pairs.real is None else pairs.real[:, :end]
        real = None if real is None or real.all() else real
        buckets = KeyBuckets(self.config.focus_groups)
        if past:
            positions = torch.arange(past, device=k.device)
            buckets.append(k[:, :, :past], v[:, :, :past], positions, bucket[:, :past])
        filled = CausalPairs(s, past, real, q.device)
        routing = (groups_q, bucket[:, past:end], buckets)
        return self.attend(q, k[:, :, :end], v[:, :, :end], filled, routing)

    def attend(self, q, k, v, pairs, routing=None):
        config = self.config
        check_focus_inference(config)
        if config.focus_attention_mode == "sparse":
            groups_q, bucket, buckets = routing
            if isinstance(buckets, FocusStaticLayer):  # a static cache: every slot's bucket
                return self.attend_slots(q, k, v, pairs, groups_q, bucket, buckets)
            s = q.shape[2]
            buckets.append(k[:, :, -s:], v[:, :, -s:], pairs.query_pos, bucket)
            whole_prompt = s > 1 and pairs.keys == s and pairs.real is None
            kernel = fused_sparse_kernel(q) if whole_prompt else None
            if kernel is not None:
                return fused_rule_attention(q, k, v, groups_q, config, kernel)
            return sparse_rule_attention(
                q, k, v, pairs, groups_q, buckets, config.focus_window, config.focus_top_k
            )
        (log_g_q, groups_q), (log_g_k, groups_k), sinks = routing
        # local pairs: the window, and every query's sinks (as the native rule's)
        local = local_pairs(pairs.query_pos, k.shape[2], config.focus_window) | sinks[:, None, :]
        mask = pairs.dense(k.shape[2])
        if config.focus_gate == "sigmoid":  # a factor on the logits: explicit scores, any backend
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            factor = sigmoid_gate(log_g_q, log_g_k, local, config.focus_gate_scale)[:, None]
            logits = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5 * factor
            return logits.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype) @ v
        bias = soft_gate(log_g_q, log_g_k, local, config.focus_gate_scale)[:, None]
        return self.softmax_attention(q, k, v, additive(mask, q.dtype, bias))


class FocusXSAAttention(FocusAttention):
    """Focus attention, XSA on its output."""

    project = XSAAttention.project


# Each layer kind of `config.layer_attention`; an exported folder's
# modeling_megatron_focus_variants.py adds those its attention variants ship (docs/extending.md).
ATTENTION = {
    "standard": Attention,
    "xsa": XSAAttention,
    "focus": FocusAttention,
    "focus+xsa": FocusXSAAttention,
}


class MLP(nn.Module):
    def __init__(self, config: MegatronFocusConfig):
        super().__init__()
        h, f, bias = config.hidden_size, config.intermediate_size, config.bias
        self.activation = config.activation
        if self.activation == "swiglu":
            self.gate_proj = nn.Linear(h, f, bias=bias)
        self.up_proj = nn.Linear(h, f, bias=bias)
        self.down_proj = nn.Linear(f, h, bias=bias)

    def forward(self, x):
        if self.activation == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.activation == "relu2":
            return self.down_proj(F.relu(self.up_proj(x)).square())
        approximate = "tanh" if self.activation == "gelu_tanh" else "none"
        return self.down_proj(F.gelu(self.up_proj(x), approximate=approximate))


class DecoderLayer(nn.Module):
    def __init__(self, config: MegatronFocusConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = norm(config)
        self.self_attn = ATTENTION[config.layer_attention[layer_idx]](config, layer_idx)
        self.post_attention_layernorm = norm(config)
        self.mlp = MLP(config)

    def forward(self, x, rope, pairs, cache, attention_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, pairs, cache, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MegatronFocusPreTrainedModel(PreTrainedModel):
    config_class = MegatronFocusConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]
    # attn_implementation: eager, sdpa (the default), flex_attention, registered kernels; not
    # flash_attention_2, which takes no arbitrary mask (Focus's pairs and gate need one)
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, Router):  # W_g is a Linear; the centroids as the native init
            init.normal_(module.centroids, std=1.0 / math.sqrt(self.config.focus_dim))

    def set_focus_mode(self, mode: str, top_k: int = None) -> None:
        """Focus layers' rule from the next forward on: "soft" (log-gate) or "sparse" (top-k)."""
        previous = (self.config.focus_attention_mode, self.config.focus_top_k)
        self.config.focus_attention_mode = mode
        if top_k is not None:
            self.config.focus_top_k = top_k
        try:
            check_focus_inference(self.config)
        except ValueError:
            self.config.focus_attention_mode, self.config.focus_top_k = previous
            raise


class MegatronFocusModel(MegatronFocusPreTrainedModel):
    def __init__(self, config: MegatronFocusConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding_type == "learned_absolute":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = norm(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        cache = one_cache(cache, kwargs)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0  # a tensor in a static one
        b, s = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
        static = isinstance(cache, StaticCache)  # keys in fixed slots: a mask over all of them
        slots = static_slots(cache, self.config, past + s) if static else None
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = (torch.arange(s, device=x.device) + past).expand(b, s)
        if self.config.position_embedding_type == "learned_absolute":
            x = x + self.embed_positions(position_ids)
        rope = None
        if self.config.position_embedding_type == "rope":
            rope = rotary(position_ids, self.config, x.dtype)
        if static:
            attention_mask = every_slot(attention_mask, slots)
        elif attention_mask is not None and attention_mask.all():
            attention_mask = None  # no padding (generate() passes ones): no layer reads it
        pairs = CausalPairs(s, past, attention_mask, x.device, self.config.sliding_window, slots)
        for layer in self.layers:
            x = layer(x, rope, pairs, cache if use_cache else None, attention_mask)
        return BaseModelOutputWithPast(
            last_hidden_state=self.norm(x), **{CACHE_FIELD: cache if use_cache else None}
        )


def every_slot(attention_mask, slots: int):
    """A 2D padding mask `[b, tokens]` over a static cache's `slots`: the slots past the tokens
    kept as ones (causality leaves them out), so that every decoding step's mask has one
    shape."""
    if attention_mask is None or attention_mask.shape[-1] == slots:
        return attention_mask
    if attention_mask.dim() != 2 or attention_mask.shape[-1] > slots:
        raise ValueError(
            f"attention_mask of shape {tuple(attention_mask.shape)}: this model takes a 2D "
            f"padding mask of at most the static cache's {slots} slots"
        )
    return F.pad(attention_mask, (0, slots - attention_mask.shape[-1]), value=1)


def one_cache(cache, kwargs: dict):
    """The cache passed as `cache` or, as most callers and older transformers name it,
    `past_key_values` (a cache under that name must never be ignored)."""
    legacy = kwargs.pop("past_key_values", None)
    if legacy is not None and cache is not None:
        raise ValueError("pass the cache as cache or as past_key_values, not both")
    return cache if legacy is None else legacy


class CausalPairs:
    """Which keys each query may see: the keys up to it (the last `window` of them with a
    sliding window), padded keys left out (a 2D `attention_mask`, 1 keep), and always its own
    key, so that a padded query's (ignored) output stays finite. Query i sits at position
    past + i, key j at position j.

    Asked for any queries and keys (`between`), so that the sparse Focus rule never builds the
    whole `[s, past + s]` mask; `dense` builds it, once, for the layers that take one.
    """

    def __init__(self, s: int, past, attention_mask, device, window=None, slots=None):
        self.keys = past + s if slots is None else slots  # a static cache's: every slot
        self.query_pos = torch.arange(s, device=device) + past
        self.window = window
        self.real = None if attention_mask is None else attention_mask[:, -self.keys :].bool()
        self._dense = self._additive = None

    def between(self, query_pos: torch.Tensor, key_pos: torch.Tensor, row=None) -> torch.Tensor:
        """`[queries, keys]` for batch row `row`, or `[b or 1, queries, keys]` for every row."""
        q, k = query_pos[:, None], key_pos[None, :]
        keep = k <= q
        if self.window is not None:
            keep = keep & (k > q - self.window)
        if self.real is None:
            return keep if row is not None else keep[None]
        real = self.real[:, key_pos] if row is None else self.real[row, key_pos]
        return (keep & real[..., None, :]) | (k == q)

    def dense(self, keys: int) -> torch.Tensor:
        """`[b or 1, 1, s, keys]` for the last `keys` keys (a sliding-window cache's)."""
        if self._dense is None:
            every = torch.arange(self.keys, device=self.query_pos.device)
            self._dense = self.between(self.query_pos, every)[:, None]
        return self._dense[..., -keys:]

    def additive(self, keys: int, dtype) -> torch.Tensor:
        """`additive(dense(keys), dtype)`, built once per forward for every standard layer."""
        if self._additive is None or self._additive[0] != (keys, dtype):
            self._additive = (keys, dtype), additive(self.dense(keys), dtype)
        return self._additive[1]


class MegatronFocusForCausalLM(MegatronFocusPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MegatronFocusConfig):
        super().__init__(config)
        self.model = MegatronFocusModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def generate(self, *args, focus_attention_mode: str = None, focus_top_k: int = None, **kwargs):
        """`GenerationMixin.generate` in the Focus mode and top-k given here, else in the
        generation config (`focus_attention_mode`, `focus_top_k`: a folder's
        generation_config.json, or lm-evaluation-harness's `--gen_kwargs`), else the model
        config's; the model's own setting is back afterwards."""
        generation_config = kwargs.get("generation_config") or self.generation_config
        mode = focus_attention_mode or getattr(generation_config, "focus_attention_mode", None)
        top_k = focus_top_k or getattr(generation_config, "focus_top_k", None)
        if mode is None and top_k is None:
            return super().generate(*args, **kwargs)
        previous = (self.config.focus_attention_mode, self.config.focus_top_k)
        self.set_focus_mode(mode or previous[0], top_k)
        try:
            return super().generate(*args, **kwargs)
        finally:
            self.config.focus_attention_mode, self.config.focus_top_k = previous

    def create_masks_for_generate(self, config, attention_mask=None, **kwargs):
        """The mask generate() hands a step with a static cache (transformers' would be 4D):
        the 2D padding mask over the cache's slots, which the model reads itself, of one
        shape at every step."""
        cache = one_cache(kwargs.get("cache"), dict(kwargs))
        return every_slot(attention_mask, static_slots(cache, config))

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache: Cache = None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=one_cache(cache, kwargs),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden, cache = out.last_hidden_state, getattr(out, CACHE_FIELD)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})


__all__ = ["MegatronFocusForCausalLM", "MegatronFocusModel", "MegatronFocusPreTrainedModel"]
