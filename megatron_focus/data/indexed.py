"""Validate a Megatron `.bin/.idx` pair before training on it.

IndexedDataset fails on bad files with bare asserts or numpy buffer errors, and a tokenizer
that does not match the data fails much later as an embedding index error on some rank. This
turns both into one clear message naming the file.
"""

import os
import struct

import numpy as np
from megatron.core.datasets.indexed_dataset import (
    _INDEX_HEADER,
    IndexedDataset,
    get_bin_path,
    get_idx_path,
)

from megatron_focus.data.paths import check_data_prefix

SCAN_CHUNK_TOKENS = 1 << 24
_HEADER = struct.Struct(f"<{len(_INDEX_HEADER)}sQBQQ")


def check_indexed_dataset(prefix: str, vocab_size: int) -> None:
    """Raise FileNotFoundError/ValueError unless `prefix` is a complete dataset within
    `vocab_size`."""
    bin_path, idx_path = get_bin_path(prefix), get_idx_path(prefix)
    check_data_prefix(prefix)
    if os.path.getsize(bin_path) == 0:
        raise ValueError(f"{bin_path} is empty: the dataset has no tokens")
    _check_idx_size(idx_path)
    try:
        dataset = IndexedDataset(prefix, mmap=True)
    except (AssertionError, ValueError) as e:
        raise ValueError(
            f"{idx_path} is corrupt ({e or type(e).__name__}); rerun tools/preprocess_data.py"
        ) from e

    index = dataset.index  # only valid while `dataset` lives: its __del__ unmaps the index
    itemsize = np.dtype(index.dtype).itemsize
    expected = (
        int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * itemsize
        if len(index)
        else 0
    )
    actual = os.path.getsize(bin_path)
    if actual != expected:
        raise ValueError(
            f"{bin_path} has {actual} bytes but {idx_path} describes {expected} "
            f"({expected // itemsize} {np.dtype(index.dtype).name} tokens): the pair is truncated "
            "or mismatched; rerun tools/preprocess_data.py"
        )

    largest = _largest_token_id(bin_path, index.dtype)
    if largest >= vocab_size:
        raise ValueError(
            f"tokenizer vocabulary {vocab_size} is smaller than the data's largest token id "
            f"{largest} in {bin_path}: wrong --tokenizer-model for this --data-path?"
        )


def _check_idx_size(idx_path: str) -> None:
    # Header: magic, version u64, dtype code u8, sequence count u64, document count u64; then
    # int32 lengths and int64 pointers per sequence, and int64 document boundaries.
    with open(idx_path, "rb") as f:
        header = f.read(_HEADER.size)
    if len(header) < _HEADER.size or not header.startswith(_INDEX_HEADER):
        raise ValueError(
            f"{idx_path} is truncated or not a Megatron index (bad header); rerun "
            "tools/preprocess_data.py"
        )
    _, _, _, sequences, documents = _HEADER.unpack(header)
    expected = _HEADER.size + sequences * (4 + 8) + documents * 8
    actual = os.path.getsize(idx_path)
    if actual != expected:
        raise ValueError(
            f"{idx_path} is truncated or corrupt: {actual} bytes, its header describes {expected} "
            f"({sequences} sequences, {documents - 1} documents); rerun tools/preprocess_data.py"
        )


def _largest_token_id(bin_path: str, dtype) -> int:
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    return max(
        int(tokens[i : i + SCAN_CHUNK_TOKENS].max())
        for i in range(0, len(tokens), SCAN_CHUNK_TOKENS)
    )
