"""Document readers shared by preprocessing and tokenizer training.

A record is a tuple of texts, one per requested key. Formats: jsonl / json lines (optionally
.gz), parquet (read in row-group batches, never whole), and .txt (one document per line, under
the key "text"). Errors name the file and line/row, since a bad record deep in a large shard is
otherwise hard to find.
"""

import glob
import gzip
import json
import zlib
from typing import Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet", ".txt")
PARQUET_BATCH_ROWS = 1024


def expand_inputs(patterns: Sequence[str], keys: Sequence[str]) -> list[str]:
    """Resolve paths/globs (sorted, so runs are reproducible) and validate them before any work."""
    paths = []
    for pattern in patterns:
        matches = sorted(glob.glob(str(pattern)))
        if not matches:
            raise FileNotFoundError(f"--input {pattern}: no such file")
        for path in matches:
            if not path.endswith(SUFFIXES):
                raise ValueError(
                    f"--input {path}: unsupported file type; expected one of {', '.join(SUFFIXES)}"
                )
            if path.endswith(".parquet"):
                _check_parquet_columns(path, keys)
            if path.endswith(".txt") and tuple(keys) != ("text",):
                raise ValueError(
                    f"{path}: a .txt file holds one document per line under the key 'text', "
                    f"not --json-keys {' '.join(keys)}"
                )
        paths += matches
    if not paths:
        raise ValueError("no --input files given")
    return paths


def iter_records(paths: Sequence[str], keys: Sequence[str]) -> Iterator[tuple[str, ...]]:
    """Yield one tuple of texts (in `keys` order) per document, file after file."""
    for path in paths:
        if path.endswith(".parquet"):
            yield from _parquet_records(path, keys)
        elif path.endswith(".txt"):
            for _, line in _lines(path):
                yield (line.rstrip("\n"),)
        else:
            yield from _json_lines_records(path, keys)


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of a text file, plain or gzipped; bytes that are not UTF-8 and a
    truncated gzip stream are errors naming the file and line."""
    opener = gzip.open if path.endswith(".gz") else open
    lineno = 0
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    yield lineno, raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} "
                        f"at column {e.start + 1}); re-encode the file as UTF-8"
                    ) from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise ValueError(
            f"{path}: the gzip stream is damaged or truncated after line {lineno} ({e})"
        ) from None


def _json_lines_records(path: str, keys: Sequence[str]) -> Iterator[tuple[str, ...]]:
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}"
            )
        yield tuple(_text(record, key, f"{path}:{lineno}") for key in keys)


def _parquet_records(path: str, keys: Sequence[str]) -> Iterator[tuple[str, ...]]:
    row = 0
    for batch in pq.ParquetFile(path).iter_batches(
        batch_size=PARQUET_BATCH_ROWS, columns=list(keys)
    ):
        columns = [batch.column(key).to_pylist() for key in keys]
        for values in zip(*columns):
            for key, value in zip(keys, values):
                if value is None:
                    raise ValueError(f"{path}: row {row}: '{key}' is null")
            yield values
            row += 1


def _check_parquet_columns(path: str, keys: Sequence[str]) -> None:
    schema = pq.read_schema(path)
    for key in keys:
        if key not in schema.names:
            raise ValueError(
                f"{path}: no column '{key}' (columns: {', '.join(schema.names)}); "
                "pick the text column with --json-keys"
            )
        if not (
            pa.types.is_string(schema.field(key).type)
            or pa.types.is_large_string(schema.field(key).type)
        ):
            raise ValueError(
                f"{path}: column '{key}' has type {schema.field(key).type}, expected string"
            )


def _text(record: dict, key: str, where: str) -> str:
    if key not in record:
        raise ValueError(
            f"{where}: record has no '{key}' field (fields: {', '.join(record)}); "
            "pick the text field with --json-keys"
        )
    if not isinstance(record[key], str):
        raise ValueError(f"{where}: '{key}' is {type(record[key]).__name__}, expected a string")
    return record[key]
