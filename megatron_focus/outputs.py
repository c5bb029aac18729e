"""Output folders that are written whole or not at all, and never over someone else's files.

A tool's result (an HF export, an imported checkpoint) is written into a temporary sibling
folder and renamed to its name at the end: a failure leaves what was there before, untouched,
and nothing that looks complete. A folder that already holds files is replaced only when the
user says so (`--overwrite`), and then only once the new one is complete. What it holds gets
the permissions the user's umask gives new files (a temporary folder is made owner-only, and
some writers make their files so): teammates on a shared cluster read a model as they read any
file.
"""

import contextlib
import errno
import os
import shutil
import tempfile
from typing import Iterator


def check_writable(flag: str, folder: str) -> None:
    """That `folder` can be created and written, without creating it (the first write will)."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {folder}: cannot write there ({e.strerror})") from None


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
    honour_umask(partial)
    if os.path.isdir(path):  # empty, or --overwrite: moved aside, then removed
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=os.path.dirname(path))
        os.rename(path, os.path.join(old, "replaced"))
        os.rename(partial, path)
        shutil.rmtree(old)
    else:
        os.rename(partial, path)


def umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def honour_umask(folder: str) -> None:
    """`folder` and everything in it as if created under the umask: folders 0777 & ~umask,
    files 0666 & ~umask (keeping an executable's execute bits)."""
    mask = umask()
    for root, folders, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                execute = os.stat(path).st_mode & 0o111
                os.chmod(path, (0o666 | (execute and 0o111)) & ~mask)
