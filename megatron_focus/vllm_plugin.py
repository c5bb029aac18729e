"""vLLM serves an export of this package (`MegatronFocusForCausalLM`) as a native model, Focus
included: a `vllm.general_plugins` entry point (`register`), which vLLM calls in each of its
processes once this package is installed beside it.

The model is the export's own Hugging Face code (the `modeling_megatron_focus.py` in its folder,
loaded as transformers loads it with `trust_remote_code`): its embeddings, norms, MLPs and
attention projections run unchanged, over vLLM's flat batch of tokens. What changes is where the
keys and values live, in vLLM's paged KV cache:

- a standard or XSA layer attends with vLLM's own `Attention` (its paged kernel, sliding window
  included); XSA's projection follows, on the step's own values, as in the export;
- a Focus layer keeps, per token, its key, value and routing state (its log-assignment, or in
  sparse mode its bucket, and the causal Sinkhorn's running log-sums after it) in float32 pages
  of its own (`FocusPages`), which vLLM allocates, maps and frees per sequence as it does a
  standard layer's. For each sequence of the batch, the layer reads its pages back into the
  export's own Focus cache (`FocusCacheLayer`; in sparse mode `FocusSparseCacheLayer`, keys by
  group) and calls the export's attention layer on the step's tokens: prefill, chunked prefill
  and decoding compute the export's rule in either mode; the step's keys, values and routing
  state go to its pages. The router's per-sequence state is the last token's running sums, read
  from its page: nothing outlives the pages, so sequences of any lengths batch together, and a
  preempted sequence, recomputed from its prompt, needs nothing more.

Prefix caching shares the Focus pages as it shares any layer's: a token's row depends only on
the tokens up to it (the routing is causal), so a block vLLM finds by its tokens' hash holds the
rows the new sequence would write. The Focus mode and top-k are the export config's;
`hf_overrides={"focus_attention_mode": "sparse"}` (`--hf-overrides` for `vllm serve`) serves the
sparse rule: an engine serves one mode, and its cached pages are that mode's.

The cost: a Focus layer reads a sequence's whole pages at every step (a gather, as dense
attention reads every key) and runs the export's PyTorch attention per sequence, not a paged
kernel (docs/serving.md, docs/benchmarks.md).

This module imports vLLM, torch and transformers only, never the rest of the package: a vLLM
environment installs this package without its training dependencies (`pip install --no-deps`).
"""

import dataclasses
import sys
from typing import Iterable

import torch
from torch import nn
from vllm import ModelRegistry
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder
from vllm.v1.kv_cache_interface import FullAttentionSpec

ARCHITECTURE = "MegatronFocusForCausalLM"


def register() -> None:
    """The entry point (setup.py's `vllm.general_plugins`): vLLM calls it in each process."""
    ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:MegatronFocusForVLLM")


def _export_class(model_config) -> tuple:
    """The export's own HF class and modeling module, as transformers loads them from its folder."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    auto = model_config.hf_config.auto_map["AutoModelForCausalLM"]
    cls = get_class_from_dynamic_module(auto, model_config.model, trust_remote_code=True)
    return cls, sys.modules[cls.__module__]


class MegatronFocusForVLLM(nn.Module):
    """The export, its attention layers served from vLLM's KV cache."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        hf_class, self.modeling = _export_class(vllm_config.model_config)
        self.config = config
        self.hf = hf_class(config)
        kinds = [_served_as(layer.self_attn, self.modeling) for layer in self.hf.model.layers]
        if FocusLayer in kinds:
            self.modeling.check_focus_inference(config)
        self.attention = nn.ModuleList(
            kind(layer.self_attn, self.modeling, vllm_config, f"{prefix}attention.{i}")
            for i, (kind, layer) in enumerate(zip(kinds, self.hf.model.layers))
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        model, config = self.hf.model, self.config
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        if config.position_embedding_type == "learned_absolute":
            x = x + model.embed_positions(positions)
        rope = None
        if config.position_embedding_type == "rope":
            rope = self.modeling.rotary(positions[None], config, x.dtype)
        x = x[None]  # [1, tokens, hidden]: the batch's sequences one after another
        for layer, attention in zip(model.layers, self.attention):
            x = x + attention(layer.input_layernorm(x), rope)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return model.norm(x)[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple]) -> set:
        params = dict(self.hf.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"{name}: no such weight in {ARCHITECTURE}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        if self.config.tie_word_embeddings:
            self.hf.lm_head.weight = self.hf.model.embed_tokens.weight
            loaded.add("lm_head.weight")
        return {f"hf.{name}" for name in loaded}


def _served_as(attention, modeling) -> type:
    """How a layer of the export serves: Focus's over its pages; standard attention and XSA
    (whose projection follows the attention call) by vLLM's paged attention; any other kind (a
    variant's own HF layer) refused by name, as vLLM's attention would not compute it."""
    if isinstance(attention, modeling.FocusAttention):
        return FocusLayer
    if type(attention) is modeling.Attention or vars(type(attention)).get("dense_interface"):
        return PagedLayer
    kind = attention.config.layer_attention[attention.layer_idx]
    raise ValueError(
        f"layer {attention.layer_idx} is a {kind!r} layer ({type(attention).__name__}), which "
        "vLLM serves neither with its own attention nor with Focus's: serve this export with "
        "transformers"
    )


class PagedLayer(nn.Module):
    """A standard or XSA layer: vLLM's paged attention, the export's projections around it."""

    def __init__(self, attention, modeling, vllm_config, prefix: str):
        super().__init__()
        self.export = [attention]  # its weights are the model's, not this layer's
        config = attention.config
        self.attn = Attention(
            config.num_attention_heads,
            config.head_dim,
            config.head_dim**-0.5,
            num_kv_heads=config.num_key_value_heads,
            cache_config=vllm_config.cache_config,
            per_layer_sliding_window=config.sliding_window,
            prefix=f"{prefix}.attn",
        )

    def forward(self, x, rope):
        attention = self.export[0]
        q, k, v = attention.qkv(x, rope)
        tokens = x.shape[1]
        y = self.attn(*(t[0].transpose(0, 1).reshape(tokens, -1) for t in (q, k, v)))
        y = y.view(1, tokens, -1, attention.config.head_dim).transpose(1, 2)
        y = attention.project(y, v)
        return attention.o_proj(y.transpose(1, 2).reshape(1, tokens, -1))


@dataclasses.dataclass(frozen=True)
class Row:
    """A Focus page's row, one per token: its key and value (kv heads x d each), its
    log-assignment (K numbers; in sparse mode its bucket, in the first), the causal Sinkhorn's
    running log-sums after it (iterations x K), float32, padded to an even width."""

    kv_heads: int
    head_dim: int
    groups: int
    iters: int

    @property
    def width(self) -> int:
        used = 2 * self.kv_heads * self.head_dim + (1 + self.iters) * self.groups
        return used + used % 2

    def split(self, rows: torch.Tensor) -> tuple:
        """rows `[n, width]` -> keys, values `[1, kv heads, n, d]`, log_g `[1, n, K]`, sums
        `[1, n, iters, K]`."""
        n, kv, k = rows.shape[0], self.kv_heads * self.head_dim, self.groups
        keys, values = (
            rows[:, i * kv : (i + 1) * kv].view(n, self.kv_heads, -1).transpose(0, 1)[None]
            for i in (0, 1)
        )
        log_g = rows[:, 2 * kv : 2 * kv + k][None]
        sums = rows[:, 2 * kv + k : 2 * kv + k + self.iters * k].view(n, self.iters, k)[None]
        return keys, values, log_g, sums

    def join(self, keys, values, log_g, sums) -> torch.Tensor:
        """`split`'s inverse."""
        n = keys.shape[2]
        parts = [keys[0].transpose(0, 1), values[0].transpose(0, 1), log_g[0], sums[0]]
        row = torch.cat([p.reshape(n, -1).float() for p in parts], dim=1)
        return nn.functional.pad(row, (0, self.width - row.shape[1]))


class FocusLayer(nn.Module):
    """A Focus layer: the export's own attention layer, per sequence, over its pages."""

    def __init__(self, attention, modeling, vllm_config, prefix: str):
        super().__init__()
        self.export, self.modeling = [attention], modeling
        config = attention.config
        self.row = Row(
            config.num_key_value_heads,
            config.head_dim,
            config.focus_groups,
            config.focus_sinkhorn_iters,
        )
        self.pages = FocusPages(self.row.width, vllm_config, f"{prefix}.pages")

    def forward(self, x, rope):
        metadata = get_forward_context().attn_metadata
        if metadata is None:  # vLLM's profiling run, before any page exists
            return torch.zeros_like(x)
        meta = (metadata[0] if isinstance(metadata, list) else metadata)[self.pages.layer_name]
        pages = self.pages.kv_cache.view(-1, self.row.width)  # one row per slot
        starts, lengths = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        out = torch.zeros_like(x)
        for r, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
            if end > start:
                step = slice(start, end)
                past = lengths[r] - (end - start)
                held = pages.index_select(0, self._slots(meta.block_table[r], past))
                step_rope = None if rope is None else tuple(t[..., step, :] for t in rope)
                out[:, step], written = focus_step(
                    self.export[0], self.modeling, self.row, x[:, step], step_rope, held
                )
                pages[meta.slot_mapping[step].long()] = self.row.join(*written)
        return out

    def _slots(self, block_table: torch.Tensor, past: int) -> torch.Tensor:
        """The slots of a sequence's first `past` tokens, in order."""
        size = self.pages.block_size
        blocks = block_table[: (past + size - 1) // size].long()
        return (blocks[:, None] * size + torch.arange(size, device=blocks.device)).flatten()[:past]


def focus_step(attention, modeling, row: Row, x, rope, held: torch.Tensor) -> tuple:
    """The export's Focus layer `attention` on one sequence's step `x` `[1, tokens, hidden]`,
    its earlier tokens' rows `held` read into the export's own Focus cache: (the step's output,
    its tokens' (keys, values, log_g, sums), as `row.join` takes them)."""
    config, past = attention.config, held.shape[0]
    sparse = config.focus_attention_mode == "sparse"
    cache = modeling.DynamicCache()
    layer = modeling.focus_cache_layer(cache, attention.layer_idx, config)
    if past:
        keys, values, log_g, sums = row.split(held)
        dtype = attention.q_proj.weight.dtype
        keys, values = keys.to(dtype), values.to(dtype)
        layer.update(keys, values)
        if sparse:
            layer.update_routing(sums=sums)
            positions = torch.arange(past, device=keys.device)
            layer.buckets.append(keys, values, positions, log_g[..., 0].long())
        else:
            layer.update_routing(log_g=log_g, groups=modeling.rank_groups(log_g), sums=sums)
    written = _Written(layer, row.groups)
    pairs = modeling.CausalPairs(x.shape[1], past, None, x.device, config.sliding_window)
    return attention(x, rope, pairs, cache), written.tensors()


class _Written:
    """What the export's layer writes into its cache during one step: the step's keys and
    values, routing state and (sparse mode) buckets, recorded as they go in."""

    def __init__(self, layer, groups: int):
        self.state, self.groups = {}, groups
        self._wrap(layer, "update", lambda keys, values, *a, **kw: {"k": keys, "v": values})
        self._wrap(layer, "update_routing", lambda **state: state)
        if hasattr(layer, "buckets"):
            self._wrap(layer.buckets, "append", lambda k, v, positions, bucket: {"bucket": bucket})

    def _wrap(self, owner, name: str, record) -> None:
        original = getattr(owner, name)

        def recorded(*args, **kwargs):
            self.state.update(record(*args, **kwargs))
            return original(*args, **kwargs)

        setattr(owner, name, recorded)

    def tensors(self) -> tuple:
        s = self.state
        if "bucket" in s:  # sparse: the bucket in the log-assignment's place
            log_g = s["bucket"][..., None].float().expand(-1, -1, self.groups)
        else:
            log_g = s["log_g"]
        return s["k"], s["v"], log_g, s["sums"]


@dataclasses.dataclass
class FocusMetadata:
    """What a Focus layer reads of vLLM's batch: each sequence's tokens in the flat batch
    (`query_start_loc`), its length with them, its blocks and the step's slots."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class FocusMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        # vLLM's base class declares __init__ abstract: a builder must define its own
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        m = common_attn_metadata
        return FocusMetadata(m.query_start_loc, m.seq_lens, m.block_table_tensor, m.slot_mapping)


class FocusBackend(AttentionBackend):
    """A Focus layer's pages: vLLM allocates and maps them; the layer computes over them."""

    forward_includes_kv_cache_update = True
    supported_dtypes = [torch.float32]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("a Focus layer computes its own attention")

    @staticmethod
    def get_builder_cls():
        return FocusMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype="auto"):
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)


class FocusPages(nn.Module, AttentionLayerBase):
    """A Focus layer's pages in vLLM's KV cache: one float32 `Row` per token."""

    def __init__(self, width: int, vllm_config, prefix: str):
        super().__init__()
        self.layer_name, self.width = prefix, width
        self.block_size = vllm_config.cache_config.block_size
        self.kv_cache = torch.tensor([])
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix}")
        context[prefix] = self

    def get_attn_backend(self):
        return FocusBackend

    def get_kv_cache_spec(self, vllm_config):
        half = self.width // 2
        return FullAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=1,
            head_size=half,
            head_size_v=half,
            dtype=torch.float32,
        )
