"""A first run of `pretrain_gpt.py` on a fresh machine: no silent one-time build, where its files go
named before the first step, and Ctrl-C (a terminal's, to the whole process group) in one line."""

import os
import re
import signal
import subprocess
import sys

from tiny_runs import ROOT, tiny_argv

ITERATION_LINE = "iteration        1/"


def test_first_run_names_its_folders_builds_nothing_and_stops_on_ctrl_c(embedded_cache, tmp_path):
    ckpt, tb, extensions = (str(tmp_path / name) for name in ("ckpt", "tb", "extensions"))
    argv = tiny_argv(embedded_cache, "--save", ckpt, "--tensorboard-dir", tb, iters=10_000)
    # A fresh machine's extension cache; a world of one, not this pytest process's rendezvous.
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        },
        "TORCH_EXTENSIONS_DIR": extensions,
    }
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    before = []
    try:
        for line in proc.stdout:
            if ITERATION_LINE in line:
                os.killpg(proc.pid, signal.SIGINT)
                break
            before.append(line)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert f"Checkpoints: {ckpt}\n" in before, "".join(before)
    assert any(line.startswith(f"TensorBoard logs: {tb} ") for line in before), "".join(before)
    assert not os.path.exists(extensions), os.listdir(extensions)

    assert proc.returncode == 130, stderr[-3000:]
    # libraries' own log lines (DeepSpeed's accelerator probe, torch's "W1130 ..." C++ logging)
    # are not the command's words
    # multiprocessing's fd-sharing thread, whose peer the same Ctrl-C stopped, may print its
    # ConnectionResetError: Python's, not the command's
    sharer = "multiprocessing/resource_sharer.py" in stderr
    lines = [
        line
        for line in stderr.splitlines()
        if line.strip()
        and "[WARNING]" not in line
        and "warn" not in line.lower()
        and not re.match(r"[IWEF]\d{4} \d\d:\d\d:\d\d", line)  # torch's C++ log lines
        and not (sharer and re.match(r"\[rank\d+\]: ", line))
    ]
    assert lines == [
        "interrupted (Ctrl-C): nothing saved since the last checkpoint; with "
        "--exit-signal-handler, Ctrl-C saves and then stops"
    ], stderr[-3000:]
