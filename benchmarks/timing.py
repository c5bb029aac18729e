"""One call's time, shared by the benchmark scripts: wall clock, and on a GPU the host's share
(launching) apart from the device's (CUDA events around the queued kernels)."""

import dataclasses
import time

import torch

from megatron_focus import platform


class HostEvent:
    """A CUDA event's interface on the host clock: where no device queue runs apart from the
    host (the CPU), device time is wall time, measured by the same code as on a GPU."""

    def __init__(self, enable_timing: bool = True):
        self.at = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end.at - self.at) * 1e3


@dataclasses.dataclass(frozen=True)
class Timing:
    """`host`: seconds until fn() returned (on a GPU, what launching its kernels costs);
    `device`: seconds from the first of its kernels starting to the last one ending."""

    host: float
    device: float


def synchronize() -> None:
    """Waits for a GPU's queued kernels (nothing to wait for on the CPU): a clock read after it
    counts their work."""
    if platform.has_cuda():
        torch.cuda.synchronize()


def timed(fn, event=None) -> Timing:
    """fn()'s host and device time (`event`: the event class, CUDA's on a GPU)."""
    event = event or (torch.cuda.Event if platform.has_cuda() else HostEvent)
    start, end = event(enable_timing=True), event(enable_timing=True)
    synchronize()
    launched = time.perf_counter()
    start.record()
    fn()
    end.record()
    host = time.perf_counter() - launched
    end.synchronize()
    return Timing(host, start.elapsed_time(end) / 1e3)


def seconds(fn) -> float:
    """Seconds that fn() takes; on a GPU, its queued kernels included (synchronised around)."""
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start
