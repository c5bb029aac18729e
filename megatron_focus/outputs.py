"""Output folders that are written whole or not at all, and never over someone else's files.

A tool's result (an HF export, an imported checkpoint) is written into a temporary sibling
folder and renamed to its name at the end: a failure leaves what was there before, untouched,
and nothing that looks complete. A folder that already holds files is replaced only when the
user says so (`--overwrite`), and then only once the new one is complete.
"""

import contextlib
import os
import shutil
import tempfile
from typing import Iterator


def check_fresh(path: str, overwrite: bool) -> None:
    """Refuse, before any work, a `path` that holds files (unless `overwrite`) or is a file."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{path} is a file, not a folder")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise FileExistsError(
            f"{path} is not empty: choose a new folder, or pass --overwrite to "
            "replace it once the new one is complete"
        )


@contextlib.contextmanager
def fresh_folder(path: str, overwrite: bool = False) -> Iterator[str]:
    """Yields a temporary folder beside `path` to write into, renamed to `path` when the block
    completes; removed if it raises."""
    check_fresh(path, overwrite)
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = tempfile.mkdtemp(
        prefix=f".{os.path.basename(path)}.partial-", dir=os.path.dirname(path)
    )
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if os.path.isdir(path):  # empty, or --overwrite: moved aside, then removed
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=os.path.dirname(path))
        os.rename(path, os.path.join(old, "replaced"))
        os.rename(partial, path)
        shutil.rmtree(old)
    else:
        os.rename(partial, path)
