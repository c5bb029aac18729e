"""How a GPT model's tensors lie over tensor-parallel ranks, and back.

A checkpoint holds one state dict per TP rank. How each parameter is split is declared where it
is created, by Megatron-Core's marks on the parameter (`tensor_model_parallel`, `partition_dim`,
`partition_stride`: its linear layers and vocab-parallel embedding set them; a variant's core
attention sets them on a parameter of its own that is split, e.g. one value per head, with
`megatron.core.tensor_parallel.set_tensor_model_parallel_attributes`); an unmarked parameter is
replicated. `split_of` reads the marks, `declared_splits` reads them off the model a run config
describes, built on the meta device (no memory, no weights): one source for training (DeepSpeed's
universal checkpoint info, `training/layouts.py`), the checkpoint tools and the HF conversion.
SwiGLU's fused fc1 `[gate; up]` is split with stride 2: each rank holds `[gate_r; up_r]`. The
embedding and output layer have `padded_vocab_size` rows so that they split evenly; the rows past
the tokenizer's vocabulary are never used.

`merge` turns the per-rank state dicts into one full state dict with Megatron's names and the
true vocabulary; `split` is its inverse, for a given TP size.
"""

import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron_focus.model.config import ModelConfig
from megatron_focus.parallel.tensor_parallel import merge_shards, split_tensor

StateDict = Dict[str, torch.Tensor]
Split = Optional[Tuple[int, int]]  # (dim, stride) of a split tensor; None: replicated

_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
# Megatron's linear layers keep an `_extra_state` entry (None) that a strict load expects.
_EXTRA_STATE_OWNERS = re.compile(r".*\.linear_(qkv|proj|fc1|fc2)|output_layer")


def split_of(param: torch.Tensor) -> Split:
    """How a parameter is split over TP ranks, as its Megatron-Core marks declare."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return param.partition_dim, getattr(param, "partition_stride", 1)


def declared_splits(model: ModelConfig) -> Dict[str, Split]:
    """{name: split} of every parameter of the model `model` describes, read off that model built
    on the meta device at TP 1 (the marks are the same at every size), in this process's
    parallel state or a world of one."""
    from megatron_focus import platform
    from megatron_focus.model.gpt import build

    with platform.world_of_one(), torch.device("meta"):
        built = build(model, 1)
    return {name: split_of(param) for name, param in built.named_parameters()}


def _split(splits: Dict[str, Split], name: str) -> Split:
    if name not in splits:
        raise ValueError(f"{name}: no such parameter in the model the checkpoint records")
    return splits[name]


def merge(
    shards: List[StateDict], splits: Optional[Dict[str, Split]], vocab_size: int
) -> StateDict:
    """One state dict per TP rank -> the full model, vocabulary padding removed (`splits`:
    `declared_splits`; None for one rank's, which has nothing to merge)."""
    full = {}
    for name in shards[0]:
        if name.endswith("._extra_state"):
            continue
        tensors = [shard[name] for shard in shards]
        split = None if len(shards) == 1 else _split(splits, name)
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


def split(
    full: StateDict, tp: int, splits: Optional[Dict[str, Split]], padded_vocab_size: int
) -> List[StateDict]:
    """The full model -> one state dict per TP rank, exactly as Megatron's modules name them
    (`splits`: `declared_splits`; None for one rank)."""
    shards = [{} for _ in range(tp)]
    for name, tensor in full.items():
        if name in _VOCAB:
            padding = tensor.new_zeros(padded_vocab_size - tensor.shape[0], *tensor.shape[1:])
            tensor = torch.cat([tensor, padding])
        part = None if tp == 1 else _split(splits, name)
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
