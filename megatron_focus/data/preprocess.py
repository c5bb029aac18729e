"""Tokenize documents into Megatron `<prefix>_<key>_document.bin/.idx` pairs.

Same output and flags as Megatron-LM's tools/preprocess_data.py (its document order for
`--partitions`, its sentence-level `<prefix>_<key>_sentence` datasets for `--split-sentences`),
plus what bit its users: empty documents are skipped (not written as zero-length documents),
sentence splitting and tokenizing are one run (Megatron-LM's first run only splits), and outputs
are written under temporary names and renamed at the end, so an interrupted run leaves nothing
that looks valid.
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
SPLIT_CHARS = 1_000_000  # the sentence splitter reads a document in pieces this long (Megatron-LM)


@dataclass
class PreprocessStats:
    docs: int = 0  # documents written, summed over keys
    empty_skipped: int = 0  # documents with no text or no tokens, summed over keys
    tokens: int = 0  # tokens written, EODs included
    prefixes: list[str] = field(default_factory=list)  # one `<prefix>_<key>_document` per key


def output_prefix_for(output_prefix: str, key: str, level: str = "document") -> str:
    return f"{output_prefix}_{key}_{level}"


def sentence_splitter(lang: str = "english", keep_newlines: bool = False):
    """NLTK's punkt sentence splitter for `lang`, as Megatron-LM's --split-sentences builds it
    (with --keep-newlines, a sentence keeps the whitespace after it); punkt's data is downloaded
    if missing, as Megatron-LM does. Refused by flag without NLTK or its data."""
    try:
        import nltk
        from nltk.tokenize import punkt
    except ImportError:
        raise ValueError(
            "--split-sentences: splits with NLTK's punkt, and NLTK is not installed "
            "(pip install nltk)"
        ) from None
    # NLTK 3.8.2 and later read punkt's parameters from its punkt_tab tables (no pickles)
    package = "punkt_tab" if hasattr(punkt, "PunktTokenizer") else "punkt"

    def parameters():
        if package == "punkt_tab":
            return punkt.PunktTokenizer(lang)._params
        return nltk.data.load(f"tokenizers/punkt/{lang}.pickle")._params

    try:
        params = parameters()
    except LookupError:
        nltk.download(package, quiet=True, download_dir=os.environ.get("NLTK_DATA"))
        try:
            params = parameters()
        except LookupError:
            raise ValueError(
                f"--split-sentences --lang {lang}: NLTK's {package} data for {lang} is neither "
                f"installed nor downloadable here; install it with python -m nltk.downloader "
                f"{package} (NLTK_DATA names the folder)"
            ) from None
    return punkt_splitter(params, keep_newlines)


def punkt_splitter(params, keep_newlines: bool):
    """A punkt splitter with `params`; with `keep_newlines`, Megatron-LM's change to punkt's
    sentence-end pattern: the whitespace after a sentence end belongs to that sentence."""
    from nltk.tokenize import punkt

    class KeepWhitespace(punkt.PunktLanguageVars):
        _period_context_fmt = (
            r"\S*%(SentEndChars)s\s*(?=(?P<after_tok>%(NonWord)s|(?P<next_tok>\S+)))"
        )

    lang_vars = KeepWhitespace() if keep_newlines else punkt.PunktLanguageVars()
    return punkt.PunktSentenceTokenizer(params, lang_vars=lang_vars)


def _init_worker(
    tokenizer_type: str, files: dict, append_eod: bool, split: Optional[tuple] = None
) -> None:
    """`split`: sentence_splitter's arguments (--split-sentences), or None."""
    tokenizer = build_tokenizer(tokenizer_type, **files)
    _worker.update(
        tokenizer=tokenizer,
        append_eod=append_eod,
        dtype=DType.optimal_dtype(tokenizer.vocab_size),
        splitter=sentence_splitter(*split) if split else None,
    )


def _encode(texts: tuple[str, ...]) -> list[tuple[np.ndarray, list[int]]]:
    """Per text: its ids, and the lengths of its sequences (one per non-empty sentence with
    --split-sentences, else one), the EOD counted in the last."""
    tokenizer, splitter = _worker["tokenizer"], _worker["splitter"]
    encoded = []
    for text in texts:
        if splitter is None:
            pieces = [text]
        else:
            pieces = [
                sentence
                for start in range(0, len(text), SPLIT_CHARS)
                for sentence in splitter.tokenize(text[start : start + SPLIT_CHARS])
            ]
        ids, lengths = [], []
        for piece in pieces:
            piece_ids = tokenizer.tokenize(piece) if piece else []
            if piece_ids:
                ids += piece_ids
                lengths.append(len(piece_ids))
        if ids and _worker["append_eod"]:
            ids.append(tokenizer.eod)
            lengths[-1] += 1
        encoded.append((np.asarray(ids, dtype=_worker["dtype"]), lengths))
    return encoded


def _remove_stale_partials(prefix: str) -> None:
    """Remove what a killed run left (`PREFIX.tmpPID.bin/.idx` of a process that is gone)."""
    for path in glob.glob(glob.escape(prefix) + ".tmp*"):
        pid = re.fullmatch(r"\.tmp(\d+)(\.part\d+)?\.(bin|idx)", path[len(prefix) :])
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
    partitions: int = 1,
    keep_sequential_samples: bool = False,
    split_sentences: bool = False,
    keep_newlines: bool = False,
    lang: str = "english",
) -> PreprocessStats:
    """Tokenize `inputs` (paths or globs) into one indexed dataset per json key; the tokenizer as
    `build_tokenizer` takes it.

    `partitions`: the documents in the order Megatron-LM's `--partitions N` writes them: document
    k (counted over all inputs) goes to partition k mod N, and the partitions follow one another;
    with `keep_sequential_samples`, its partitions are consecutive runs: the input's order.
    `split_sentences`: each sentence (sentence_splitter(lang, keep_newlines)) is a sequence of
    its document, in `<prefix>_<key>_sentence.bin/.idx`."""
    if workers < 1 or log_interval < 1 or partitions < 1:
        raise ValueError(
            f"--workers ({workers}), --log-interval ({log_interval}) and --partitions "
            f"({partitions}) must be >= 1"
        )
    split = (lang, keep_newlines) if split_sentences else None
    if split:
        sentence_splitter(*split)  # no NLTK or no punkt data: refused before any work
    paths = expand_inputs(inputs, json_keys)
    files = {
        "tokenizer_model": tokenizer_model,
        "vocab_file": vocab_file,
        "merge_file": merge_file,
        "vocab_size": vocab_size,
    }
    dtype = DType.optimal_dtype(build_tokenizer(tokenizer_type, **files).vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)

    level = "sentence" if split_sentences else "document"
    stats = PreprocessStats(
        prefixes=[output_prefix_for(output_prefix, key, level) for key in json_keys]
    )
    for prefix in stats.prefixes:
        _remove_stale_partials(prefix)
    tmp_prefixes = [f"{prefix}.tmp{os.getpid()}" for prefix in stats.prefixes]
    parts = 1 if keep_sequential_samples else partitions  # consecutive runs: one partition
    # per key, one builder per partition; several are merged at the end, as Megatron-LM merges
    part_prefixes = [
        [f"{tmp}.part{p}" for p in range(parts)] if parts > 1 else [tmp] for tmp in tmp_prefixes
    ]
    init_args = (tokenizer_type, files, append_eod, split)
    builders, opened, pool = [], [], None
    try:
        for prefixes in part_prefixes:
            builders.append([IndexedDatasetBuilder(f"{p}.bin", dtype=dtype) for p in prefixes])
            opened += builders[-1]
        if workers > 1:
            pool = multiprocessing.Pool(workers, _init_worker, init_args)
        else:
            _init_worker(*init_args)
        records = iter_records(paths, json_keys)
        encoded = pool.imap(_encode, records, chunksize=64) if pool else map(_encode, records)
        with tqdm(
            encoded, desc=f"tokenizing {len(paths)} file(s)", unit=" docs", miniters=log_interval
        ) as bar:
            for n, doc in enumerate(bar):
                for key_builders, (ids, lengths) in zip(builders, doc):
                    if ids.size == 0:
                        stats.empty_skipped += 1
                        continue
                    key_builders[n % parts].add_document(ids, lengths)
                    stats.docs += 1
                    stats.tokens += ids.size
                if (n + 1) % log_interval == 0:
                    bar.set_postfix(tokens=stats.tokens, empty=stats.empty_skipped, refresh=False)
        if stats.docs == 0:
            raise ValueError(
                f"no non-empty documents in {', '.join(paths)} ({stats.empty_skipped} empty): "
                "nothing to write"
            )
        for key_builders, prefixes, tmp, prefix in zip(
            builders, part_prefixes, tmp_prefixes, stats.prefixes
        ):
            for builder, part in zip(key_builders, prefixes):
                builder.finalize(f"{part}.idx")
            if parts > 1:
                merged = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
                opened.append(merged)
                for part in prefixes:
                    merged.add_index(part)
                merged.finalize(f"{tmp}.idx")
            os.replace(f"{tmp}.bin", f"{prefix}.bin")
            os.replace(
                f"{tmp}.idx", f"{prefix}.idx"
            )  # last: a .bin without its .idx is not a dataset
    finally:
        if pool is not None:
            pool.terminate()
        for builder in opened:
            builder.data_file.close()
        for tmp, prefixes in zip(tmp_prefixes, part_prefixes):
            for path in {tmp, *prefixes}:
                for suffix in (".bin", ".idx"):
                    if os.path.exists(path + suffix):
                        os.remove(path + suffix)
    return stats
