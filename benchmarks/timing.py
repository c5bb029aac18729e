"""One call's wall-clock time, shared by the benchmark scripts."""

import time

import torch

from megatron_focus import platform


def seconds(fn) -> float:
    """Seconds that fn() takes; on a GPU, its queued kernels included (synchronised around)."""
    sync = torch.cuda.synchronize if platform.has_cuda() else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start
