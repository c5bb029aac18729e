"""Calls whose shapes repeat, replayed as CUDA graphs: what is left of a small call's time on a
GPU is the host's (Python, guards, one launch after another), and a replay is one launch.

A call is captured at its second arrival with the same signature (its first compiled and timed
what it launches) and replayed from the third on. Its tensor inputs are copied into the graph's
own buffers and its outputs copied out, as torch.cuda.make_graphed_callables does, so a replay
never aliases an earlier result. A graph holds no autograd history, so the calls are those
outside autograd (inference, evaluation, the exported model's prefill) and the two halves of an
autograd function (a training forward, its backward: a graph each). Graphs are kept for the
last few signatures, each with its buffers and memory pool.
"""

import collections
import warnings
from typing import Callable

import torch


def cuda_capture(function: Callable, static: tuple):
    """(replay, output) of `function(*static)` captured as a CUDA graph, after a run on a side
    stream (the warm-up PyTorch's CUDA-graph notes ask for). Only this thread's calls are held
    to the capture's rules: a data loader's thread pinning memory meanwhile is not stopped."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        function(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        output = function(*static)
    return graph.replay, output


def signature(tensors: tuple, settings: tuple) -> tuple:
    """What a graph depends on: each tensor's shape, strides, dtype and device (None kept),
    and the call's other settings."""
    described = tuple(
        None if t is None else (tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors
    )
    return described, settings


def _inside_a_capture() -> bool:
    """Whether the caller is itself being captured (a whole model's graph): the call then joins
    that graph as it runs, since a graph cannot be captured inside another."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Graphs:
    """`graphs(function, tensors, settings)`: function(*tensors) (a tensor or a tuple of them),
    replayed from a graph where the same signature came before. `capture` makes (replay,
    output) of a call (CUDA graphs; tests give a stand-in); a signature whose capture fails
    runs eagerly from then on, said once. Capacity 0: never captured."""

    def __init__(self, capacity: int = 4, capture: Callable = cuda_capture):
        self.capacity = capacity
        self.capture = capture
        self.seen: set = set()
        self.failed: set = set()
        self.graphs: collections.OrderedDict = collections.OrderedDict()

    def __call__(self, function: Callable, tensors: tuple, settings: tuple) -> torch.Tensor:
        key = signature(tensors, settings)
        if key in self.failed or not self.capacity or _inside_a_capture():
            return function(*tensors)
        if key not in self.graphs:
            if key not in self.seen:
                self.seen.add(key)
                return function(*tensors)
            if not self._captured(function, tensors, key):
                return function(*tensors)
        self.graphs.move_to_end(key)
        replay, static, output = self.graphs[key]
        for buffer, tensor in zip(static, tensors):
            if buffer is not None:
                buffer.copy_(tensor)
        replay()
        return _cloned(output)

    def _captured(self, function: Callable, tensors: tuple, key: tuple) -> bool:
        static = tuple(None if t is None else t.clone() for t in tensors)
        try:
            replay, output = self.capture(function, static)
        except Exception as error:  # noqa: BLE001 -- any capture failure: eager from then on
            self.failed.add(key)
            warnings.warn(f"a call could not be captured as a CUDA graph; it runs eagerly "
                          f"({error})")  # fmt: skip
            return False
        self.graphs[key] = (replay, static, output)
        while len(self.graphs) > self.capacity:
            self.graphs.popitem(last=False)
        return True


def _cloned(output):
    return tuple(t.clone() for t in output) if isinstance(output, tuple) else output.clone()
