"""Standard causal attention behind Megatron-Core's `core_attention` contract.

Contract (what `SelfAttention` gives and expects): query `[sq, b, np, hn]`, key/value
`[sk, b, ng, hn]` with `np`/`ng` this tensor-parallel rank's heads and query groups, and an output
`[sq, b, np * hn]` that feeds the row-parallel output projection. Each rank sees the whole sequence
for its heads, also under sequence parallelism; under context parallelism (context_parallel.py)
it holds two chunks of it, and gathers every rank's keys and values.

The kernel is PyTorch SDPA (flash / memory-efficient kernels on a GPU, a fused CPU kernel here),
or flash-attn's `flash_attn_func` when it is installed and the inputs are on a GPU in half
precision. GQA is handed to the kernel as is: no repeated key/value tensors are materialised.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.parallel_state import (
    get_context_parallel_group,
    get_tensor_model_parallel_world_size,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import divide
from torch.utils.checkpoint import checkpoint

from megatron_focus.model.kernels.kernels import flash_attn_func, use_flash_attn
from megatron_focus.parallel.context_parallel import chunk_ids, gather_sequence


class CoreAttention(MegatronModule):
    """Causal softmax attention; subclasses change `attend` (which pairs) or `project` (the output).

    `attend` works in the kernel layout `[b, heads, s, hn]` and returns the per-head outputs;
    `project` may transform them per head before heads are merged (XSA does). A subclass's
    `forward` may hand `attend` more inputs by keyword (Focus's routing).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        tp = get_tensor_model_parallel_world_size()
        # Context parallelism: this rank holds two chunks of each sequence (context_parallel.py)
        self.cp_group = get_context_parallel_group() if config.context_parallel_size > 1 else None
        self.layer_number = layer_number
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        # Sliding window (left, 0): query i sees keys i - left .. i.
        self.window = None if config.window_size is None else config.window_size[0]

    @classmethod
    def spec(cls, settings=None):
        """How a layer builds this core attention: with the variant's settings, if it has any,
        as the keyword `settings` (a subclass with submodules of its own, as Focus's router,
        says so here)."""
        return cls if settings is None else ModuleSpec(cls, params={"settings": settings})

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
        **attend_inputs,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences are not supported")
        if attention_bias is not None:
            raise NotImplementedError("an additive attention bias is not supported")
        sq, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        # Heads differ across TP ranks, so their dropout draws from the per-TP-rank stream.
        with tensor_parallel.get_cuda_rng_tracker().fork():
            if self.cp_group is None:
                y = self.attend(q, k, v, attention_mask, **attend_inputs)
            elif torch.is_grad_enabled():
                # Recomputed in backward, gather included: the gathered keys and values (and the
                # standard chunks' causal masks) are never kept, only this rank's tokens.
                y = checkpoint(
                    self._attend_context_parallel,
                    q,
                    k,
                    v,
                    attention_mask,
                    use_reentrant=False,
                    **attend_inputs,
                )
            else:
                y = self._attend_context_parallel(q, k, v, attention_mask, **attend_inputs)
        y = self.project(y, v)
        return y.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

    def attend(self, q, k, v, attention_mask):
        dropout = self.dropout_p if self.training else 0.0
        if attention_mask is None and use_flash_attn(q):
            out = flash_attn_func(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                dropout_p=dropout,
                softmax_scale=self.softmax_scale,
                causal=True,
                window_size=(-1 if self.window is None else self.window, 0),
            )
            return out.transpose(1, 2)
        # Megatron's masks are True where a pair is *removed*; SDPA's where it is kept.
        keep = None if attention_mask is None else ~attention_mask
        if self.window is not None:
            keep = causal_window(q.shape[2], k.shape[2], self.window, q.device) & (
                True if keep is None else keep
            )
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=keep,
            is_causal=keep is None,
            dropout_p=dropout,
            scale=self.softmax_scale,
            enable_gqa=self.groups != self.heads,
        )

    def project(self, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return y

    def _attend_context_parallel(self, q, k, v, attention_mask, **attend_inputs):
        """This rank's two chunks of queries against the keys and values of every rank, gathered
        in sequence order (`attention_mask`: this rank's rows of it, every key)."""
        group = self.cp_group
        k, v = (gather_sequence(t, 2, group) for t in (k, v))
        attend_inputs = self.gather_inputs(**attend_inputs)
        chunk = q.shape[2] // 2
        outputs = []
        for slot, index in enumerate(chunk_ids(group.rank(), group.size())):
            start, end = index * chunk, (index + 1) * chunk
            rows = slice(slot * chunk, (slot + 1) * chunk)
            mask = None if attention_mask is None else attention_mask[..., rows, :end]
            outputs.append(
                self.attend_rows(
                    q[:, :, rows], k[:, :, :end], v[:, :, :end], mask, start, **attend_inputs
                )
            )
        return torch.cat(outputs, dim=2)

    def gather_inputs(self, **attend_inputs) -> dict:
        """What else `attend` needs of every token under context parallelism (Focus: the keys'
        routing)."""
        return attend_inputs

    def attend_rows(self, q, k, v, attention_mask, offset: int, **attend_inputs):
        """Queries at positions [offset, offset + nq) against keys [0, offset + nq)."""
        future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
        future = future.triu(offset + 1)  # Megatron's convention: True removes the pair
        removed = future if attention_mask is None else attention_mask | future
        return self.attend(q, k, v, removed, **attend_inputs)


def causal_window(queries: int, keys: int, left: int, device) -> torch.Tensor:
    """[queries, keys] True where the pair is kept: the last `queries` positions against all keys,
    key j visible to query i iff i - left <= j <= i."""
    distance = (
        torch.arange(keys - queries, keys, device=device)[:, None]
        - torch.arange(keys, device=device)[None, :]
    )
    return (distance >= 0) & (distance <= left)
