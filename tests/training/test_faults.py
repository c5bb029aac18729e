"""Faults during a run and in its checkpoints: a save that cannot be written, a damaged file, a
signal from a scheduler."""

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from distributed import run_distributed
from tiny_runs import ROOT, fresh_world, full_weights, run_pretrain, tiny_argv, torchrun, train


def _train_with_disk_full_at(argv, tag, rank):
    """Training whose writes under `tag` fail on `rank` as on a full disk."""
    import torch.distributed as dist

    save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if tag in str(path) and dist.get_rank() == rank:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return save(obj, path, *args, **kwargs)

    torch.save = full_disk
    return run_pretrain(argv)


def test_a_save_that_fails_on_one_rank_stops_the_run_and_keeps_the_last(embedded_cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = tiny_argv(
        embedded_cache, "--save", str(ckpt), "--save-interval", "2", "--zero-stage", "1", iters=6
    )
    with pytest.raises(
        Exception,
        match=r"saving iter_0000004 failed on rank 1: the disk is full \(No space left on "
        r"device: .*iter_0000004.partial.*\); iter_0000002 stays the latest checkpoint",
    ):
        run_distributed(_train_with_disk_full_at, 2, argv, "iter_0000004", 1)
    assert (ckpt / "latest").read_text() == "iter_0000002"
    assert sorted(p for p in os.listdir(ckpt) if p.startswith(("iter_", "latest"))) == [
        "iter_0000002",
        "latest",
    ]


@pytest.fixture
def small_disk(tmp_path):
    """A 9 MiB file system (tmpfs) that the second checkpoint of a tiny run fills; mounting one
    needs root, as on CI."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=9m", "tmpfs", str(disk)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_mid_save_is_named_and_the_last_checkpoint_stays(embedded_cache, small_disk):
    ckpt = small_disk / "ckpt"
    argv = tiny_argv(embedded_cache, "--save", str(ckpt), "--save-interval", "2", iters=6)
    run = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *argv],
        capture_output=True,
        text=True,
        env=fresh_world(),
        cwd=ROOT,
    )
    assert run.returncode == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    error = run.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: saving iter_0000004 failed on rank 0: the disk is full \(No space left on "
        rf"device: {ckpt}/iter_0000004\.partial\.[0-9a-f]+/\S+\.pt\); iter_0000002 stays the "
        "latest checkpoint: free space on that disk or give --save another folder, then rerun with "
        "--load to resume",
        error,
    ), error
    assert sorted(os.listdir(ckpt)) == [
        "iter_0000002",
        "latest",
        "zero_to_fp32.py",
        "zero_to_torch.py",
    ]
    assert (ckpt / "latest").read_text() == "iter_0000002"


def test_a_record_that_cannot_be_written_leaves_no_temporary_file(small_disk):
    from megatron_focus.checkpoint.format import write_atomically

    with pytest.raises(OSError) as full:
        with open(small_disk / "filler", "wb") as f:
            f.write(bytes(10 << 20))
    assert full.value.errno == errno.ENOSPC
    with pytest.raises(OSError, match="No space left on device") as failed:
        write_atomically(str(small_disk / "latest"), "iter_0000002" * 1000)
    assert re.fullmatch(rf"{small_disk}/latest\.[0-9a-f]+\.tmp", failed.value.filename)
    assert sorted(os.listdir(small_disk)) == ["filler"]


@pytest.mark.parametrize(
    "code, words",
    [
        (errno.ENOSPC, "the disk is full (No space left on device: {f})"),
        (errno.EDQUOT, "the disk quota is used up (Disk quota exceeded: {f})"),
        (errno.EACCES, "no permission to write there (Permission denied: {f})"),
        (errno.EROFS, "the file system is read-only (Read-only file system: {f})"),
    ],
    ids=["ENOSPC", "EDQUOT", "EACCES", "EROFS"],
)
def test_a_failed_write_is_told_in_words_naming_the_file(code, words):
    from megatron_focus.training.checkpointing import described

    path = "/ckpt/iter_0000004.partial/mp_rank_00_model_states.pt"
    failure = OSError(code, os.strerror(code), path)
    assert described(failure, "/ckpt/iter_0000004.partial")[0] == words.format(f=path)


def test_a_torch_write_error_off_a_full_disk_names_the_file(tmp_path):
    from megatron_focus.training.checkpointing import _write_error, described

    path = str(tmp_path / "mp_rank_00_model_states.pt")
    torch_says = "[enforce fail at inline_container.cc:672] . why\nmore"
    failure = _write_error(RuntimeError(torch_says), path)
    assert described(failure, str(tmp_path))[0] == (
        f"the write failed (torch could not write it ([enforce fail at inline_container.cc:672] "
        f". why): {path})"
    )


def test_a_damaged_checkpoint_is_refused_and_the_previous_one_resumes(embedded_cache, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    flags = ["--save", ckpt, "--save-interval", "2"]
    straight = train(1, tiny_argv(embedded_cache, *flags, iters=4))
    shard = os.path.join(ckpt, "iter_0000004", "mp_rank_00_model_states.pt")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern, the size unchanged
    open(shard, "wb").write(bytes(data))
    resume = tiny_argv(embedded_cache, *flags, "--load", ckpt, iters=6)
    with pytest.raises(
        Exception,
        match=r"iter_0000004 is damaged: mp_rank_00_model_states.pt "
        r"differs from what was saved \(SHA-256\); the previous "
        r"checkpoint, iter_0000002, is complete: resume from it "
        r"with --ckpt-step 2",
    ) as failure:
        train(1, resume)
    assert "build_model" not in str(failure.value)  # found before any compute
    open(shard, "wb").write(bytes(data[: len(data) // 2]))
    with pytest.raises(
        Exception, match="mp_rank_00_model_states.pt is [0-9]+ bytes, [0-9]+ when saved"
    ):
        train(1, resume)
    again = train(1, tiny_argv(embedded_cache, *flags, "--load", ckpt, "--ckpt-step", "2", iters=4))
    assert again["losses"] == straight["losses"][2:]  # iterations 3-4 again, exactly
    assert open(os.path.join(ckpt, "latest")).read() == "iter_0000004"


def test_ckpt_step_names_a_checkpoint_that_exists(embedded_cache, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    train(1, tiny_argv(embedded_cache, "--save", ckpt, iters=3))
    with pytest.raises(
        Exception,
        match=r"--ckpt-step 2: .* holds no iter_0000002 \(it holds: "
        r"iter_0000003\)",
    ):
        train(1, tiny_argv(embedded_cache, "--load", ckpt, "--ckpt-step", "2", iters=4))


def test_what_an_interrupted_run_left_is_removed_and_reported(embedded_cache, tmp_path, capfd):
    ckpt = tmp_path / "ckpt"
    train(1, tiny_argv(embedded_cache, "--save", str(ckpt), iters=3))
    # as this version leaves them, and earlier versions did
    for debris in (
        "iter_0000005.partial.0a1b2c3d4e5f",
        "iter_0000004.partial",
        "iter_0000003.universal",
    ):
        (ckpt / debris).mkdir()
        (ckpt / debris / "mp_rank_00_model_states.pt").write_bytes(b"half")
    (ckpt / "latest.0a1b2c3d4e5f.tmp").write_text("iter_00")
    (ckpt / "latest.tmp").write_text("iter_00")
    train(
        1,
        tiny_argv(
            embedded_cache,
            "--save",
            str(ckpt),
            "--load",
            str(ckpt),
            "--override-opt_param-scheduler",
            iters=4,
        ),
    )
    assert "removed what an interrupted run left in" in capfd.readouterr().out
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith(("iter_", "latest"))) == [
        "iter_0000003",
        "iter_0000004",
        "latest",
    ]


@pytest.mark.parametrize("stage", ["0", "1"])
def test_no_save_optim_no_load_optim_no_save_rng_and_exit_duration(embedded_cache, tmp_path, stage):
    """Megatron's checkpoint-content flags and its time limit: a run whose limit has passed at
    its first check saves (no optimizer state, no random states) and stops; resumed without the
    optimizer, its weights and data position carry on while the LR schedule starts again."""
    ckpt = str(tmp_path / "ckpt")
    flags = ["--lr-decay-style", "constant", "--zero-stage", stage]
    straight = train(1, tiny_argv(embedded_cache, *flags, iters=4))
    first = train(
        1,
        tiny_argv(
            embedded_cache,
            *flags,
            "--save",
            ckpt,
            "--no-save-optim",
            "--no-save-rng",
            "--exit-duration-in-mins",
            "1e-9",
            iters=4,
        ),
    )
    assert len(first["losses"]) == 1 and open(os.path.join(ckpt, "latest")).read() == "iter_0000001"
    files = os.listdir(os.path.join(ckpt, "iter_0000001"))
    assert not [f for f in files if "optim_states" in f], files
    saved = torch.load(
        os.path.join(ckpt, "iter_0000001", "mp_rank_00_model_states.pt"), weights_only=False
    )
    assert saved["optimizer"] is None and "rng" not in saved
    with pytest.raises(Exception, match="--no-save-optim: it resumes with --no-load-optim"):
        train(1, tiny_argv(embedded_cache, *flags, "--load", ckpt, iters=4))
    resumed = train(
        1, tiny_argv(embedded_cache, *flags, "--load", ckpt, "--no-load-optim", iters=4)
    )
    assert resumed["losses"][0] == straight["losses"][1]  # the same weights and batch
    assert resumed["lr"][0] == straight["lr"][0]  # warmup's first step again
    assert len(resumed["losses"]) == 3


def test_pretrained_checkpoint_and_use_checkpoint_args(embedded_cache, tmp_path):
    """Megatron's --pretrained-checkpoint starts an empty --load from those weights (as
    --finetune); --use-checkpoint-args takes the model's shape from the checkpoint."""
    base, run = str(tmp_path / "base"), str(tmp_path / "run")
    train(1, tiny_argv(embedded_cache, "--save", base, iters=3))
    finetune = train(1, tiny_argv(embedded_cache, "--load", base, "--finetune", iters=3))
    started = train(
        1,
        tiny_argv(
            embedded_cache,
            "--pretrained-checkpoint",
            base,
            "--save",
            run,
            "--load",
            run,
            "--exit-interval",
            "2",
            iters=3,
        ),
    )
    assert started["losses"] == finetune["losses"][:2]
    resumed = train(
        1,
        tiny_argv(
            embedded_cache, "--pretrained-checkpoint", base, "--save", run, "--load", run, iters=3
        ),
    )  # --load now holds the run's own
    assert resumed["losses"] == finetune["losses"][2:]
    shaped = train(
        1,
        tiny_argv(
            embedded_cache,
            "--load",
            base,
            "--finetune",
            "--hidden-size",
            "128",
            "--num-layers",
            "5",
            "--use-checkpoint-args",
            iters=3,
        ),
    )
    assert shaped["losses"] == finetune["losses"]
    # and, without --seq-length, the sequence length the checkpoint was trained at
    from megatron_focus.training.arguments import parse_args

    argv = tiny_argv(embedded_cache)
    at = argv.index("--seq-length")
    unshaped = argv[:at] + argv[at + 2 :]
    taken = unshaped + ["--load", base, "--finetune", "--use-checkpoint-args"]
    assert parse_args(taken).seq_length == 32 != parse_args(unshaped).seq_length
    assert parse_args(taken + ["--seq-length", "16"]).seq_length == 16  # given: kept


def test_a_rope_model_fine_tunes_at_a_longer_context(embedded_cache, tmp_path):
    """RoPE has no position table: --finetune at a longer --seq-length (context extension)
    starts from the checkpoint's weights; a learned position table of another size is refused."""
    rope, short, wide = ["--position-embedding-type", "rope"], tmp_path / "short", tmp_path / "wide"
    train(1, tiny_argv(embedded_cache, *rope, "--save", str(short), iters=3))
    train(
        1,
        tiny_argv(
            embedded_cache, *rope, "--max-position-embeddings", "64", "--save", str(wide), iters=3
        ),
    )
    longer = [*rope, "--seq-length", "64"]
    extended = train(1, tiny_argv(embedded_cache, *longer, "--load", str(short), "--finetune"))
    # The same weights saved with a table size of 64 already: the ordinary path.
    reference = train(1, tiny_argv(embedded_cache, *longer, "--load", str(wide), "--finetune"))
    fresh = train(1, tiny_argv(embedded_cache, *longer))
    assert extended["losses"] == reference["losses"] != fresh["losses"]
    learned = str(tmp_path / "learned")
    train(1, tiny_argv(embedded_cache, "--save", learned, iters=3))
    with pytest.raises(Exception, match="max_position_embeddings: checkpoint 32, this run 64"):
        train(1, tiny_argv(embedded_cache, "--seq-length", "64", "--load", learned, "--finetune"))


@pytest.fixture(scope="module")
def uninterrupted_tp2(embedded_cache):
    """The losses of 24 iterations at TP 2 that no signal stopped."""
    argv = tiny_argv(
        embedded_cache, "--tensor-model-parallel-size", "2", "--exit-interval", "24", iters=10_000
    )
    return train(2, argv)["losses"]


def _job(launcher: int) -> dict:
    """torchrun's processes: {"launcher": [pid], "ranks": {rank: pid}, "workers": [pids]}."""
    import psutil

    ranks = {
        int(p.environ()["RANK"]): p
        for p in psutil.Process(launcher).children()
        if "pretrain_gpt.py" in p.cmdline()
    }
    workers = [w for p in ranks.values() for w in p.children()]
    return {"launcher": psutil.Process(launcher), "ranks": ranks, "workers": workers}


def _kill_tree(proc) -> None:
    """What is left of a job whose test failed: torchrun starts each rank in a session of its
    own."""
    import psutil

    if proc.poll() is None:
        tree = psutil.Process(proc.pid)
        for process in [*tree.children(recursive=True), tree]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize(
    "target, sig",
    [
        ("every process", signal.SIGTERM),  # SLURM's preemption signals the whole job
        ("every process", signal.SIGINT),
        ("the launcher", signal.SIGTERM),  # torchrun passes it to each rank's process group
        ("one rank", signal.SIGTERM),
    ],
    ids=lambda x: x.name if isinstance(x, signal.Signals) else x.replace(" ", "-"),
)
def test_a_signal_under_torchrun_saves_where_the_ranks_agree_and_resumes_exactly(
    embedded_cache, tmp_path, uninterrupted_tp2, target, sig
):
    """--exit-signal-handler under torchrun at TP 2 with DataLoader workers: whoever gets the
    signal, every rank saves at one iteration and exits 0, the workers leave the shutdown to
    their rank, and the run resumes bit for bit."""
    ckpt = str(tmp_path / "ckpt")
    flags = ["--tensor-model-parallel-size", "2", "--num-workers", "2"]
    argv = tiny_argv(embedded_cache, *flags, "--save", ckpt, "--exit-signal-handler", iters=10_000)
    proc = torchrun(argv)
    try:
        for line in proc.stdout:
            if "iteration        3/" in line:
                job = _job(proc.pid)
                assert len(job["ranks"]) == 2 and len(job["workers"]) >= 4, job
                signalled = {
                    "every process": [job["launcher"], *job["ranks"].values(), *job["workers"]],
                    "the launcher": [job["launcher"]],
                    "one rank": [job["ranks"][1]],
                }[target]
                for process in signalled:
                    process.send_signal(sig)
                break
        output = proc.communicate(timeout=120)[0]
    finally:
        _kill_tree(proc)
    assert "DataLoader worker" not in output and "ChildFailedError" not in output, output
    # The ranks exit 0; torchrun, when it was signalled itself, then reports the signal it got
    # (1), or, now and then, aborts in its own exit after doing so (a C++ thread of its store
    # still running: "terminate called without an active exception"), which is torch's.
    assert proc.returncode in ({0} if target == "one rank" else {1, -signal.SIGABRT}), output
    saved = re.findall(r"saved checkpoint .*/(iter_\d{7})", output)
    stopped = re.findall(r"exiting at iteration (\d+)", output)
    assert len(saved) == len(stopped) == 1 and int(stopped[0]) >= 3, output
    assert open(os.path.join(ckpt, "latest")).read() == saved[0] == f"iter_{int(stopped[0]):07d}"
    assert not [w for w in job["workers"] if w.is_running()]
    iteration = int(stopped[0])
    resumed = train(
        2,
        tiny_argv(
            embedded_cache,
            *flags,
            "--load",
            ckpt,
            "--exit-interval",
            str(iteration + 2),
            iters=10_000,
        ),
    )
    assert resumed["losses"] == uninterrupted_tp2[iteration : iteration + 2]


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_by_its_timeout(embedded_cache, tmp_path):
    """torchrun at TP 2 with --distributed-timeout-minutes 0.2 (12 s): one rank stopped
    (SIGSTOP) mid-run. The other stops once its collective has waited that long, in one line
    naming itself and the iteration; torchrun then ends the job; the last checkpoint is whole."""
    from megatron_focus.checkpoint import integrity

    ckpt = tmp_path / "ckpt"
    flags = ["--tensor-model-parallel-size", "2", "--distributed-timeout-minutes", "0.2"]
    argv = tiny_argv(
        embedded_cache, *flags, "--save", str(ckpt), "--save-interval", "2", iters=10_000
    )
    proc = torchrun(argv)
    try:
        for line in proc.stdout:
            if "iteration        5/" in line:
                _job(proc.pid)["ranks"][0].suspend()
                stalled = time.time()
                break
        output = proc.communicate(timeout=120)[0]
        ended = time.time() - stalled
    finally:
        _kill_tree(proc)
    assert proc.returncode == 1, output
    stopped = re.search(
        r"error: rank 1 waited for the other ranks after iteration (\d+) longer than "
        r"--distributed-timeout-minutes 0.2, or lost one \(Timed out waiting 12000ms for recv "
        r"operation to complete\): a rank stalled or died; stopping the job, the last complete "
        r"checkpoint, (iter_\d+), is intact",
        output,
    )
    assert stopped, output[-5000:]
    # torchrun gives the stopped rank 30 s to end on its SIGTERM, then kills it
    assert ended < 12 + 30 + 20, ended
    latest = (ckpt / "latest").read_text()
    assert latest == stopped[2] and int(stopped[1]) >= 5, output[-5000:]
    assert integrity.problems(str(ckpt / latest)) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [["--tensor-model-parallel-size", "2", "--zero-stage", "1"], ["--zero-stage", "3"]],
    ids=["tp2-zero1", "dp2-zero3"],
)
def test_a_killed_rank_restarts_under_torchrun_and_ends_as_an_uninterrupted_run(
    embedded_cache, tmp_path, flags
):
    """torchrun --max-restarts 1, --load the --save folder: one rank killed (SIGKILL) mid-run
    brings the group back, which resumes from the last complete checkpoint with no flag changed
    (the dead job's lock taken over) and ends with an uninterrupted run's weights, bit for bit."""
    ckpt, straight = str(tmp_path / "ckpt"), str(tmp_path / "straight")
    argv = tiny_argv(embedded_cache, *flags, "--save-interval", "2", iters=10)
    train(2, [*argv, "--save", straight])
    proc = torchrun([*argv, "--save", ckpt, "--load", ckpt], "--max-restarts", "1")
    try:
        for line in proc.stdout:
            if "iteration        5/" in line:
                _job(proc.pid)["ranks"][1].kill()
                break
        output = proc.communicate(timeout=120)[0]
    finally:
        _kill_tree(proc)
    assert proc.returncode == 0, output[-5000:]
    assert "failed (exitcode: -9) local_rank: 1" in output, output[-5000:]
    # the new group starts from iter_0000004, the last complete checkpoint when rank 1 died
    assert "starting at iteration 4" in output, output[-5000:]
    assert len(re.findall(r"iteration +5/ +10 \|", output)) == 1, output[-5000:]
    assert not os.path.exists(os.path.join(ckpt, "job.lock"))
    ours, theirs = full_weights(ckpt), full_weights(straight)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
