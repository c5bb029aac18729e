"""This rank's micro-batches, in training order, through a `torch.utils.data.DataLoader`.

The sample stream is a pure function of the number of samples consumed: global batch t is
samples [t * G, (t + 1) * G) (G the global batch size, indices modulo the dataset's length), and
micro-batch m of data-parallel rank r takes its slice [m * mbs * dp + r * mbs, ... + mbs). So a
resumed run, started at its checkpoint's consumed-sample count, reads exactly the batches the
uninterrupted run would have; tensor-parallel ranks of one replica read the same samples.

Worker processes read and collate ahead of the step (`--num-workers`, Megatron's flag), into
pinned memory on a GPU, so the loop never waits on per-sample indexing. They ignore SIGTERM and
SIGINT from anyone but the training process: a scheduler's or a terminal's signal reaches the whole
process group, and the trainer, not its workers, decides how the run ends (`--exit-signal-handler`
saves first).
"""

import os
import signal
import sys
import threading
from typing import Iterator, List

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class MicroBatchSampler(Sampler[List[int]]):
    """Sample indices of one data-parallel rank's micro-batches, from `consumed` to `total`."""

    def __init__(
        self,
        dataset_size: int,
        consumed: int,
        total: int,
        micro_batch_size: int,
        data_parallel_size: int,
        data_parallel_rank: int,
    ):
        if dataset_size <= 0:
            raise ValueError("the dataset has no samples")
        self.size, self.consumed, self.total = dataset_size, consumed, total
        self.mbs, self.dp, self.rank = micro_batch_size, data_parallel_size, data_parallel_rank

    def __len__(self) -> int:
        return max(0, self.total - self.consumed) // (self.mbs * self.dp)

    def __iter__(self) -> Iterator[List[int]]:
        step = self.mbs * self.dp
        for start in range(self.consumed, self.consumed + len(self) * step, step):
            first = start + self.rank * self.mbs
            yield [(first + i) % self.size for i in range(self.mbs)]


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _ignore_stop_signals(worker_id: int) -> None:
    """A worker's `worker_init_fn`: SIGTERM and SIGINT wait for a thread that ends the worker only
    when the training process sends one, as it does to a worker that outlived its iterator when
    the interpreter exits (a worker ignoring that would hang the exit). Workers still end when
    the training process dies: torch's workers watch their parent."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # inherited by the thread below
    threading.Thread(target=_end_when_parent_asks, args=(os.getppid(),), daemon=True).start()


def _end_when_parent_asks(parent: int) -> None:
    while True:
        if signal.sigwaitinfo(_STOP_SIGNALS).si_pid == parent:
            os._exit(0)  # as torch's own SIGTERM handler ends a worker its parent terminates


def micro_batches(
    dataset: Dataset,
    consumed: int,
    total: int,
    micro_batch_size: int,
    data_parallel_size: int,
    data_parallel_rank: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent: bool = False,
) -> DataLoader:
    """A DataLoader of this rank's micro-batches (dicts of [mbs, ...] tensors) for samples
    [consumed, total) of the stream; `persistent` keeps its workers between passes (a
    validation set read at every evaluation)."""
    sampler = MicroBatchSampler(
        len(dataset), consumed, total, micro_batch_size, data_parallel_size, data_parallel_rank
    )
    # A generator of its own: each iterator draws its workers' base seed from it, which would
    # otherwise advance the global RNG that dropout draws from (and break exact resume).
    # Workers are forked on Linux, also from a process that was itself spawned (whose children
    # would otherwise be spawned too, each importing torch and Megatron again); they never
    # touch CUDA.
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=2 if num_workers else None,
        persistent_workers=persistent and num_workers > 0,
        multiprocessing_context="fork" if num_workers and sys.platform == "linux" else None,
        # where Python has no sigwaitinfo (macOS), workers keep torch's signal handling
        worker_init_fn=_ignore_stop_signals if hasattr(signal, "sigwaitinfo") else None,
        generator=torch.Generator().manual_seed(0),
    )


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch on `device`, copied asynchronously from pinned memory on a GPU."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
