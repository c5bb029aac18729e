"""Focus as Megatron modules: the router, the core attention that owns it, and a SelfAttention
that hands the core attention the hidden state.

Data flow in one layer (TP = tensor-parallel size):

    h (normalised hidden state, [s/TP, b, d] under sequence parallelism, else [s, b, d])
      -> SelfAttention as usual (QKV, RoPE), then core attention(q, k, v, mask, h):
         -> router: r = W_g h, gathered along the sequence under SP -> scores r C^T / tau
            -> causal Sinkhorn -> log-assignments [b, s, K], identical on every TP rank, and
               each token's groups ranked once (groups.Routing)
         -> the Focus pair rule on this rank's heads.

`W_g` and `C` are replicated on every TP rank. Each rank's heads send gradient into the shared
assignments, so the assignments pass through `sum_grad_over_tensor_parallel` (identity forward,
all-reduce backward): `C` then gets its full gradient on every rank, and so does `W_g`
without SP; under SP each rank's `W_g` sees its slice of the sequence only, so `W_g` is flagged
`sequence_parallel` and summed over TP like the norms.
"""

import contextlib
import dataclasses
import math
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.parallel_state import (
    get_context_parallel_group,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_world_size,
)
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch.utils.checkpoint import checkpoint

from megatron_focus import platform
from megatron_focus.model.auxiliary import AuxiliaryLoss
from megatron_focus.model.core_attention import CoreAttention
from megatron_focus.model.documents import document_starts
from megatron_focus.model.focus.distill import distant_groups, distillation_loss
from megatron_focus.model.focus.focus_gate import focus_attention
from megatron_focus.model.focus.focus_sparse import sparse_focus_attention
from megatron_focus.model.focus.groups import Routing, top1_onehot
from megatron_focus.model.focus.routing_quality import kept_mass
from megatron_focus.model.hooks import EvalMode, VariantHooks
from megatron_focus.model.kernels import kernels
from megatron_focus.model.xsa import XSAMixin
from megatron_focus.parallel.context_parallel import chunk_ids, gather_sequence, positions
from megatron_focus.parallel.tensor_parallel import sum_grad_over_tensor_parallel
from megatron_focus.variants import FOCUS_MODES, FocusConfig, current_name

# The kept mass's sample at log steps: the last queries of a micro-batch's first sequence (the
# dense scores it needs are these queries against every key: cheap beside the step)
KEPT_MASS_SAMPLE = 256


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
        self.cp_group = get_context_parallel_group() if config.context_parallel_size > 1 else None
        self.sinkhorn = kernels.sinkhorn(platform.setup().device)

    def positions(self, length: int, device=None) -> torch.Tensor:
        """The sequence positions of this context-parallel rank's `length` tokens."""
        return positions(length, self.cp_group.rank(), self.cp_group.size(), device)

    def forward(self, hidden_states: torch.Tensor, doc_start=None, shared: bool = True) -> Routing:
        """`doc_start` [b, s]: each token's document start, with packed documents (documents.py).
        `shared`: the routing feeds this rank's heads, whose gradients are summed over the
        tensor-parallel ranks, and its statistics are recorded; else (the distillation's) every
        rank computes the same loss from it."""
        r = self.proj(hidden_states)
        if self.sequence_parallel:
            # Each rank then sends back the full gradient of its slice: split, not reduce-scatter.
            r = gather_from_sequence_parallel_region(r, tensor_parallel_output_grad=False)
        scores = (r.float() @ self.centroids.float().t()).transpose(0, 1) / self.focus.tau
        inputs = (scores, self.focus.sinkhorn_iters, doc_start)
        if self.cp_group is not None:  # the prefixes continue across ranks
            inputs += ((self.positions(scores.shape[1], scores.device), self.cp_group),)
        if self.sinkhorn.recompute and torch.is_grad_enabled():
            log_g = checkpoint(self.sinkhorn, *inputs, use_reentrant=False)
        else:
            log_g = self.sinkhorn(*inputs)
        routing = Routing.of(log_g, doc_start)
        if self.record_stats and shared:
            with torch.no_grad():
                self.stats = group_stats(
                    gather_routing(routing, self.cp_group),
                    self.focus.top_k,
                    self.focus.window,
                    self.focus.sink_tokens,
                )
        if self.tp > 1 and shared:
            routing = routing._replace(log_g=sum_grad_over_tensor_parallel(log_g))
        return routing


def gather_routing(routing: Routing, cp_group) -> Routing:
    """The whole sequence's routing, from every context-parallel rank's (as it is without)."""
    if cp_group is None:
        return routing
    log_g = gather_sequence(routing.log_g, 1, cp_group)
    docs = None if routing.doc_start is None else gather_sequence(routing.doc_start, 1, cp_group)
    return Routing.of(log_g, docs)


def group_stats(routing: Routing, top_k: int, window: int, sink: int = 0) -> dict:
    """Occupancy of the groups and the share of causal pairs the hard top-k rule keeps.

    `largest-group`: share of tokens whose top-1 group is the most popular one (1/K is ideal);
    `group-entropy`: entropy of the soft occupancy / log K (1 is perfectly balanced);
    `pairs-kept`: kept causal pairs / all causal pairs (inside each document, with packed
    documents), counted with per-group prefix counts (local pairs, distant sinks, plus distant
    non-sink keys whose top-1 group is among the query's top-k).
    """
    log_g = routing.log_g
    b, n, groups = log_g.shape
    top = routing.top(min(top_k, groups))
    onehot = top1_onehot(top, groups)
    largest = onehot.sum(1).max(-1).values.float().mean() / n
    occupancy = log_g.exp().mean(dim=(0, 1))
    entropy = -(occupancy * occupancy.clamp_min(1e-30).log()).sum() / math.log(max(groups, 2))
    positions = torch.arange(n, device=log_g.device)
    first = torch.zeros_like(positions) if routing.doc_start is None else routing.doc_start
    first = first.expand(b, n)
    position = positions - first  # in the document
    local = torch.clamp(position + 1, max=window)
    members = onehot * (position >= sink)[..., None]  # sinks are in no group
    # [b, n + 1, K]: non-sink tokens before position t per top-1 group
    before = torch.nn.functional.pad(members.cumsum(1), (0, 0, 1, 0))
    distant_end = (positions - window + 1).clamp(min=0).expand(b, n)  # keys j < i - w + 1
    counts = before.gather(1, distant_end[..., None].expand(b, n, groups)) - before.gather(
        1, first[..., None].expand(b, n, groups)
    )  # [b, n, K] distant keys (i - w >= j >= the document's start) per group
    distant = counts.gather(-1, top).sum(-1) * (position >= window)
    distant_sinks = torch.clamp(torch.clamp(position - window + 1, max=sink), min=0)
    kept = (local + distant + distant_sinks).sum().float() / (position + 1).sum()
    return {"largest-group": largest, "group-entropy": entropy, "pairs-kept": kept}


class FocusSelfAttention(SelfAttention):
    """Megatron's SelfAttention, handing its core attention the normalised hidden state too (the
    router's input), as an explicit argument, as Megatron's DSA takes it under MLA.

    Megatron-Core's `SelfAttention.forward` passes its core attention only q, k, v and masks
    (0.16.1 to 0.19.2), so this is its forward for what megatron-focus runs: Megatron's QKV
    (with its QK-norms), RoPE and output projection, and its selective recompute of the core
    attention (`--recompute-activations`). KV-cache inference and Megatron's THD packed sequences
    (`packed_seq_params`) are refused; documents packed in one sequence come as the mask.

    Megatron-Core 0.18 added the hook `_run_core_attention(**extra_kwargs)` and 0.19 the
    recompute of tensor extra kwargs (`_checkpointed_attention_forward(core_attention_extra_
    kwargs=)`), but its forward still calls neither with an extra argument; the release whose
    forward does lets this class go, the router's input passing as such a kwarg.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Registered last, as the router once was: the parameter order (and with it DeepSpeed's
        # flat optimizer partitions in checkpoints) stays that of earlier versions.
        self._modules["core_attention"] = self._modules.pop("core_attention")
        self._register_load_state_dict_pre_hook(_current_names)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        inference_context=None,
        rotary_pos_emb=None,
        attention_bias=None,
        packed_seq_params=None,
        **inference_inputs,
    ):
        if inference_context is not None or packed_seq_params is not None:
            raise NotImplementedError("Focus attention runs without KV cache or packed sequences")
        if any(value is not None for value in inference_inputs.values()):
            raise NotImplementedError(f"Focus attention takes no {sorted(inference_inputs)}")
        query, key, value = self.get_query_key_value_tensors(hidden_states, None)
        if rotary_pos_emb is not None:
            if not isinstance(rotary_pos_emb, tuple):
                rotary_pos_emb = (rotary_pos_emb,) * 2
            cp = self.pg_collection.cp
            query = apply_rotary_pos_emb(query, rotary_pos_emb[0], config=self.config, cp_group=cp)
            key = apply_rotary_pos_emb(key, rotary_pos_emb[1], config=self.config, cp_group=cp)

        def core(query, key, value, attention_mask, hidden_states):
            return self.core_attention(
                query, key, value, attention_mask, hidden_states, attention_bias=attention_bias
            )

        inputs = (query, key, value, attention_mask, hidden_states)
        if self.checkpoint_core_attention and self.training:
            # The hidden state is an input of the checkpoint like q, k and v: the router is
            # recomputed with the attention, its gradient sent back once.
            out = tensor_parallel.checkpoint(core, False, *inputs)
        else:
            out = core(*inputs)
        return self.linear_proj(out)


def _current_names(state_dict, prefix, *args):
    """A checkpoint of an earlier version loads with its weights' names of today."""
    for name in [k for k in state_dict if k.startswith(prefix) and current_name(k) != k]:
        state_dict[current_name(name)] = state_dict.pop(name)


@dataclasses.dataclass
class FocusAttentionSubmodules:
    router: Union[ModuleSpec, type] = None


class FocusAttention(CoreAttention):
    """Causal attention under the Focus pair rule: soft gate (training) or hard top-k (sparse).

    Its router turns the layer's hidden state into the routing its heads share. Sparse mode
    computes only the kept pairs (focus_sparse), forward and backward; under context
    parallelism it evaluates the same hard rule by masked chunks.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: FocusAttentionSubmodules,
        layer_number: int,
        attn_mask_type,
        focus: FocusConfig,
        **kwargs,
    ):
        super().__init__(config, layer_number, attn_mask_type, **kwargs)
        self.focus = focus
        self.router = build_module(submodules.router, config=config, focus=focus)
        device = platform.setup().device
        dtype = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None
        self.soft_gate = kernels.soft_gate(
            focus.kernel,
            device,
            self.dropout_p,
            focus.chunk_size,
            self.cp_group is not None,
            head_dim=config.kv_channels,
            dtype=dtype,
        )
        self.sparse = kernels.sparse(device, config.kv_channels, dtype)
        self.mass_sample: Optional[int] = 0  # the kept mass's queries (`recording_statistics`)
        self.dense = False  # attend as standard attention (a dense warm-up, FocusHooks)

    @classmethod
    def spec(cls, focus: FocusConfig) -> ModuleSpec:
        """The router is a spec'd submodule, as Megatron's DSA has its indexer."""
        return ModuleSpec(
            cls, params={"focus": focus}, submodules=FocusAttentionSubmodules(router=Router)
        )

    def forward(self, query, key, value, attention_mask, hidden_states, **kwargs):
        """`attention_mask`: None (causal), or Megatron's mask of packed documents, which the
        routing carries from here (its Sinkhorn restarts at each document, and so does the
        rule)."""
        doc_start = None
        if attention_mask is not None:
            rows = None if self.cp_group is None else self.router.positions(query.shape[0])
            doc_start = document_starts(attention_mask, query.shape[1], rows)
        if self.dense:  # the routing serves the distillation alone
            with torch.no_grad():
                routing = self.router(hidden_states, doc_start)
        else:
            routing = self.router(hidden_states, doc_start)
        if self.router.record_stats and self.mass_sample != 0:
            self.router.stats["kept-mass"] = self.sampled_kept_mass(query, key, routing)
        mask = attention_mask if self.dense else None  # Focus's rule takes documents as routed
        out = super().forward(query, key, value, mask, routing=routing, **kwargs)
        if self.training and self.focus.distill_coeff > 0 and torch.is_grad_enabled():
            loss = self.distillation_loss(query, key, hidden_states, doc_start)
            if self.router.record_stats:  # one process's: the context-parallel shares summed
                whole = loss.detach().clone()
                if self.cp_group is not None:
                    dist.all_reduce(whole, group=self.cp_group)
                self.router.stats["distill-loss"] = whole
            out = AuxiliaryLoss.apply(out, loss * self.focus.distill_coeff)
        return out

    def distillation_loss(self, query, key, hidden_states, doc_start) -> torch.Tensor:
        """The routers' distillation loss on this micro-batch (distill.py): this rank's
        share of it, the shares of the context-parallel ranks adding up to one process's; the
        router run again on the detached hidden state, so that only it learns from the loss."""
        log_g = self.router(hidden_states.detach(), doc_start, shared=False).log_g
        q, k = (t.detach().permute(1, 2, 0, 3) for t in (query, key))
        keys = Routing.of(log_g.detach(), doc_start)
        if self.cp_group is not None:  # every key: the whole sequence's, from every rank
            k = gather_sequence(k, 2, self.cp_group)
            keys = gather_routing(keys, self.cp_group)
        keys_g = top1_onehot(keys.groups, log_g.shape[-1]).float()
        docs = keys.doc_start
        focus, parts = self.focus, []
        chunks = [(slice(None), 0)]
        if self.cp_group is not None:  # this rank's two chunks, at their positions
            size = q.shape[2] // 2
            chunks = [
                (slice(slot * size, (slot + 1) * size), index * size)
                for slot, index in enumerate(chunk_ids(self.cp_group.rank(), self.cp_group.size()))
            ]
        for rows, offset in chunks:
            end = offset + q[:, :, rows].shape[2]
            parts.append(
                distant_groups(
                    q[:, :, rows], k[:, :, :end], keys_g[:, :end], focus.window,
                    self.softmax_scale, focus.sink_tokens,
                    None if docs is None else docs[:, :end], offset,
                )
            )  # fmt: skip
        sums, masses = (torch.cat(part, dim=1) for part in zip(*parts))
        if self.router.tp > 1:  # every rank's heads
            for t in (sums, masses):
                dist.all_reduce(t, group=get_tensor_model_parallel_group())
        heads = self.heads * self.router.tp
        total = masses.sum() / heads
        if self.cp_group is not None:
            dist.all_reduce(total, group=self.cp_group)
        return distillation_loss(log_g, sums, masses, heads, total)

    @torch.no_grad()
    def sampled_kept_mass(self, query, key, routing: Routing) -> torch.Tensor:
        """The dense attention's mass the hard rule keeps at the layer's top-k (routing_quality),
        on `mass_sample` last queries of the first sequence (None: every query of every one).
        Under TP the mean over every rank's heads (a rank holds as many as any other); under
        context parallelism every rank gathers the sampled sequences' queries, keys and routing
        (at log steps only) and computes one process's value."""
        sequences = slice(None) if self.mass_sample is None else slice(0, 1)
        query, key = query[:, sequences], key[:, sequences]
        routing = Routing(*(None if t is None else t[sequences] for t in routing))
        if self.cp_group is not None:
            query, key = (gather_sequence(t, 0, self.cp_group) for t in (query, key))
            routing = gather_routing(routing, self.cp_group)
        rows = slice(None) if self.mass_sample is None else slice(-self.mass_sample, None)
        q, k = (t.permute(1, 2, 0, 3) for t in (query[rows], key))
        mass = kept_mass(
            q,
            k,
            routing,
            self.focus.window,
            self.softmax_scale,
            self.focus.sink_tokens,
        )
        if self.router.tp > 1:
            dist.all_reduce(mass, group=get_tensor_model_parallel_group())
            mass /= self.router.tp
        return mass[self.focus.top_k - 1]

    def gather_inputs(self, routing: Routing) -> dict:
        return {"routing": gather_routing(routing, self.cp_group)}

    def attend_rows(self, q, k, v, attention_mask, offset: int, routing: Routing):
        if self.dense:
            return CoreAttention.attend_rows(self, q, k, v, attention_mask, offset)
        return self.attend(q, k, v, attention_mask, routing, offset)

    def attend(self, q, k, v, attention_mask, routing=None, offset: int = 0):
        """`offset`: the queries are positions [offset, offset + nq) of the keys' sequence
        (context parallelism's chunks, which take the hard rule by masked chunks in sparse
        mode: the sparse dispatch attends whole sequences). Dense (a warm-up): standard
        attention under Megatron's mask."""
        if self.dense:
            return CoreAttention.attend(self, q, k, v, attention_mask)
        focus, sparse = self.focus, self.focus.attention_mode == "sparse"
        whole = self.cp_group is None
        if sparse and whole:  # kept pairs only
            return sparse_focus_attention(
                q,
                k,
                v,
                routing,
                window=focus.window,
                top_k=focus.top_k,
                scale=self.softmax_scale,
                sink=focus.sink_tokens,
                kernel=self.sparse,
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
            kernel=self.soft_gate,
            gate=focus.gate,
            sink=focus.sink_tokens,
            offset=offset,
        )


class FocusXSAAttention(XSAMixin, FocusAttention):
    """Focus attention, XSA on its output (`--attention focus+xsa`)."""


class FocusHooks(VariantHooks):
    """Focus in a run: routers frozen in sparse mode (alone trained in a retrofit), the other
    mode validated too, the routing's statistics logged."""

    settings: FocusConfig

    def banner(self) -> str:
        settings, parts = self.settings, [f"Focus {self.settings.gate} gate"]
        if settings.distill_coeff:
            parts.append(f"routers distilled (x{settings.distill_coeff:g})")
        if settings.dense_warmup_iters:
            parts.append(f"dense warm-up of {settings.dense_warmup_iters} iterations")
        return ", ".join(parts)

    def freeze(self, model: torch.nn.Module, retrofit: bool) -> None:
        if retrofit:
            train_routers_only(model)
        elif self.settings.attention_mode == "sparse" and not self.settings.distill_coeff:
            freeze_routers(model)  # (distilled, they learn in sparse mode too)
        freeze_router_controls(model, self.settings.router)

    @contextlib.contextmanager
    def training(self, model: torch.nn.Module, iteration: int, start: int):
        """Dense attention in the warm-up's steps (validation keeps the run's modes)."""
        dense = start <= iteration < start + self.settings.dense_warmup_iters
        layers = [m for m in model.modules() if isinstance(m, FocusAttention)]
        for layer in layers:
            layer.dense = dense
        try:
            yield
        finally:
            for layer in layers:
                layer.dense = False

    def other_modes(self) -> Tuple[str, ...]:
        return tuple(m for m in FOCUS_MODES if m != self.settings.attention_mode)

    @contextlib.contextmanager
    def in_mode(self, model: torch.nn.Module, mode: str):
        set_focus_mode(model, mode)
        try:
            yield
        finally:
            set_focus_mode(model, self.settings.attention_mode)

    def evaluated_modes(self, top_k=None) -> Tuple[EvalMode, ...]:
        groups = self.settings.groups
        top_k = range(1, groups + 1) if top_k is None else top_k
        bad = [k for k in top_k if not 1 <= k <= groups]
        if bad:
            raise ValueError(
                f"--top-k {' '.join(map(str, bad))}: between 1 and the model's {groups} groups"
            )
        return (EvalMode("soft"),) + tuple(EvalMode("sparse", k, sparse=True) for k in top_k)

    def set_mode(self, model: torch.nn.Module, mode: EvalMode) -> None:
        set_focus_mode(model, mode.mode, mode.top_k)

    def recording(self, model: torch.nn.Module, sample="log"):
        return recording_statistics(
            model, {"log": KEPT_MASS_SAMPLE, "all": None}.get(sample, sample)
        )

    def statistics(self, model: torch.nn.Module) -> dict:
        return focus_statistics(model)

    def summary(self, values: dict) -> str:
        """The worst layer's largest group, the mean share of pairs kept, and where measured the
        mean share of the dense attention's mass they keep and the distillation loss."""
        if not values:
            return ""
        largest = max(v for k, v in values.items() if k.endswith("largest-group"))
        line = f" | focus largest group: {largest:.3f}"
        for name, label in (
            ("pairs-kept", "pairs kept"),
            ("kept-mass", "kept mass"),
            ("distill-loss", "router loss"),
        ):
            found = [v for k, v in values.items() if k.endswith(name)]
            if found:
                line += f" | focus {label}: {sum(found) / len(found):.3f}"
        return line


def train_routers_only(model: torch.nn.Module) -> None:
    """A retrofit: only the Focus routers learn; every other weight is frozen."""
    for name, param in model.named_parameters():
        param.requires_grad = ".router." in name


def freeze_routers(model: torch.nn.Module) -> None:
    """Sparse-mode training: the routers' groups are a hard choice with no gradient, so they
    stay out of the optimizer (no weight decay or momentum moves them)."""
    for name, param in model.named_parameters():
        if ".router." in name:
            param.requires_grad = False


def freeze_router_controls(model: torch.nn.Module, router: str) -> None:
    """A random router's control run: its parts keep the values drawn at initialization (from
    the run's seed), so whatever routing it does, it never learned."""
    frozen = {
        "learned": (),
        "random": (".proj.", ".centroids"),
        "random-centroids": (".centroids",),
    }[router]
    for name, param in model.named_parameters():
        if ".router." in name and any(part in name for part in frozen):
            param.requires_grad = False


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
def recording_statistics(model: torch.nn.Module, mass_sample: Optional[int] = KEPT_MASS_SAMPLE):
    """Routers compute their statistics in the forwards inside this block only (they are read at
    log steps; computing them at every forward would cost device work for nothing), the layers
    the kept mass on `mass_sample` queries (`FocusAttention.sampled_kept_mass`; 0: not at all)."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    layers = [m for m in model.modules() if isinstance(m, FocusAttention)]
    for router in routers:
        router.record_stats, router.stats = True, None
    for layer in layers:
        layer.mass_sample = mass_sample
    try:
        yield
    finally:
        for router in routers:
            router.record_stats = False
        for layer in layers:
            layer.mass_sample = 0


def focus_statistics(model: torch.nn.Module) -> dict:
    """{'focus/layer03/largest-group': 0-dim tensor, ...} from each router's last recorded
    forward (`recording_statistics`); still on the device: reading them is the caller's sync."""
    out = {}
    for module in model.modules():
        if isinstance(module, FocusAttention) and module.router.stats is not None:
            for name, value in module.router.stats.items():
                out[f"focus/layer{module.layer_number:02d}/{name}"] = value
    return out
