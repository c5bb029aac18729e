"""One job per checkpoint folder: a second job on a `--save` that a live job holds is refused
before any compute, naming the holder; a holder that died does not block the next job."""

import json
import os
import re
import signal
import socket
import subprocess
import time

import pytest

from tiny_runs import launch, tiny_argv, train


def _lock_of(folder, host, pid, renewed_ago=0.0):
    """A lock file in `folder` as a job `pid` on `host` would have left it."""
    from megatron_focus.checkpoint.format import LOCK

    folder.mkdir(exist_ok=True)
    path = folder / LOCK
    path.write_text(json.dumps({"host": host, "pid": pid, "started": "2025-01-02 03:04:05 UTC"}))
    renewed = time.time() - renewed_ago
    os.utime(path, (renewed, renewed))
    return path


@pytest.fixture
def live_pid():
    """A process that lives as long as the test."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize(
    "holder",
    ["a dead pid on this host", "another host, its lease run out", "a live pid, lease run out"],
)
def test_a_holder_that_died_does_not_block_the_next_job(tmp_path, holder, live_pid):
    from megatron_focus.checkpoint.lock import LEASE, FolderLock

    host, pid, age = {
        "a dead pid on this host": (socket.gethostname(), _dead_pid(), 0.0),
        "another host, its lease run out": ("node-7", 4242, LEASE + 5),
        # a stopped job, or its pid taken by another process since
        "a live pid, lease run out": (socket.gethostname(), live_pid, LEASE + 5),
    }[holder]
    path = _lock_of(tmp_path / "ckpt", host, pid, age)
    lock = FolderLock.take(str(tmp_path / "ckpt"))
    ours = json.loads(path.read_text())
    assert (ours["host"], ours["pid"]) == (socket.gethostname(), os.getpid())
    lock.release()
    assert os.listdir(tmp_path / "ckpt") == []


@pytest.mark.parametrize("holder", ["a live pid on this host", "another host, its lease fresh"])
def test_a_live_holder_refuses_naming_itself(tmp_path, holder, live_pid):
    from megatron_focus.checkpoint.lock import FolderInUse, FolderLock

    host, pid = {
        "a live pid on this host": (socket.gethostname(), live_pid),
        "another host, its lease fresh": ("node-7", 4242),
    }[holder]
    path = _lock_of(tmp_path / "ckpt", host, pid, renewed_ago=20)
    before = path.read_text()
    with pytest.raises(
        FolderInUse,
        match=rf"--save {tmp_path}/ckpt is in use by another job \(pid {pid} on {host}, "
        r"started 2025-01-02 03:04:05 UTC; its lock .*job.lock renewed 20 s ago\)",
    ):
        FolderLock.take(str(tmp_path / "ckpt"))
    assert path.read_text() == before


def test_the_lease_is_renewed_while_the_job_lives(tmp_path, monkeypatch):
    from megatron_focus.checkpoint import lock

    monkeypatch.setattr(lock, "RENEW", 0.05)
    held = lock.FolderLock.take(str(tmp_path))
    path = tmp_path / "job.lock"
    os.utime(path, (0, 0))  # as if renewed long ago
    time.sleep(0.5)
    assert time.time() - path.stat().st_mtime < 1
    held.release()


def test_a_lock_taken_over_is_left_to_its_new_holder(tmp_path):
    """A job whose lease ran out (stopped, say) and was taken over does not remove the new
    holder's lock when it ends."""
    from megatron_focus.checkpoint.lock import FolderLock

    held = FolderLock.take(str(tmp_path))
    os.remove(tmp_path / "job.lock")
    theirs = _lock_of(tmp_path, "node-7", 4242)
    held.release()
    assert theirs.exists()


def test_a_run_that_never_saved_leaves_no_folder(tmp_path):
    from megatron_focus.checkpoint.lock import FolderLock

    FolderLock.take(str(tmp_path / "runs" / "ckpt")).release()
    assert os.listdir(tmp_path) == []


def test_the_lock_is_neither_debris_nor_a_checkpoint(tmp_path):
    from megatron_focus.checkpoint.format import DEBRIS, LOCK, complete_tags

    (tmp_path / LOCK).write_text("{}")
    assert not DEBRIS.fullmatch(LOCK) and complete_tags(str(tmp_path)) == []


def test_every_rank_is_refused_before_any_compute(embedded_cache, tmp_path, live_pid):
    """Rank 0 holds the job's lock; the other ranks learn that the folder is taken."""
    ckpt = tmp_path / "ckpt"
    _lock_of(ckpt, socket.gethostname(), live_pid)
    with pytest.raises(Exception, match=rf"in use by another job \(pid {live_pid} on "):
        train(2, tiny_argv(embedded_cache, "--save", str(ckpt)))
    assert sorted(os.listdir(ckpt)) == ["job.lock"]


@pytest.mark.slow
def test_two_jobs_on_one_save_folder(embedded_cache, tmp_path):
    """A second job, started while the first trains, is refused before it builds anything,
    naming the first; the first, stopped by a signal, saves and frees the folder."""
    ckpt = str(tmp_path / "ckpt")
    argv = tiny_argv(embedded_cache, "--save", ckpt, "--exit-signal-handler", iters=10_000)
    first = launch(argv + ["--seed", "1"])
    try:
        for line in first.stdout:
            if "iteration        2/" in line:
                break
        second = launch(argv + ["--seed", "2"])
        output = second.communicate(timeout=120)[0]
        assert second.returncode == 2, output
        assert re.search(
            rf"error: --save {ckpt} is in use by another job \(pid {first.pid} on "
            rf"{re.escape(socket.gethostname())}, started ",
            output,
        ), output
        assert "megatron-focus |" not in output and "iteration" not in output, output
        assert first.poll() is None
        first.send_signal(signal.SIGTERM)
        rest = first.communicate(timeout=120)[0]
    finally:
        first.kill()
    assert first.returncode == 0, rest
    assert "saved checkpoint" in rest
    assert "job.lock" not in os.listdir(ckpt)
