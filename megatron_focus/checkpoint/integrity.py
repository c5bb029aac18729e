"""Checksums of a checkpoint's files, written at save and checked before a load.

A file damaged after its save (a truncated copy, a failing disk, a partial sync between clusters)
would otherwise surface as a low-level unpickling error, or not at all. `checksums.json` holds
every file's size and SHA-256; the ranks share the hashing, each taking every world-size-th file.
"""

import hashlib
import json
import os
from typing import Optional

import torch.distributed as dist

from megatron_focus.checkpoint.format import TAG, write_atomically

CHECKSUMS = "checksums.json"
_CHUNK = 1 << 24


def _digest(path: str) -> dict:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            sha.update(block)
    return {"bytes": os.path.getsize(path), "sha256": sha.hexdigest()}


def _shared(folder: str, names: list) -> dict:
    """{name: digest} of `names`, each rank hashing its share (every rank gets all of them)."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    mine = {name: _digest(os.path.join(folder, name)) for name in names[rank::world]}
    if world == 1:
        return mine
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return {name: digest for part in parts for name, digest in part.items()}


def _files(folder: str) -> list:
    return sorted(
        name
        for name in os.listdir(folder)
        if name != CHECKSUMS and os.path.isfile(os.path.join(folder, name))
    )


def digests(folder: str) -> dict:
    """Collective: every rank calls it once every file of `folder` is written."""
    return _shared(folder, _files(folder))


def write(folder: str, digests: dict) -> None:
    write_atomically(os.path.join(folder, CHECKSUMS), json.dumps(digests, indent=1))


def _saved(folder: str):
    """The recorded digests; None for a checkpoint saved before they were recorded."""
    path = os.path.join(folder, CHECKSUMS)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({e})") from None


def _by_size(folder: str, saved: dict) -> list:
    found = []
    for name, digest in saved.items():
        where = os.path.join(folder, name)
        if not os.path.isfile(where):
            found.append(f"{name} is missing")
        elif os.path.getsize(where) != digest["bytes"]:
            found.append(f"{name} is {os.path.getsize(where)} bytes, {digest['bytes']} when saved")
    return found


def problems(folder: str) -> list:
    """What differs from the save, file by file (collective when distributed)."""
    saved = _saved(folder)
    if saved is None:
        return []
    found = _by_size(folder, saved)
    if found:
        return found
    now = _shared(folder, sorted(saved))
    return [
        f"{name} differs from what was saved (SHA-256)"
        for name in sorted(saved)
        if now[name]["sha256"] != saved[name]["sha256"]
    ]


def previous_complete(folder: str) -> Optional[str]:
    """The newest checkpoint of the same run older than `folder` whose files are all there at
    their saved sizes."""
    parent, tag = os.path.split(os.path.abspath(folder))
    for name in sorted(os.listdir(parent), reverse=True):
        if TAG.fullmatch(name) and name < tag:
            saved = _saved(os.path.join(parent, name))
            if saved is not None and not _by_size(os.path.join(parent, name), saved):
                return name
    return None


def verify(checkpoint_dir: str) -> None:
    """Collective: refuse a checkpoint whose files differ from what its save wrote."""
    found = problems(checkpoint_dir)
    if not found:
        return
    previous = previous_complete(checkpoint_dir)
    hint = (
        f"; the previous checkpoint, {previous}, is complete: resume from it with "
        f"--ckpt-step {int(previous[len('iter_') :])}"
        if previous
        else ""
    )
    raise ValueError(f"checkpoint {checkpoint_dir} is damaged: {'; '.join(found)}{hint}")
