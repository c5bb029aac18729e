"""One job per checkpoint folder: a lock file inside it (`format.LOCK`), so that it holds across
nodes sharing the file system, where a lock in /tmp would not. Two jobs saving into one folder
would overwrite each other's checkpoints and `latest`, silently (a resubmitted job whose
predecessor still runs).

The file names its holder (host, pid, start time); its modification time is the holder's lease,
renewed every `RENEW` seconds by a thread for as long as the job lives. A holder that died leaves
the file behind and does not block the next job: on its own host, once its pid is gone; from any
host, once its lease is older than `LEASE` seconds (a node that died). Of two jobs that find a
stale lock at once, one takes it over and the other is refused, naming the first.
"""

import json
import os
import socket
import threading
import time
from typing import Optional

from megatron_focus.checkpoint.format import LOCK

LEASE = 180.0
RENEW = 30.0


class FolderInUse(ValueError):
    """The folder is held by another job that is alive."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _read(path: str) -> Optional[tuple]:
    """(the lock's bytes, its holder as a dict ({} while being written), seconds since its
    lease was renewed); None if there is no lock."""
    try:
        with open(path, "rb") as f:
            raw, age = f.read(), time.time() - os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(raw)
    except ValueError:
        holder = {}
    return raw, holder, age


def _live(holder: dict, age: float) -> bool:
    if age > LEASE:
        return False
    return holder.get("host") != socket.gethostname() or _alive(holder.get("pid", -1))


def _refusal(folder: str, path: str, holder: dict, age: float) -> FolderInUse:
    who = (
        f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
        if holder
        else "a job starting now"
    )
    return FolderInUse(
        f"--save {folder} is in use by another job ({who}; its lock {path} renewed {age:.0f} s "
        "ago): give this run another --save, or wait for that job to end (a job that died frees "
        f"it at once on its own host, from other hosts once its lease of {LEASE:.0f} s runs out)"
    )


def _take_over(path: str, stale: bytes) -> None:
    """Remove the stale lock `stale`, unless another job has replaced it meanwhile (put back)."""
    aside = f"{path}.{socket.gethostname()}.{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another job removed it first
        return
    with open(aside, "rb") as f:
        ours = f.read() == stale
    if not ours:
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    os.remove(aside)


class FolderLock:
    """The lock on a checkpoint folder, held by this process until `release`."""

    def __init__(self, path: str, fd: int, created: list):
        self.path, self.fd, self.created = path, fd, created
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="checkpoint-lock", daemon=True)
        self._renewer.start()

    @classmethod
    def take(cls, folder: str) -> "FolderLock":
        """Hold `folder` (created if missing); raises `FolderInUse` naming a live holder."""
        created, missing = [], os.path.abspath(folder)
        while not os.path.isdir(missing):
            created.append(missing)
            missing = os.path.dirname(missing)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, LOCK)
        while True:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                break
            except FileExistsError:
                found = _read(path)
                if found is None:
                    continue
                raw, holder, age = found
                if _live(holder, age):
                    raise _refusal(folder, path, holder, age) from None
                _take_over(path, raw)
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        os.write(fd, json.dumps(holder).encode())
        os.fsync(fd)
        return cls(path, fd, created)

    def _renew(self) -> None:
        while not self._stop.wait(RENEW):
            try:
                os.utime(self.fd)
            except OSError:  # a file system briefly away: the next renewal tries again
                pass

    def release(self) -> None:
        """Remove the lock, unless a job has taken it over (after this one's lease ran out), and
        the folders `take` created if they stayed empty (a run refused before it saved leaves
        nothing behind)."""
        self._stop.set()
        self._renewer.join()
        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.remove(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        for folder in self.created:  # innermost first
            try:
                os.rmdir(folder)
            except OSError:  # not empty: the run saved there
                break
