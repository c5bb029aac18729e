"""A token's groups: the one definition of "top-1 group" and "top-k groups" that Focus uses.

The hard rule keeps a distant pair when the key's top-1 group is among the query's top-k groups,
so every part of Focus that applies or counts that rule (the sparse dispatch, the masked rule,
the FlexAttention masks, the pairs-kept statistic, the HF model and its cache) must rank a
token's groups the same way. Exact ties are common: the causal Sinkhorn gives token 0 a uniform
assignment in every sequence (its prefix holds only itself), and duplicated centroids tie whole
columns. `torch.topk` orders tied entries differently for different k (and devices), so a
token's "top-1" could depend on which k asked. Here ties go to the lowest group index, by a
stable descending sort: the same order for every k, on every device.

The router ranks once per layer and forward; consumers read prefixes of that ranking.
"""

from typing import NamedTuple, Optional

import torch


def rank_groups(log_g: torch.Tensor) -> torch.Tensor:
    """[..., K] group indices by decreasing assignment, the lowest index first among equals."""
    return torch.sort(log_g, dim=-1, descending=True, stable=True).indices


def top1_onehot(groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[..., K] 1 at each token's top-1 group (int64), by a comparison: one_hot checks its
    input's range by reading it on the host (on the CPU), which would hide a real device
    synchronisation from the tests that look for one."""
    return (groups[..., :1] == torch.arange(num_groups, device=groups.device)).long()


class Routing(NamedTuple):
    """What a Focus layer's router hands its core attention."""

    log_g: torch.Tensor  # [b, n, K] log-assignments: the soft gate's g = exp(log_g)
    groups: torch.Tensor  # [b, n, K] rank_groups(log_g): groups[..., 0] is the top-1 group
    # [b, n] each token's document start (documents.py); None: the sequence is one document
    doc_start: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, log_g: torch.Tensor, doc_start: Optional[torch.Tensor] = None) -> "Routing":
        with torch.no_grad():
            return cls(log_g, rank_groups(log_g), doc_start)

    def top(self, top_k: int) -> torch.Tensor:
        """[b, n, top_k]: each token's top-k groups, top-1 first."""
        return self.groups[..., :top_k]
