"""Run a function in N processes over gloo on localhost, as the multi-process tests need.

The processes fork from a server that imported torch, DeepSpeed and Megatron-Core once per test
process (Python's forkserver): a fresh interpreter would spend ~10 s importing them for every
run, about half of the suite's time. megatron_focus itself is imported fresh in every process
(its variant plugins follow the environment). Each process still starts from this process's
environment, working folder, import path and standard output and error of the moment, as a
spawned one would.
"""

import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
from multiprocessing import reduction

import torch.multiprocessing as mp

PRELOAD = [
    "torch",
    "deepspeed",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.datasets.gpt_dataset",
]


class _Inherited:
    """One of this process's file descriptors, sent to the forked process when it starts."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):  # called while the process is launched: the fd goes with it
        return (_identity, (reduction.DupFd(self.fd),))


def _identity(x):
    return x


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_a_free_port(launch, attempts: int = 3):
    """launch(port) -> a finished subprocess.CompletedProcess of a multi-process launcher; run
    again on a new port while it failed to bind the one given (EADDRINUSE: another process on the
    machine took the free port between its finding and the launcher's binding)."""
    for _ in range(attempts):
        out = launch(_free_port())
        if out.returncode == 0 or "EADDRINUSE" not in out.stdout + out.stderr:
            return out
    return out


def _worker(rank, world_size, port, out_path, fn, args, environ, cwd, path, stdio):
    for target, fd in enumerate(stdio, start=1):
        os.dup2(fd.detach(), target)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    from megatron_focus import platform

    try:
        result = fn(*args)
    finally:
        platform.destroy_distributed()
    if rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump(result, f)


def run_distributed(fn, world_size: int, *args):
    """Call `fn(*args)` on `world_size` ranks; return rank 0's result. Errors propagate.

    The free port is found, then bound by rank 0's store a moment later; another process on the
    machine can take it in between (EADDRINUSE before any work is done): then a new port."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # (once the server runs: no effect)
    sys.stdout.flush()
    sys.stderr.flush()
    here = (dict(os.environ), os.getcwd(), list(sys.path), [_Inherited(1), _Inherited(2)])
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            out_path = os.path.join(tmp, "result.pkl")
            try:
                mp.start_processes(
                    _worker,
                    args=(world_size, _free_port(), out_path, fn, args, *here),
                    nprocs=world_size,
                    join=True,
                    start_method="forkserver",
                )
            except mp.ProcessRaisedException as e:
                if "EADDRINUSE" in str(e) and attempt < 2:
                    continue
                raise
            with open(out_path, "rb") as f:
                return pickle.load(f)
