"""Tensor-by-tensor mapping between Megatron's names and layout and an HF model's.

A mapping is a list of `Rule`s, each one native tensor <-> one or more HF tensors with a pair of
inverse functions, so the same list converts in both directions and a round trip is exact by
construction. Conversion fails on any tensor no rule consumes: nothing is dropped silently.
"""

import dataclasses
from typing import Callable, Dict, List, Tuple

import torch
from tqdm import tqdm

from megatron_focus.model.config import ModelConfig

StateDict = Dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Rule:
    native: str
    hf: Tuple[str, ...]
    to_hf: Callable[[torch.Tensor], Tuple[torch.Tensor, ...]]
    to_native: Callable[..., torch.Tensor]


def copy(native: str, hf: str) -> Rule:
    return Rule(native, (hf,), lambda t: (t,), lambda t: t)


def transposed(native: str, hf: str) -> Rule:
    """GPT-2's Conv1D keeps weights as `[in, out]`; its biases are as Megatron's."""
    flip = lambda t: t.t().contiguous() if t.ndim == 2 else t  # noqa: E731
    return Rule(native, (hf,), lambda t: (flip(t),), flip)


def zero_bias(native: str, size: int) -> Rule:
    """A bias Megatron has (`add_bias_linear` is all or nothing) and the HF model lacks: zero."""

    def to_hf(t):
        if t.any():
            raise ValueError(f"{native} is not zero, and the HF model has no such bias")
        return ()

    return Rule(native, (), to_hf, lambda: torch.zeros(size))


def split_qkv(fused: torch.Tensor, arch: ModelConfig) -> Tuple[torch.Tensor, ...]:
    """Megatron's fused QKV rows, per query group `[its query heads..., key, value]` -> q, k, v."""
    groups, per_group = arch.num_query_groups, arch.num_attention_heads // arch.num_query_groups
    grouped = fused.reshape(groups, per_group + 2, arch.kv_channels, *fused.shape[1:])
    rest = fused.shape[1:]
    return (
        grouped[:, :per_group].reshape(-1, *rest),
        grouped[:, per_group].reshape(-1, *rest),
        grouped[:, per_group + 1].reshape(-1, *rest),
    )


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelConfig) -> torch.Tensor:
    groups, hn = arch.num_query_groups, arch.kv_channels
    rest = q.shape[1:]
    parts = [
        q.reshape(groups, -1, hn, *rest),
        k.reshape(groups, 1, hn, *rest),
        v.reshape(groups, 1, hn, *rest),
    ]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def native_to_hf(state: StateDict, rules: List[Rule], progress: bool = True) -> StateDict:
    left, out = dict(state), {}
    for rule in tqdm(rules, desc="mapping to HF", disable=not progress):
        if rule.native not in left:
            raise KeyError(f"the checkpoint has no {rule.native}")
        out.update(zip(rule.hf, rule.to_hf(left.pop(rule.native))))
    if left:
        raise ValueError(f"no HF counterpart for {', '.join(sorted(left))}")
    return out


def hf_to_native(state: StateDict, rules: List[Rule], progress: bool = True) -> StateDict:
    left, out = dict(state), {}
    for rule in tqdm(rules, desc="mapping to Megatron", disable=not progress):
        missing = [name for name in rule.hf if name not in left]
        if missing:
            raise KeyError(f"the HF model has no {', '.join(missing)}")
        out[rule.native] = rule.to_native(*(left.pop(name) for name in rule.hf))
    if left:
        raise ValueError(f"no Megatron counterpart for {', '.join(sorted(left))}")
    return out
