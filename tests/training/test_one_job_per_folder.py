"""One job per checkpoint folder: a second job on a `--save` that a live job holds is refused
before any compute, naming the holder; a holder that died does not block the next job."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tiny_runs import launch, tiny_argv, train


def _lock_of(folder, host, pid, renewed_ago=0.0, **record):
    """A lock file in `folder` as a job `pid` on `host` would have left it."""
    from megatron_focus.checkpoint.format import LOCK

    folder.mkdir(exist_ok=True)
    path = folder / LOCK
    holder = {"host": host, "pid": pid, "started": "2025-01-02 03:04:05 UTC", "job": "b" * 32}
    path.write_text(json.dumps({**holder, **record}))
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
    "holder, reason",
    [
        ("a dead pid on this host", r"its process \d+ is gone from this host"),
        (
            "another host, its lease run out",
            r"its lease ran out: renewed 18\d s ago, more than 180 s",
        ),
        ("its pid now another process", r"pid \d+ on this host is now another process, started "),
    ],
)
def test_a_holder_that_died_does_not_block_the_next_job(tmp_path, holder, reason, live_pid):
    """...and the job taking over says whose lock it was and why that job was judged gone."""
    from megatron_focus.checkpoint.lock import LEASE, FolderLock

    host, pid, age, record = {
        "a dead pid on this host": (socket.gethostname(), _dead_pid(), 0.0, {}),
        "another host, its lease run out": ("node-7", 4242, LEASE + 5, {}),
        # a pid reused since by another process: its start time is not the holder's
        "its pid now another process": (
            socket.gethostname(),
            live_pid,
            0.0,
            {"pid_started": psutil.Process(live_pid).create_time() - 3600},
        ),
    }[holder]
    path = _lock_of(tmp_path / "ckpt", host, pid, age, **record)
    lock = FolderLock.take(str(tmp_path / "ckpt"))
    ours = json.loads(path.read_text())
    assert (ours["host"], ours["pid"], ours["job"]) == (socket.gethostname(), os.getpid(), lock.job)
    assert re.fullmatch(
        rf"--save {tmp_path}/ckpt: took over the lock of a job judged gone \(pid {pid} on "
        rf"{host}, started 2025-01-02 03:04:05 UTC, its lock renewed \d+ s ago\): {reason}.*",
        lock.took_over,
    ), lock.took_over
    lock.release()
    assert os.listdir(tmp_path / "ckpt") == []


@pytest.mark.parametrize(
    "holder",
    [
        "a live pid on this host",
        "a live pid on this host, its lease run out",
        "another host, its lease fresh",
    ],
)
def test_a_live_holder_refuses_naming_itself(tmp_path, holder, live_pid):
    """On its own host a live process keeps the folder however old its lease (a job suspended by
    the scheduler resumes later); from another host, a fresh lease does."""
    from megatron_focus.checkpoint.lock import LEASE, FolderInUse, FolderLock

    host, pid, age = {
        "a live pid on this host": (socket.gethostname(), live_pid, 20),
        "a live pid on this host, its lease run out": (socket.gethostname(), live_pid, LEASE + 60),
        "another host, its lease fresh": ("node-7", 4242, 20),
    }[holder]
    path = _lock_of(tmp_path / "ckpt", host, pid, renewed_ago=age)
    before = path.read_text()
    with pytest.raises(
        FolderInUse,
        match=rf"--save {tmp_path}/ckpt is in use by another job \(pid {pid} on {host}, "
        rf"started 2025-01-02 03:04:05 UTC, its lock renewed {age:.0f} s ago: .*job.lock\)",
    ):
        FolderLock.take(str(tmp_path / "ckpt"))
    assert path.read_text() == before


def _wait_for(condition, timeout=10.0):
    """A signal is delivered when its process next runs: on a busy machine, a moment later."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_suspended_holder_is_named_as_such(tmp_path, live_pid):
    from megatron_focus.checkpoint.lock import FolderInUse, FolderLock

    _lock_of(tmp_path, socket.gethostname(), live_pid, renewed_ago=1000)
    os.kill(live_pid, signal.SIGSTOP)
    try:
        _wait_for(lambda: psutil.Process(live_pid).status() == psutil.STATUS_STOPPED)
        with pytest.raises(
            FolderInUse, match=rf"it is suspended: resume it \(kill -CONT {live_pid}"
        ):
            FolderLock.take(str(tmp_path))
    finally:
        os.kill(live_pid, signal.SIGCONT)


def test_a_job_whose_lock_was_taken_over_writes_nothing_and_says_who_holds_it(tmp_path):
    """The holder confirms before each write that the lock is still its own job's, not only a
    file of the same name: one replaced by another job's (its lease ran out while this job was
    stopped) stops it, naming that job; so does one removed."""
    from megatron_focus.checkpoint.lock import FolderLock, FolderLost

    held = FolderLock.take(str(tmp_path))
    held.confirm()
    os.remove(tmp_path / "job.lock")
    with pytest.raises(FolderLost, match="now held by no job"):
        held.confirm()
    theirs = _lock_of(tmp_path, "node-7", 4242)
    with pytest.raises(
        FolderLost,
        match=rf"--save {tmp_path} is no longer this job's: this job's lock \(taken .* by pid "
        rf"{os.getpid()} on .*\) was taken over while this job was stopped past its lease of "
        r"180 s; the folder is now held by pid 4242 on node-7, started 2025-01-02 03:04:05 UTC, "
        r"its lock renewed 0 s ago\. Stopped without writing there",
    ):
        held.confirm()
    held.release()
    assert theirs.exists()


def test_the_lease_is_renewed_while_the_job_lives_and_a_takeover_seen(tmp_path, monkeypatch):
    from megatron_focus.checkpoint import lock

    monkeypatch.setattr(lock, "RENEW", 0.05)
    held = lock.FolderLock.take(str(tmp_path))
    path = tmp_path / "job.lock"
    os.utime(path, (0, 0))  # as if renewed long ago
    time.sleep(0.5)
    assert time.time() - path.stat().st_mtime < 1 and not held.lost
    os.remove(path)
    theirs = _lock_of(tmp_path, "node-7", 4242, renewed_ago=100)
    time.sleep(0.5)
    assert held.lost
    assert time.time() - theirs.stat().st_mtime > 99  # not renewed: not this job's
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


def _other_host(argv):
    """`pretrain_gpt.py argv` as a job on another host, `node-b` (a UTS namespace of its own
    sharing this file system and these pids: what two nodes on one shared disk see)."""
    return launch(
        argv,
        "unshare",
        "--uts",
        "sh",
        "-c",
        'hostname node-b && exec "$0" "$@"',
        sys.executable,
        env={"MEGATRON_FOCUS_LOCK_LEASE": "4"},
    )


def _until(proc, pattern):
    """Read `proc`'s output until a line matches `pattern`; returns what it read."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if re.search(pattern, line):
            return "".join(seen)
    raise AssertionError("".join(seen)[-5000:])


def _digests(ckpt):
    from megatron_focus.checkpoint.format import complete_tags

    return {tag: (ckpt / tag / "checksums.json").read_text() for tag in complete_tags(str(ckpt))}


@pytest.mark.slow
def test_a_job_suspended_past_its_lease_never_writes_to_the_folder_it_lost(
    embedded_cache, tmp_path
):
    """SIGSTOP (a scheduler's suspend) past the lease: a second job on the same host is refused
    (the holder's pid lives there, suspended); one on another host takes the folder over, saying
    whose lock it replaced. Resumed (SIGCONT), the first job stops at its next save in one line
    naming the new holder, writing nothing: `latest` and every checkpoint stay as the new holder
    wrote them."""
    if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode:
        pytest.skip("a UTS namespace (another host name) needs root")
    ckpt = tmp_path / "ckpt"
    argv = tiny_argv(
        embedded_cache,
        "--save",
        str(ckpt),
        "--load",
        str(ckpt),
        "--save-interval",
        "3",
        "--exit-signal-handler",
        iters=100_000,
    )
    lease = {"MEGATRON_FOCUS_LOCK_LEASE": "4"}
    first = launch(argv, env=lease)
    second = None
    try:
        _until(first, r"saved checkpoint .*iter_0000003")
        os.kill(first.pid, signal.SIGSTOP)
        time.sleep(6)  # past the lease
        same_host = launch(argv, env=lease)
        refused = same_host.communicate(timeout=120)[0]
        assert same_host.returncode == 2, refused
        assert re.search(rf"in use by another job \(pid {first.pid} on .*it is suspended", refused)
        second = _other_host(argv)
        took = _until(second, r"saved checkpoint .*iter_0000009")
        assert re.search(
            rf"--save {ckpt}: took over the lock of a job judged gone \(pid {first.pid} on "
            rf"{re.escape(socket.gethostname())}, started .*, its lock renewed \d+ s ago\): its "
            r"lease ran out: renewed \d+ s ago, more than 4 s",
            took,
        ), took
        assert "starting at iteration 3" in took
        os.kill(first.pid, signal.SIGCONT)
        lost = first.communicate(timeout=120)[0]
        assert first.returncode == 1, lost
        assert re.search(
            rf"error: --save {ckpt} is no longer this job's: .* the folder is now held by pid "
            rf"{second.pid} on node-b, started .* Stopped without writing there",
            lost,
        ), lost
        assert "saved checkpoint" not in lost
        written = _digests(ckpt)
        second.send_signal(signal.SIGTERM)
        rest = second.communicate(timeout=120)[0]
        assert second.returncode == 0, rest
        last = re.findall(r"saved checkpoint .*(iter_\d+)", rest)[-1]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
    assert (ckpt / "latest").read_text() == last
    now = _digests(ckpt)
    assert {tag: now[tag] for tag in written} == written  # as the holder wrote them
    from megatron_focus.checkpoint import integrity

    assert all(integrity.problems(str(ckpt / tag)) == [] for tag in now)
    scripts = ["zero_to_fp32.py", "zero_to_torch.py"]  # DeepSpeed's
    assert sorted(os.listdir(ckpt)) == sorted([*now, "latest", *scripts])  # no debris, no lock
