"""Reading checkpoint files without running code: tensors, containers, DeepSpeed's records and
the argparse record of a Megatron-LM checkpoint's args.

`torch.load` unpickles, and a pickle can run any code as it loads; a checkpoint downloaded or
shared is read here with `weights_only`, which admits tensors and plain containers, plus the few
record classes DeepSpeed pickles into its files, allowed by name.
"""

import argparse
import os
import pickle
import re

import torch


def _deepspeed_records() -> list:
    """The classes DeepSpeed pickles into its checkpoint files besides tensors (loss scalers, the
    ZeRO stage, fragment addresses), and the Namespace of a torch_dist checkpoint's args: plain
    records, allowed by name so that nothing else in a
    file can run code as it loads."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, argparse.Namespace]


def load_file(path: str, allow_unsafe: bool = False, mmap: bool = False):
    """`torch.load` of a checkpoint file: tensors, containers and `_deepspeed_records` only,
    unless `allow_unsafe` (`--allow-unsafe-checkpoints`)."""
    if allow_unsafe:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=False)
    # Only what is not allowed already: leaving the context disallows what it allowed, and
    # Megatron-Core allows its own records (the Namespace among them) process-wide.
    allowed = torch.serialization.get_safe_globals()
    try:
        with torch.serialization.safe_globals(
            [r for r in _deepspeed_records() if r not in allowed]
        ):
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        named = re.search(r"Unsupported global: GLOBAL ([\w.]+)|got <class '([\w.]+)'>", str(e))
        what = f" ({named.group(1) or named.group(2)})" if named else ""
        raise ValueError(
            f"{path} holds pickled objects that could run code as it loads{what}; "
            "if you trust its source, pass --allow-unsafe-checkpoints"
        ) from None


def check_safe_to_load(checkpoint_dir: str, allow_unsafe: bool) -> None:
    """Every `.pt` file of a checkpoint that DeepSpeed will read itself (with pickle allowed),
    read first as `load_file` reads it; memory-mapped, so the tensors are not read twice."""
    if allow_unsafe:
        return
    for name in sorted(os.listdir(checkpoint_dir)):
        if name.endswith(".pt"):
            load_file(os.path.join(checkpoint_dir, name), mmap=True)
