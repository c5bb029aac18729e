"""One job per checkpoint folder: a lock file inside it (`format.LOCK`), so that it holds across
nodes sharing the file system, where a lock in /tmp would not. Two jobs saving into one folder
would overwrite each other's checkpoints and `latest`, silently (a resubmitted job whose
predecessor still runs).

The file names its holder: host, pid (and that process's start time, so that a pid reused by
another process is not mistaken for it), start time and a job identity drawn at random. Its
modification time is the holder's lease, renewed every `RENEW` seconds by a thread for as long as
the job lives. A holder that died does not block the next job: on its own host, once its process
is gone (a live process there is never taken over, however old its lease: a job suspended by the
scheduler resumes later); from another host, where its process cannot be seen, once its lease is
older than `LEASE` seconds (a node that died, or a job suspended that long). Whoever takes a lock
over says whose it was and why it was judged gone.

A job can lose its folder while it is stopped (on another host, past its lease). So the holder
confirms, before every write into the folder, that the lock still names its own job identity
(`confirm`); one that lost it stops without writing.
"""

import json
import os
import socket
import threading
import time
import uuid
from typing import Optional

import psutil

from megatron_focus import cli
from megatron_focus.checkpoint.format import LOCK

# Seconds; MEGATRON_FOCUS_LOCK_LEASE sets another (a cluster that suspends jobs for longer and
# wants them kept across hosts, or a test).
LEASE = float(os.environ.get("MEGATRON_FOCUS_LOCK_LEASE", 180))
RENEW = LEASE / 6


class FolderInUse(ValueError):
    """The folder is held by another job that is alive."""


class FolderLost(cli.Stopped):
    """This job's lock was taken over by another job (this one was stopped past its lease)."""


def _stamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(seconds))


def _this_process() -> dict:
    """The holder record of this process, under a new job identity."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_started": psutil.Process().create_time(),
        "started": _stamp(time.time()),
        "job": uuid.uuid4().hex,
    }


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
    return raw, (holder if isinstance(holder, dict) else {}), age


def _gone(holder: dict, age: float) -> Optional[str]:
    """Why the lock's holder is judged gone, or None while it may be alive."""
    if not holder:  # a lock being written, or damaged
        return f"its lock is unreadable and {age:.0f} s old" if age > LEASE else None
    pid = holder.get("pid", -1)
    if holder.get("host") != socket.gethostname():
        if age <= LEASE:
            return None
        return (
            f"its lease ran out: renewed {age:.0f} s ago, more than {LEASE:.0f} s, and its "
            f"host is not this one ({socket.gethostname()}), whose processes cannot be seen"
        )
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return f"its process {pid} has ended on this host"
        started = process.create_time()
    except psutil.NoSuchProcess:
        return f"its process {pid} is gone from this host"
    except psutil.AccessDenied:  # another user's process, alive
        return None
    recorded = holder.get("pid_started")
    if recorded is not None and abs(started - recorded) > 1.0:
        return f"pid {pid} on this host is now another process, started {_stamp(started)}"
    return None


def _who(holder: dict, age: float) -> str:
    if not holder:
        return f"a job whose lock is being written or unreadable, touched {age:.0f} s ago"
    return (
        f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}, "
        f"its lock renewed {age:.0f} s ago"
    )


def _suspended(holder: dict) -> str:
    """A hint when the live holder on this host is stopped (suspended by a scheduler, ^Z)."""
    if holder.get("host") != socket.gethostname():
        return ""
    try:
        stopped = psutil.Process(holder["pid"]).status() == psutil.STATUS_STOPPED
    except (psutil.Error, KeyError):
        return ""
    return (
        f"; it is suspended: resume it (kill -CONT {holder['pid']}, scontrol resume) or end it"
        if stopped
        else ""
    )


def _refusal(folder: str, path: str, holder: dict, age: float) -> FolderInUse:
    return FolderInUse(
        f"--save {folder} is in use by another job ({_who(holder, age)}: {path}"
        f"{_suspended(holder)}): give this run another --save, or wait for that job to end (a "
        "job that died frees it at once on its own host, from other hosts once its lease of "
        f"{LEASE:.0f} s runs out)"
    )


def _take_over(path: str, stale: bytes) -> bool:
    """Remove the stale lock `stale`, unless another job has replaced it meanwhile (put back);
    whether this job removed it."""
    aside = f"{path}.{socket.gethostname()}.{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another job removed it first
        return False
    with open(aside, "rb") as f:
        ours = f.read() == stale
    if not ours:
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    os.remove(aside)
    return ours


class FolderLock:
    """The lock on a checkpoint folder, held by this process until `release`. `took_over`
    says whose stale lock it replaced, and why that job was judged gone (None if none)."""

    def __init__(self, folder: str, fd: int, holder: dict, created: list, took_over):
        self.folder, self.path = folder, os.path.join(folder, LOCK)
        self.fd, self.holder, self.created, self.took_over = fd, holder, created, took_over
        self.lost = False  # seen taken over by the renewal; `confirm` reads the file itself
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="checkpoint-lock", daemon=True)
        self._renewer.start()

    @property
    def job(self) -> str:
        return self.holder["job"]

    @classmethod
    def take(cls, folder: str) -> "FolderLock":
        """Hold `folder` (created if missing); raises `FolderInUse` naming a live holder."""
        created, missing = [], os.path.abspath(folder)
        while not os.path.isdir(missing):
            created.append(missing)
            missing = os.path.dirname(missing)
        os.makedirs(folder, exist_ok=True)
        path, took_over = os.path.join(folder, LOCK), None
        while True:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)  # the umask
                break
            except FileExistsError:
                found = _read(path)
                if found is None:
                    continue
                raw, holder, age = found
                reason = _gone(holder, age)
                if reason is None:
                    raise _refusal(folder, path, holder, age) from None
                if _take_over(path, raw):
                    took_over = (
                        f"--save {folder}: took over the lock of a job judged gone "
                        f"({_who(holder, age)}): {reason}"
                    )
        holder = _this_process()
        os.write(fd, json.dumps(holder).encode())
        os.fsync(fd)
        return cls(folder, fd, holder, created, took_over)

    def _renew(self) -> None:
        while not self._stop.wait(RENEW):
            try:
                self.lost = self.holder_now() is not None
                if not self.lost:
                    os.utime(self.fd)
            except OSError:  # a file system briefly away: the next renewal tries again
                pass

    def holder_now(self) -> Optional[str]:
        """None while the folder's lock is still this job's; else who holds it now."""
        found = _read(self.path)
        if found is None:
            return "no job (this job's lock was removed)"
        _, holder, age = found
        return None if holder.get("job") == self.job else _who(holder, age)

    def confirm(self) -> None:
        """Before a write into the folder: raises `FolderLost` unless it is still this job's."""
        now = self.holder_now()
        if now is not None:
            raise FolderLost(
                f"--save {self.folder} is no longer this job's: this job's lock (taken "
                f"{self.holder['started']} by pid {self.holder['pid']} on "
                f"{self.holder['host']}) was taken over while this job was stopped past its "
                f"lease of {LEASE:.0f} s; the folder is now held by {now}. Stopped without "
                "writing there: its checkpoints are that job's; resume from them once it "
                "ends, or give this run another --save"
            )

    def release(self) -> None:
        """Remove the lock, unless a job has taken it over (after this one's lease ran out), and
        the folders `take` created if they stayed empty (a run refused before it saved leaves
        nothing behind)."""
        self._stop.set()
        self._renewer.join()
        if self.holder_now() is None:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)
        for folder in self.created:  # innermost first
            try:
                os.rmdir(folder)
            except OSError:  # not empty: the run saved there
                break
