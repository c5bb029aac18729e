"""Train/valid/test GPT datasets from `--data-path` and `--split`, as Megatron-LM builds them.

Everything here is Megatron-Core's GPTDataset and BlendedMegatronDatasetBuilder; the glue adds
checks that turn its silent failure modes into errors (see `_check_splits`), lets it run in
a single process without torch.distributed, and guards its index cache (`_guarded_cache`).
"""

import contextlib
import fcntl
import glob
import os
import re
import warnings
from typing import Optional, Sequence

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_focus.data.indexed import check_indexed_dataset
from megatron_focus.data.paths import check_blend_words

_SPLIT_RE = re.compile(r"\d+(\.\d*)?(,\d+(\.\d*)?){0,2}")


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def blend_of(data_path: list, flag: str = "--data-path") -> tuple[list, Optional[list]]:
    """Megatron's `--data-path` (or a per-split `flag`): prefixes (`p1 p2 ...`, sampled by size)
    or weighted pairs (`w1 p1 w2 p2 ...`), as (prefixes, weights or None); malformed weights
    refused by value."""
    if _number(data_path[0]) is None:
        check_blend_words(list(data_path), flag)
        return list(data_path), None
    if len(data_path) % 2:
        raise ValueError(
            f"{flag}: {len(data_path)} entries; a blend alternates weights and "
            "prefixes (w1 p1 w2 p2 ...), so it has an even number of them"
        )
    weights, prefixes = data_path[0::2], data_path[1::2]
    for weight in weights:
        if _number(weight) is None:
            raise ValueError(
                f"{flag} {weight}: not a number, where a blend weight goes (w1 p1 w2 p2 ...)"
            )
        if _number(weight) < 0:
            raise ValueError(f"{flag} {weight}: a blend weight cannot be negative")
    if not any(_number(w) for w in weights):
        raise ValueError(f"{flag}: every blend weight is 0")
    return list(prefixes), [_number(w) for w in weights]


def build_datasets(
    data_path: Optional[Sequence[str]],
    split: str,
    seq_length: int,
    seed: int,
    tokenizer: MegatronTokenizerBase,
    sizes: tuple[int, int, int],
    cache_dir: Optional[str],
    reset_position_ids: bool = False,
    eod_mask_loss: bool = False,
    reset_attention_mask: bool = False,
    per_split: Optional[Sequence[Optional[Sequence[str]]]] = None,
) -> tuple[Optional[GPTDataset], Optional[GPTDataset], Optional[GPTDataset]]:
    """`data_path` is one prefix, several prefixes, or `w1 p1 w2 p2 ...`, divided by `split`, or
    None for Megatron-Core's mock data (`--mock-data`: synthetic sequences, nothing read), unless
    `per_split` gives each split its own (`--train-data-path`, `--valid-data-path`,
    `--test-data-path`; a missing one: no such split); `sizes` are samples per split.
    `reset_position_ids` restarts positions after each end of document, `reset_attention_mask`
    gives each sample an `attention_mask` (True where a pair is removed: later positions and
    other documents) and `eod_mask_loss` leaves end-of-document tokens out of the loss
    (Megatron's flags).

    A split weighted 0 in `split` comes back as None. Each rank builds its own datasets; rank 0
    writes the index cache in `cache_dir` first (so it must be shared between ranks of a node).
    """
    if len(sizes) != 3 or any(s < 0 for s in sizes):
        raise ValueError(f"sizes {sizes}: expected three sample counts (train, valid, test) >= 0")
    if per_split is not None:
        blends = [
            blend_of(list(paths), f"--{name}-data-path") if paths else None
            for name, paths in zip(("train", "valid", "test"), per_split)
        ]
        blend, split = None, None
    else:
        if data_path is not None and not data_path:
            raise ValueError("--data-path is empty")
        if not _SPLIT_RE.fullmatch(split) or not any(float(w) for w in split.split(",")):
            raise ValueError(
                f"--split {split!r}: expected up to three comma-separated weights, e.g. 969,30,1"
            )
        blend, blends = blend_of(list(data_path)) if data_path is not None else None, None
    for prefix in [p for b in (blends or [blend]) if b for p in b[0]]:
        check_indexed_dataset(prefix, tokenizer.vocab_size)

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blends,
        split=split,
        path_to_cache=cache_dir,
        mmap_bin_files=True,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=reset_attention_mask,
    )
    if blend is None and blends is None:
        return _built(MockGPTDataset, sizes, config)
    if blend is not None:
        _check_splits(blend[0], config.split_matrix, split)
    with _guarded_cache(cache_dir):
        return _built(GPTDataset, sizes, config)


def _built(cls, sizes, config):
    with _process_group():
        train, valid, test = BlendedMegatronDatasetBuilder(
            cls, list(sizes), lambda: True, config
        ).build()
    return train, valid, test


@contextlib.contextmanager
def _guarded_cache(cache_dir: Optional[str]):
    """Megatron-Core (0.16.1) writes its index cache in place and trusts any file it finds there,
    reading it with pickle allowed: two jobs sharing a cache folder can read each other's
    half-written indices, a killed build leaves truncated ones that break every later run, and
    a crafted file runs code. The rank that builds (global rank 0, one per job) holds an
    exclusive lock on the folder while it checks the cached files and builds; a truncated or
    unreadable set is removed (rebuilt), one that needs pickle is refused."""
    builds = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if cache_dir is None or not builds:
        yield
        return
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        _check_cached_indices(cache_dir)
        yield


def _check_cached_indices(cache_dir: str) -> None:
    for path in sorted(glob.glob(os.path.join(cache_dir, "*.npy"))):
        problem = _npy_problem(path)
        if problem == "pickle":
            raise ValueError(
                f"index cache {path} holds pickled objects (Megatron-Core writes "
                "plain arrays): remove it if you trust nothing else there"
            )
        if problem is not None:
            warnings.warn(f"index cache {path} is damaged ({problem}): rebuilding its set")
            for sibling in glob.glob(path.rsplit("-", 1)[0] + "-*"):  # the set one dataset wrote
                os.remove(sibling)


def _npy_problem(path: str) -> Optional[str]:
    """None for a whole array of plain numbers; "pickle" for objects; else what is wrong."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(f)
            data_start = f.tell()
    except (ValueError, EOFError, OSError) as e:
        return f"unreadable header: {e}"
    if dtype.hasobject:
        return "pickle"
    expected = data_start + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = os.path.getsize(path)
    return None if actual == expected else f"{actual} bytes, {expected} expected"


def _check_splits(prefixes: list[str], split_matrix, split: str) -> None:
    # GPTDataset (0.16.1, _get_num_epochs) loops forever on a split with no tokens, even one asked
    # for 0 samples; tiny datasets hit this with the usual 969,30,1.
    for prefix in prefixes:
        dataset = IndexedDataset(
            prefix, mmap=True
        )  # keep alive: its __del__ unmaps sequence_lengths
        lengths = dataset.sequence_lengths
        for part, bounds in zip(Split, split_matrix):
            if bounds is None:
                continue
            beg, end = (int(round(b * len(lengths))) for b in bounds)
            if int(np.sum(lengths[beg:end])) == 0:
                raise ValueError(
                    f"--split {split} gives the {part.name} split none of the {len(lengths)} "
                    f"documents of {prefix}: use more data, or give that split more weight "
                    "or weight 0 (e.g. 98,2,0)"
                )


@contextlib.contextmanager
def _process_group():
    # On an index-cache miss, BlendedDataset (0.16.1) calls torch.distributed.get_rank() even when
    # no
    # process group exists. A lone process gets a private one-rank gloo group for the build.
    if torch.distributed.is_initialized():
        yield
        return
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
