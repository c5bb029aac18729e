"""Tokenize documents into Megatron `<prefix>_<key>_document.bin/.idx` pairs.

Same output and flags as Megatron-LM's tools/preprocess_data.py, plus what bit its users:
empty documents are skipped (not written as zero-length documents), and outputs are written
under temporary names and renamed at the end, so an interrupted run leaves nothing that looks valid.
"""

import glob
import multiprocessing
import os
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from tqdm import tqdm

from megatron_focus.data.readers import expand_inputs, iter_records
from megatron_focus.data.tokenizer import build_tokenizer

_worker = {}  # per-process tokenizer state, set by _init_worker


@dataclass
class PreprocessStats:
    docs: int = 0  # documents written, summed over keys
    empty_skipped: int = 0  # documents with no text or no tokens, summed over keys
    tokens: int = 0  # tokens written, EODs included
    prefixes: list[str] = field(default_factory=list)  # one `<prefix>_<key>_document` per key


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def _init_worker(tokenizer_type: str, files: dict, append_eod: bool) -> None:
    tokenizer = build_tokenizer(tokenizer_type, **files)
    _worker.update(
        tokenizer=tokenizer, append_eod=append_eod, dtype=DType.optimal_dtype(tokenizer.vocab_size)
    )


def _encode(texts: tuple[str, ...]) -> list[np.ndarray]:
    tokenizer = _worker["tokenizer"]
    encoded = []
    for text in texts:
        ids = tokenizer.tokenize(text) if text else []
        if ids and _worker["append_eod"]:
            ids.append(tokenizer.eod)
        encoded.append(np.asarray(ids, dtype=_worker["dtype"]))
    return encoded


def _remove_stale_partials(prefix: str) -> None:
    """Remove what a killed run left (`PREFIX.tmpPID.bin/.idx` of a process that is gone)."""
    for path in glob.glob(glob.escape(prefix) + ".tmp*"):
        pid = re.fullmatch(r"\.tmp(\d+)\.(bin|idx)", path[len(prefix) :])
        if pid is None:
            continue
        try:
            os.kill(int(pid.group(1)), 0)  # still running: another preprocessing run's file
        except ProcessLookupError:
            print(f"removing {path}, left by an interrupted run", flush=True)
            os.remove(path)
        except PermissionError:
            pass


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer_type: str,
    tokenizer_model: Optional[str] = None,
    *,
    append_eod: bool,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    vocab_size: Optional[int] = None,
    json_keys: Sequence[str] = ("text",),
    workers: int = 1,
    log_interval: int = 1000,
) -> PreprocessStats:
    """Tokenize `inputs` (paths or globs) into one indexed dataset per json key; the tokenizer as
    `build_tokenizer` takes it."""
    if workers < 1 or log_interval < 1:
        raise ValueError(f"--workers ({workers}) and --log-interval ({log_interval}) must be >= 1")
    paths = expand_inputs(inputs, json_keys)
    files = {
        "tokenizer_model": tokenizer_model,
        "vocab_file": vocab_file,
        "merge_file": merge_file,
        "vocab_size": vocab_size,
    }
    dtype = DType.optimal_dtype(build_tokenizer(tokenizer_type, **files).vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)

    stats = PreprocessStats(prefixes=[output_prefix_for(output_prefix, key) for key in json_keys])
    for prefix in stats.prefixes:
        _remove_stale_partials(prefix)
    tmp_prefixes = [f"{prefix}.tmp{os.getpid()}" for prefix in stats.prefixes]
    init_args = (tokenizer_type, files, append_eod)
    builders, pool = [], None
    try:
        builders += [IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype) for tmp in tmp_prefixes]
        if workers > 1:
            pool = multiprocessing.Pool(workers, _init_worker, init_args)
        else:
            _init_worker(*init_args)
        records = iter_records(paths, json_keys)
        encoded = pool.imap(_encode, records, chunksize=64) if pool else map(_encode, records)
        with tqdm(
            encoded, desc=f"tokenizing {len(paths)} file(s)", unit=" docs", miniters=log_interval
        ) as bar:
            for n, doc in enumerate(bar, start=1):
                for builder, ids in zip(builders, doc):
                    if ids.size == 0:
                        stats.empty_skipped += 1
                        continue
                    builder.add_document(ids, [ids.size])
                    stats.docs += 1
                    stats.tokens += ids.size
                if n % log_interval == 0:
                    bar.set_postfix(tokens=stats.tokens, empty=stats.empty_skipped, refresh=False)
        if stats.docs == 0:
            raise ValueError(
                f"no non-empty documents in {', '.join(paths)} ({stats.empty_skipped} empty): "
                "nothing to write"
            )
        for builder, tmp, prefix in zip(builders, tmp_prefixes, stats.prefixes):
            builder.finalize(f"{tmp}.idx")
            os.replace(f"{tmp}.bin", f"{prefix}.bin")
            os.replace(
                f"{tmp}.idx", f"{prefix}.idx"
            )  # last: a .bin without its .idx is not a dataset
    finally:
        if pool is not None:
            pool.terminate()
        for builder, tmp in zip(builders, tmp_prefixes):
            builder.data_file.close()
            for suffix in (".bin", ".idx"):
                if os.path.exists(tmp + suffix):
                    os.remove(tmp + suffix)
    return stats
