"""Calls replayed as CUDA graphs (model/kernels/graphs.py), with a stand-in for the graph that
keeps what a CUDA graph keeps: the buffers and the output's storage fixed at capture, each
replay recomputing from the buffers into that storage."""

import warnings

import pytest
import torch

from megatron_focus.model.kernels import graphs


def replayed_capture(function, static):
    output = function(*static)
    outputs = output if isinstance(output, tuple) else (output,)

    def replay():
        results = function(*static)
        for fixed, result in zip(outputs, results if isinstance(results, tuple) else (results,)):
            fixed.copy_(result)

    return replay, output


def _graphs(capacity=4):
    captured = []

    def capture(function, static):
        captured.append(tuple(None if t is None else t.shape for t in static))
        return replayed_capture(function, static)

    return graphs.Graphs(capacity, capture), captured


def _scaled(x, y, bias):
    return x * y + (0 if bias is None else bias)


def test_a_repeated_shape_is_captured_once_and_replayed_with_each_calls_inputs():
    calls, captured = _graphs()
    gen = torch.Generator().manual_seed(0)
    results, inputs = [], []
    for _ in range(4):
        x, y = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
        inputs.append((x, y))
        results.append(calls(_scaled, (x, y, None), ("settings",)))
    assert captured == [((3, 5), (3, 5), None)]  # at the second call; the third and fourth replay
    for (x, y), result in zip(inputs, results):  # each its own, none overwritten by a later one
        torch.testing.assert_close(result, x * y)


def test_a_tuple_of_outputs_each_copied_out():
    calls, captured = _graphs()
    gen = torch.Generator().manual_seed(1)
    results, inputs = [], []
    for _ in range(3):
        x = torch.randn(4, generator=gen)
        inputs.append(x)
        results.append(calls(lambda x: (x + 1, x * 2), (x,), ()))
    assert len(captured) == 1
    for x, (plus, twice) in zip(inputs, results):
        torch.testing.assert_close(plus, x + 1)
        torch.testing.assert_close(twice, x * 2)


def test_signatures_apart_by_shape_stride_and_settings_and_the_oldest_dropped():
    calls, captured = _graphs(capacity=2)
    x = torch.randn(4, 6)
    for _ in range(2):
        calls(_scaled, (x, x, None), (1,))
        calls(_scaled, (x, x, None), (2,))  # other settings
        calls(_scaled, (x.t(), x.t(), None), (1,))  # other strides
        calls(_scaled, (x[:2], x[:2], x[:2]), (1,))  # other shapes, a bias
    assert len(captured) == 4 and len(calls.graphs) == 2
    torch.testing.assert_close(calls(_scaled, (x, x, None), (1,)), x * x)  # captured again
    assert len(captured) == 5


def test_a_failed_capture_runs_eagerly_said_once():
    def broken(function, static):
        raise RuntimeError("operation not permitted when stream is capturing")

    calls = graphs.Graphs(capture=broken)
    x = torch.randn(3)
    calls(_scaled, (x, x, None), ())
    with pytest.warns(UserWarning, match="could not be captured.*stream is capturing"):
        torch.testing.assert_close(calls(_scaled, (x, x, None), ()), x * x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(calls(_scaled, (x, 2 * x, None), ()), 2 * x * x)


def test_capacity_zero_never_captures():
    calls, captured = _graphs(capacity=0)
    x = torch.randn(3)
    for _ in range(3):
        torch.testing.assert_close(calls(_scaled, (x, x, None), ()), x * x)
    assert captured == []


def test_inside_an_enclosing_capture_the_call_runs_as_it_is(monkeypatch):
    """A whole model being captured: the call joins that graph (no graph of its own)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    calls, captured = _graphs()
    x = torch.randn(3)
    for _ in range(3):
        torch.testing.assert_close(calls(_scaled, (x, x, None), ()), x * x)
    assert captured == []


def test_a_cuda_capture_warms_up_on_a_side_stream_then_records_the_call(monkeypatch):
    """cuda_capture's order, its CUDA objects stood in: the call once on a side stream that
    waits for the current one, the current one waiting for it, then once inside the graph's
    capture (holding only this thread to its rules), whose output and replay it returns."""
    events = []

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            events.append(f"{self.name} waits for {other.name}")

    class Context:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            events.append(f"enter {self.name}")

        def __exit__(self, *exc):
            events.append(f"exit {self.name}")

    class Graph:
        def replay(self):
            events.append("replay")

    current = Stream("current")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: Context(f"{stream.name} stream"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)

    def graph(graph, capture_error_mode):
        return Context(f"{capture_error_mode} capture")

    monkeypatch.setattr(torch.cuda, "graph", graph)

    def function(x):
        events.append("call")
        return x + 1

    replay, output = graphs.cuda_capture(function, (torch.zeros(2),))
    replay()
    assert events == [
        "side waits for current", "enter side stream", "call", "exit side stream",
        "current waits for side", "enter thread_local capture", "call", "exit thread_local capture",
        "replay",
    ]  # fmt: skip
    torch.testing.assert_close(output, torch.ones(2))
