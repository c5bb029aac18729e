"""Focus as Megatron modules: the router, a SelfAttention that routes, and the core attention.

Data flow in one layer (TP = tensor-parallel size):

    h (normalised hidden state, [s/TP, b, d] under sequence parallelism, else [s, b, d])
      -> router: r = W_g h, gathered along the sequence under SP -> scores r C^T / tau
         -> causal Sinkhorn -> log-assignments [b, s, K], identical on every TP rank, and each
            token's groups ranked once (groups.Routing)
      -> SelfAttention as usual (QKV, RoPE), its core attention gets the routing through
         Megatron's `attention_bias` slot and applies the Focus pair rule to its own heads.

`W_g` and `C` are replicated on every TP rank. Each rank's heads send gradient into the shared
assignments, so the assignments pass through `sum_grad_over_tensor_parallel` (identity forward,
all-reduce backward): `C` then gets its full gradient on every rank, and so does `W_g`
without SP; under SP each rank's `W_g` sees its slice of the sequence only, so `W_g` is flagged
`sequence_parallel` and summed over TP like the norms.
"""

import contextlib
import dataclasses
import math
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.parallel_state import get_tensor_model_parallel_world_size
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention
from torch.utils.checkpoint import checkpoint

from megatron_focus.model.core_attention import CoreAttention
from megatron_focus.model.focus_gate import focus_attention
from megatron_focus.model.focus_sparse import sparse_focus_attention
from megatron_focus.model.groups import Routing
from megatron_focus.model.sinkhorn import causal_sinkhorn
from megatron_focus.model.xsa import XSAMixin
from megatron_focus.parallel import sum_grad_over_tensor_parallel
from megatron_focus.variants import FOCUS_MODES, FocusConfig


class Router(torch.nn.Module):
    """W_g (d -> d_g) and K centroids: token -> log-assignment over groups, shared by all heads."""

    def __init__(self, config: TransformerConfig, focus: FocusConfig):
        super().__init__()
        self.focus = focus
        self.sequence_parallel = config.sequence_parallel
        self.tp = get_tensor_model_parallel_world_size()
        self.proj = torch.nn.Linear(config.hidden_size, focus.dim, bias=False)
        self.centroids = torch.nn.Parameter(torch.empty(focus.groups, focus.dim))
        torch.nn.init.normal_(self.proj.weight, std=config.init_method_std)
        torch.nn.init.normal_(self.centroids, std=1.0 / math.sqrt(focus.dim))
        self.proj.weight.sequence_parallel = config.sequence_parallel
        self.record_stats = False  # set by `recording_statistics`
        self.stats: Optional[dict] = None

    def forward(self, hidden_states: torch.Tensor) -> Routing:
        r = self.proj(hidden_states)
        if self.sequence_parallel:
            # Each rank then sends back the full gradient of its slice: split, not reduce-scatter.
            r = gather_from_sequence_parallel_region(r, tensor_parallel_output_grad=False)
        scores = (r.float() @ self.centroids.float().t()).transpose(0, 1) / self.focus.tau
        if torch.is_grad_enabled():
            # Recomputed in backward: its iterations would otherwise keep ~6 [b, s, K] tensors
            # each, more than the attention's own saved state at K = 8 and 10 iterations.
            log_g = checkpoint(
                causal_sinkhorn, scores, self.focus.sinkhorn_iters, use_reentrant=False
            )
        else:
            log_g = causal_sinkhorn(scores, self.focus.sinkhorn_iters)
        routing = Routing.of(log_g)
        if self.record_stats:
            with torch.no_grad():
                self.stats = group_stats(
                    routing, self.focus.top_k, self.focus.window, self.focus.sink_tokens
                )
        if self.tp > 1:
            routing = routing._replace(log_g=sum_grad_over_tensor_parallel(log_g))
        return routing


def group_stats(routing: Routing, top_k: int, window: int, sink: int = 0) -> dict:
    """Occupancy of the groups and the share of causal pairs the hard top-k rule keeps.

    `largest-group`: share of tokens whose top-1 group is the most popular one (1/K is ideal);
    `group-entropy`: entropy of the soft occupancy / log K (1 is perfectly balanced);
    `pairs-kept`: kept causal pairs / all causal pairs, counted with per-group prefix counts
    (local pairs, distant sinks, plus distant non-sink keys whose top-1 group is among the
    query's top-k).
    """
    log_g = routing.log_g
    b, n, groups = log_g.shape
    top = routing.top(min(top_k, groups))
    # (one_hot would check its input's range on the host: a device synchronisation)
    onehot = (top[..., :1] == torch.arange(groups, device=top.device)).long()
    largest = onehot.sum(1).max(-1).values.float().mean() / n
    occupancy = log_g.exp().mean(dim=(0, 1))
    entropy = -(occupancy * occupancy.clamp_min(1e-30).log()).sum() / math.log(max(groups, 2))
    positions = torch.arange(n, device=log_g.device)
    local = torch.clamp(positions + 1, max=window)
    distant_end = positions - window  # keys j <= i - w are distant
    members = onehot * (positions >= sink)[:, None]  # sinks are in no group
    prefix = members.cumsum(1)  # [b, n, K] non-sink tokens <= t per top-1 group
    counts = prefix[:, distant_end.clamp(min=0)]  # [b, n, K]
    distant = counts.gather(-1, top).sum(-1) * (distant_end >= 0)
    distant_sinks = torch.clamp(torch.clamp(distant_end + 1, max=sink), min=0)
    kept = (local + distant + distant_sinks).sum(-1).float().mean() / (n * (n + 1) / 2)
    return {"largest-group": largest, "group-entropy": entropy, "pairs-kept": kept}


class FocusSelfAttention(SelfAttention):
    """Megatron's SelfAttention, with a router reading the same normalised hidden state as QKV."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules,
        layer_number: int,
        attn_mask_type,
        focus: FocusConfig,
        **kwargs,
    ):
        super().__init__(config, submodules, layer_number, attn_mask_type, **kwargs)
        self.router = Router(config, focus)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if kwargs.get("attention_bias") is not None:
            raise ValueError("Focus attention takes no attention_bias")
        kwargs["attention_bias"] = self.router(hidden_states)
        return super().forward(hidden_states, attention_mask, **kwargs)

    def _checkpointed_attention_forward(
        self,
        query,
        key,
        value,
        attention_mask,
        rotary_pos_emb=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        """Megatron's selective recompute (`--recompute-activations`), with the routing's
        log-assignments an input of the checkpoint like q, k and v: a value the recomputed
        forward only closed over would send its gradient through the router's graph twice."""
        routing, mask_type = attention_bias, attn_mask_type or self.attn_mask_type

        def core(q, k, v, mask, log_g):
            return self.core_attention(
                q,
                k,
                v,
                mask,
                attn_mask_type=mask_type,
                attention_bias=Routing(log_g, routing.groups),
                packed_seq_params=packed_seq_params,
            )

        return tensor_parallel.checkpoint(
            core, False, query, key, value, attention_mask, routing.log_g
        )


class FocusAttention(CoreAttention):
    """Causal attention under the Focus pair rule: soft gate (training) or hard top-k (sparse).

    Sparse mode computes only the kept pairs (focus_sparse) when no gradient is needed; with
    gradients it evaluates the same hard rule by masked chunks.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type,
        focus: FocusConfig,
        **kwargs,
    ):
        super().__init__(config, layer_number, attn_mask_type, **kwargs)
        self.focus = focus

    def attend(self, q, k, v, attention_mask, routing=None):
        if routing is None:
            raise ValueError("Focus core attention needs the router's assignments")
        if attention_mask is not None:
            raise NotImplementedError("Focus attention is causal only (no custom attention mask)")
        focus, sparse = self.focus, self.focus.attention_mode == "sparse"
        if sparse and not torch.is_grad_enabled():
            return sparse_focus_attention(
                q,
                k,
                v,
                routing,
                window=focus.window,
                top_k=focus.top_k,
                scale=self.softmax_scale,
                sink=focus.sink_tokens,
            )
        return focus_attention(
            q,
            k,
            v,
            routing,
            window=focus.window,
            gate_scale=focus.gate_scale,
            top_k=focus.top_k if sparse else None,
            chunk_size=focus.chunk_size,
            scale=self.softmax_scale,
            dropout_p=self.dropout_p if self.training else 0.0,
            kernel=focus.kernel,
            gate=focus.gate,
            sink=focus.sink_tokens,
        )


class FocusXSAAttention(XSAMixin, FocusAttention):
    """Focus attention, XSA on its output (`--attention focus+xsa`)."""


def train_routers_only(model: torch.nn.Module) -> None:
    """A retrofit: only the Focus routers learn; every other weight is frozen."""
    for name, param in model.named_parameters():
        param.requires_grad = ".router." in name


def set_focus_mode(model: torch.nn.Module, mode: str, top_k: Optional[int] = None) -> None:
    """Switch every Focus layer between the soft gate and the hard rule (optionally its top-k):
    each router and core attention gets a new FocusConfig."""
    if mode not in FOCUS_MODES:
        raise ValueError(f"unknown Focus mode {mode!r}; choose from {FOCUS_MODES}")
    for module in model.modules():
        if isinstance(module, (FocusAttention, Router)):
            if top_k is not None and not 1 <= top_k <= module.focus.groups:
                raise ValueError(f"top-k {top_k} outside 1..{module.focus.groups}")
            module.focus = dataclasses.replace(
                module.focus,
                attention_mode=mode,
                top_k=module.focus.top_k if top_k is None else top_k,
            )


@contextlib.contextmanager
def recording_statistics(model: torch.nn.Module):
    """Routers compute their statistics in the forwards inside this block only (they are read at
    log steps; computing them at every forward would cost device work for nothing)."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    for router in routers:
        router.record_stats, router.stats = True, None
    try:
        yield
    finally:
        for router in routers:
            router.record_stats = False


def focus_statistics(model: torch.nn.Module) -> dict:
    """{'focus/layer03/largest-group': 0-dim tensor, ...} from each router's last recorded
    forward (`recording_statistics`); still on the device: reading them is the caller's sync."""
    out = {}
    for module in model.modules():
        if isinstance(module, FocusSelfAttention) and module.router.stats is not None:
            for name, value in module.router.stats.items():
                out[f"focus/layer{module.layer_number:02d}/{name}"] = value
    return out
