"""The benchmarks' clocks (benchmarks/timing.py) count a GPU's queued work: they wait for the
device's queue before reading the clock where there is one, and read the host clock alone where
there is none."""

import importlib
import os

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.mark.parametrize("cuda", [True, False], ids=["gpu", "cpu"])
def test_clocks_wait_for_the_gpu_queue_only_where_there_is_one(monkeypatch, cuda):
    monkeypatch.syspath_prepend(BENCHMARKS)  # as the benchmark scripts import it
    timing = importlib.import_module("timing")
    events = []
    monkeypatch.setattr(timing.platform, "has_cuda", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("wait"))
    timing.synchronize()
    assert events == (["wait"] if cuda else [])
    events.clear()
    assert timing.seconds(lambda: events.append("work")) >= 0
    assert events == (["wait", "work", "wait"] if cuda else ["work"])
