"""Megatron-Core's distributed checkpoint format (`--ckpt-format torch_dist`), as Megatron-LM's
`save_checkpoint` writes it, so that a run continues in Megatron-LM and a Megatron-LM checkpoint
starts a run here.

A tag folder (`iter_XXXXXXX`) in this format is `dist_checkpointing.save` of Megatron-LM's state:
'model' (the model's `sharded_state_dict()`: tensor-parallel weights sharded along their split
axis, the rest replicated, so any TP size reads them), 'args' (Megatron-LM's record of the run),
'checkpoint_version', 'iteration', 'num_floating_point_operations_so_far', 'opt_param_scheduler'
(counted in samples, as Megatron-LM counts) and, with a GPU, 'rng_state'; the folder's pointer is
`latest_checkpointed_iteration.txt`.

The optimizer state is not in that part: this trainer's own checkpoint (DeepSpeed's files, with
the optimizer, `checkpoint/format.py`) is written into the same folder, and a resume here reads
it exactly. Megatron-LM reads the folder with `--no-load-optim`, its optimizer and schedule
starting afresh from the weights; the args record `no_save_optim` (and, from a CPU run, whose
generator states a GPU cannot take, `no_save_rng`), which Megatron-LM's load honours.
"""

import argparse
import json
import os
import random
from typing import Callable

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CONFIG_FNAME
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

from megatron_focus import platform
from megatron_focus.checkpoint import format as checkpoint_format
from megatron_focus.checkpoint import megatron_lm_args
from megatron_focus.checkpoint.safe_load import load_file
from megatron_focus.config.run_config import RunConfig

# Megatron-LM's version of checkpoints of Megatron-Core models (`generate_state_dict`).
CHECKPOINT_VERSION = 3.0
# Megatron-LM's sharded state dict metadata for a model without a distributed optimizer
# (`_build_sharded_state_dict_metadata`), also saved as the checkpoint's content metadata.
METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def is_torch_dist(folder: str) -> bool:
    """Whether `folder` holds a distributed checkpoint (Megatron-Core's `metadata.json`)."""
    return os.path.isfile(os.path.join(folder, CONFIG_FNAME))


def check_readable(folder: str) -> None:
    """Refuse, naming the file, a distributed checkpoint whose records cannot be read."""
    config = os.path.join(folder, CONFIG_FNAME)
    try:
        with open(config) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{config} is not a distributed checkpoint's record ({e})") from None
    if backend != "torch_dist":
        raise ValueError(f"{config}: backend {backend!r}; only torch_dist checkpoints load here")
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise FileNotFoundError(f"{os.path.join(folder, '.metadata')} is missing: not complete")


def common_state(folder: str, allow_unsafe: bool) -> dict:
    """The non-tensor part ('args', 'iteration', 'opt_param_scheduler' ...), read without
    running code unless `allow_unsafe` (Megatron-LM's args may pickle its own classes).

    Megatron-Core up to 0.18 writes it as `common.pt`; 0.19 as one object among the tensors,
    which its reader unpickles with torch's weights-only loader."""
    check_readable(folder)
    if os.path.isfile(os.path.join(folder, COMMON_STATE_FNAME)):
        return load_file(os.path.join(folder, COMMON_STATE_FNAME), allow_unsafe)
    try:
        return dist_checkpointing.load_common_state_dict(folder)
    except Exception as e:  # torch's reader raises its own types on a damaged file
        raise ValueError(
            f"{folder}: the checkpoint's common state (args, iteration) cannot be read ({e})"
        ) from None


def megatron_args(config: RunConfig, padded_vocab_size: int, consumed: int):
    """The 'args' record Megatron-LM checks and resumes from: this run's flags (Megatron's
    names), the model's fields as Megatron-LM names and derives them, and what it counts."""
    plain = (bool, int, float, str, type(None))
    record = {
        k: v
        for k, v in config.flags().items()
        if isinstance(v, plain)
        or (isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v))
    }
    tp = parallel_state.get_tensor_model_parallel_world_size()
    world = torch.distributed.get_world_size()
    record.update(
        ckpt_format="torch_dist",
        **megatron_lm_args.record(config),
        padded_vocab_size=padded_vocab_size,
        consumed_train_samples=consumed,
        skipped_train_samples=0,
        consumed_valid_samples=0,
        world_size=world,
        pipeline_model_parallel_size=1,
        data_parallel_size=world // tp,
        no_save_optim=True,  # the optimizer state is DeepSpeed's, beside this part
        no_save_rng=config.no_save_rng or not platform.has_cuda(),
    )
    return argparse.Namespace(**record)


def _rng_state() -> ShardedObject:
    """Megatron-LM's RNG record: one per tensor-parallel rank, replicated over data parallel."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }
    ps = parallel_state
    return ShardedObject(
        "rng_state",
        [state],
        (1, ps.get_tensor_model_parallel_world_size()),
        (0, ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )


def save(
    model: torch.nn.Module,
    folder: str,
    args_record: argparse.Namespace,
    iteration: int,
    schedule: dict,
    flops: float = 0.0,
) -> None:
    """Collective: write Megatron-LM's state into the empty `folder` (`metadata.json`, which
    marks it complete, last); `schedule` is Megatron-LM's (`megatron_schedule`)."""
    state = {
        "model": model.sharded_state_dict(metadata=dict(METADATA)),
        "args": args_record,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "num_floating_point_operations_so_far": flops,
        "opt_param_scheduler": schedule,
    }
    if not args_record.no_save_rng:
        state["rng_state"] = _rng_state()
    dist_checkpointing.save(state, folder, content_metadata=dict(METADATA))


def _shards(entry) -> list:
    """The ShardedTensors / ShardedObjects one entry of a sharded state dict stands for."""
    if isinstance(entry, ShardedTensorFactory):
        return _flat(entry.build())
    return [entry]


def _flat(tree) -> list:
    if isinstance(tree, dict):
        return [s for v in tree.values() for s in _flat(v)]
    if isinstance(tree, (list, tuple)):
        return [s for v in tree for s in _flat(v)]
    return _shards(tree)


def _misfits(shards: dict, saved: dict) -> list:
    """What of `shards` (each entry's of a sharded state dict) the checkpoint's tensors `saved`
    lack or hold at another global shape, by checkpoint key (ShardedObjects, the linears' empty
    `_extra_state`, are not read)."""
    found = []
    for entry_shards in shards.values():
        for shard in entry_shards:
            if not isinstance(shard, ShardedTensor):
                continue
            held = saved.get(shard.key)
            if held is None:
                found.append(f"{shard.key} is missing")
            elif tuple(held.global_shape) != tuple(shard.global_shape):
                found.append(
                    f"{shard.key}: checkpoint {tuple(held.global_shape)}, "
                    f"this model {tuple(shard.global_shape)}"
                )
    return sorted(set(found))


def fresh_weights(
    model: torch.nn.Module, folder: str, may_miss: Callable[[str], bool] = lambda name: False
) -> list:
    """The weights of `model` the distributed checkpoint `folder` does not hold, each excused by
    `may_miss(name)` (e.g. new routers: they start as initialised); refused, naming the weights,
    if one is missing unexcused or held at another shape. Reads the checkpoint's metadata only."""
    _, shards, saved = _fitted(model, folder, may_miss)
    return sorted(
        name
        for name, entry_shards in shards.items()
        if any(isinstance(s, ShardedTensor) and s.key not in saved for s in entry_shards)
    )


def _fitted(model: torch.nn.Module, folder: str, may_miss: Callable[[str], bool]) -> tuple:
    """(the model's sharded state dict, its entries' shards, the checkpoint's tensors'
    metadata), refused as `fresh_weights` says."""
    check_readable(folder)
    try:
        saved = dist_checkpointing.load_tensors_metadata(folder)
    except Exception as e:  # torch's reader raises its own types on a damaged .metadata
        raise ValueError(f"{folder}: the checkpoint's metadata cannot be read ({e})") from None
    ours = model.sharded_state_dict(metadata=dict(METADATA))
    shards = {name: _shards(entry) for name, entry in ours.items()}
    misfits = _misfits({n: s for n, s in shards.items() if not may_miss(n)}, saved)
    if misfits:
        raise ValueError(f"{folder} does not fit this model: " + "; ".join(misfits))
    return ours, shards, saved


def load_model(
    model: torch.nn.Module, folder: str, may_miss: Callable[[str], bool] = lambda name: False
) -> None:
    """Collective: the model's weights from the distributed checkpoint `folder`, at this run's
    tensor-parallel size whatever the checkpoint's; refused as `fresh_weights` refuses, before any
    is read."""
    ours, shards, saved = _fitted(model, folder, may_miss)
    wanted = {
        name: ours[name]
        for name, entry_shards in shards.items()
        if all(shard.key in saved for shard in entry_shards)
    }
    loaded = dist_checkpointing.load({"model": wanted}, folder)["model"]
    result = model.load_state_dict(loaded, strict=False)
    left = [k for k in result.missing_keys if not may_miss(k) and not k.endswith("_extra_state")]
    if left or result.unexpected_keys:
        raise ValueError(
            f"{folder} does not fit this model: missing {left}, unexpected {result.unexpected_keys}"
        )


def is_megatron_lm(checkpoint: str) -> bool:
    """A distributed checkpoint without DeepSpeed's files: Megatron-LM's (its model, and no
    optimizer state this trainer reads)."""
    return is_torch_dist(checkpoint) and not (
        checkpoint_format.model_files(checkpoint) or checkpoint_format.is_zero3(checkpoint)
    )
