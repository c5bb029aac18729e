"""Run a function in N processes over gloo on localhost, as the multi-process tests need."""

import os
import pickle
import socket
import tempfile

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, out_path, fn, args):
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
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            out_path = os.path.join(tmp, "result.pkl")
            try:
                mp.start_processes(
                    _worker,
                    args=(world_size, _free_port(), out_path, fn, args),
                    nprocs=world_size,
                    join=True,
                    start_method="spawn",
                )
            except mp.ProcessRaisedException as e:
                if "EADDRINUSE" in str(e) and attempt < 2:
                    continue
                raise
            with open(out_path, "rb") as f:
                return pickle.load(f)
