"""How Megatron-Core lays a GPT model's tensors out over tensor-parallel ranks, and back.

A checkpoint holds one state dict per TP rank. Column-parallel weights (the fused QKV, MLP fc1,
the output layer) and the vocab-parallel embedding are split on dim 0, row-parallel weights
(attention projection, MLP fc2) on dim 1; norms, position embeddings, row-parallel biases and a
core attention's own parameters (Focus's routers, a variant's) are replicated. SwiGLU's fused
fc1 `[gate; up]` is split with stride 2: each rank holds `[gate_r; up_r]`. The embedding and
output layer have `padded_vocab_size` rows so that they split evenly; the rows past the
tokenizer's vocabulary are never used.

`merge` turns the per-rank state dicts into one full state dict with Megatron's names and the
true vocabulary; `split` is its inverse, for a given TP size.
"""

import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron_focus.parallel.tensor_parallel import merge_shards, split_tensor

StateDict = Dict[str, torch.Tensor]

# Which dim a tensor is split on (None: replicated). A name matching no pattern is an error, so a
# new parameter cannot be merged wrongly by default.
_SPLIT_DIM = (
    (r"embedding\.word_embeddings\.weight|output_layer\.weight", 0),
    (r".*\.linear_(qkv|fc1)\.(weight|bias)", 0),
    (r".*\.linear_(proj|fc2)\.weight", 1),
    (
        r"embedding\.position_embeddings\.weight|.*layernorm\.(weight|bias)"
        r"|.*\.linear_(proj|fc2)\.bias",
        None,
    ),
    # A core attention's own parameters (Focus's router, W_g and the centroids; a variant's, as
    # docs/extending.md asks): held whole by every TP rank, their gradient summed over TP, so
    # `merge` finds each identical on every rank, and refuses one that is not.
    (r".*\.self_attention\.core_attention\..*", None),
)
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
# Megatron's linear layers keep an `_extra_state` entry (None) that a strict load expects.
_EXTRA_STATE_OWNERS = re.compile(r".*\.linear_(qkv|proj|fc1|fc2)|output_layer")


def partitioning(name: str, swiglu: bool) -> Optional[Tuple[int, int]]:
    """`(dim, stride)` of a split tensor, or None for a replicated one."""
    for pattern, dim in _SPLIT_DIM:
        if re.fullmatch(pattern, name):
            if dim is None:
                return None
            return dim, 2 if swiglu and ".linear_fc1." in name else 1
    raise ValueError(f"{name}: unknown how Megatron splits this tensor over tensor-parallel ranks")


def merge(shards: List[StateDict], swiglu: bool, vocab_size: int) -> StateDict:
    """One state dict per TP rank -> the full model, vocabulary padding removed."""
    full = {}
    for name in shards[0]:
        if name.endswith("._extra_state"):
            continue
        tensors = [shard[name] for shard in shards]
        split = partitioning(name, swiglu)
        if split is None:
            for rank, tensor in enumerate(tensors[1:], 1):
                if not torch.equal(tensor, tensors[0]):
                    raise ValueError(f"{name} is replicated but differs on TP rank {rank}")
            full[name] = tensors[0]
        else:
            full[name] = merge_shards(tensors, *split)
        if name in _VOCAB:
            full[name] = full[name][:vocab_size]
    return full


def split(full: StateDict, tp: int, swiglu: bool, padded_vocab_size: int) -> List[StateDict]:
    """The full model -> one state dict per TP rank, exactly as Megatron's modules name them."""
    shards = [{} for _ in range(tp)]
    for name, tensor in full.items():
        if name in _VOCAB:
            padding = tensor.new_zeros(padded_vocab_size - tensor.shape[0], *tensor.shape[1:])
            tensor = torch.cat([tensor, padding])
        part = partitioning(name, swiglu)
        pieces = [tensor] * tp if part is None else split_tensor(tensor, tp, *part)
        for shard, piece in zip(shards, pieces):
            shard[name] = piece
        owner = name.rsplit(".", 1)[0]
        if _EXTRA_STATE_OWNERS.fullmatch(owner) and name.endswith(".weight"):
            for shard in shards:
                shard[f"{owner}._extra_state"] = None
    if "output_layer.weight" not in full:  # tied: Megatron's output layer still has its entry
        for shard in shards:
            shard["output_layer._extra_state"] = None
    return shards
