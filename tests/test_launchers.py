"""A refusal ends a job under a launcher once: one `error:` line, exit code 2, and torchrun does
not restart it (`megatron_focus/launchers.py`)."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from megatron_focus import launchers

from tiny_runs import ROOT, fresh_world, tiny_argv

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "2"]
DEEPSPEED = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_accelerators"]


def _job(launcher, nprocs, script, argv, env=None):
    command = {
        "torchrun": [*TORCHRUN, "--nproc_per_node", str(nprocs)],
        "deepspeed": [*DEEPSPEED, str(nprocs)],
    }[launcher]
    started = time.time()
    out = subprocess.run(
        [*command, script, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**fresh_world(), **(env or {})},
        timeout=300,
    )
    return out, time.time() - started


def _error_lines(out):
    return [line for line in (out.stdout + out.stderr).splitlines() if "error: " in line]


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_flag_refused_under_a_launcher_is_told_once_and_final(launcher):
    out, took = _job(launcher, 2, "pretrain_gpt.py", ["--num-layers", "0"])
    assert out.returncode == 2, out.stdout + out.stderr
    assert _error_lines(out) == ["error: --num-layers 0: must be at least 1"], out.stderr
    assert "Traceback" not in out.stderr and "ChildFailedError" not in out.stderr
    assert took < 30  # not restarted, nor waited for


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_folder_in_use_under_a_launcher_is_told_once_and_final(
    launcher, embedded_cache, tmp_path
):
    """Found by rank 0 once the process group exists, and told by it alone."""
    holder = subprocess.Popen(["sleep", "300"])
    try:
        ckpt = tmp_path / "ckpt"
        ckpt.mkdir()
        (ckpt / "job.lock").write_text(
            json.dumps({"host": socket.gethostname(), "pid": holder.pid, "started": "then"})
        )
        argv = tiny_argv(embedded_cache, "--save", str(ckpt))
        out, _ = _job(launcher, 2, "pretrain_gpt.py", argv)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 2, out.stdout + out.stderr
    lines = _error_lines(out)
    assert len(lines) == 1 and re.match(
        rf"error: --save {ckpt} is in use by another job \(pid {holder.pid} on ", lines[0]
    ), out.stdout + out.stderr
    assert "ChildFailedError" not in out.stderr


@pytest.mark.slow
def test_a_refusal_of_one_rank_alone_is_still_told():
    """Rank 1 refuses where rank 0 works on: after the grace it tells its own line, and the job
    ends with its code."""
    out, took = _job("torchrun", 2, "tests/refusing_rank.py", [], env={"REFUSING_RANK": "1"})
    assert out.returncode == 2, out.stdout + out.stderr
    assert _error_lines(out) == ["error: rank 1 alone refuses"], out.stderr
    assert launchers.GRACE <= took < 60


@pytest.mark.parametrize(
    "env, agreed, grouped, told",
    [
        ({}, False, False, True),  # no launcher
        ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}, False, False, True),
        ({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1"}, False, False, False),
        # another node's first rank: that node's files may differ
        ({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0"}, False, False, True),
        ({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0"}, True, True, False),
        ({"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}, True, True, True),
        # raised on one rank, after the group formed: its own
        ({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}, False, True, True),
    ],
)
def test_which_rank_tells_a_refusal(monkeypatch, env, agreed, grouped, told):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launchers.speaks(agreed, grouped) is told


def _failure(tmp_path, exitcode, record):
    path = tmp_path / f"error-{exitcode}.json"
    if record is not None:
        path.write_text(json.dumps(record))
    return SimpleNamespace(
        exitcode=exitcode, error_file=str(path), error_file_data=record or {"message": "<NONE>"}
    )


def test_torchrun_honours_only_failures_declared_final(tmp_path, monkeypatch):
    """The agent's monitor ends the job with the declaring worker's code; any other failure
    (no error file, torch's own traceback record, another category) goes on to restarts."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    launchers.declare_final("error: nope")
    final = json.loads(error_file.read_text())
    results = iter(
        [
            SimpleNamespace(failures={}),
            SimpleNamespace(failures={0: _failure(tmp_path, 1, None)}),
            SimpleNamespace(
                failures={0: _failure(tmp_path, 1, {"message": {"message": "Traceback ..."}})}
            ),
            SimpleNamespace(
                failures={
                    1: _failure(tmp_path, -15, None),
                    0: _failure(tmp_path, 2, final),
                }
            ),
        ]
    )

    class Agent:
        def _monitor_workers(self, worker_group):
            return next(results)

    launchers.honour_final_failures(Agent)
    launchers.honour_final_failures(Agent)  # once only
    agent = Agent()
    for _ in range(3):
        assert agent._monitor_workers(None) is not None
    with pytest.raises(SystemExit) as ended:
        agent._monitor_workers(None)
    assert ended.value.code == 2
    assert final["errorTraits"] == {"category": launchers.FINAL, "retryability": "False"}
