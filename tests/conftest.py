import collections
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/distributed.py

# Without a GPU, Triton's kernels run under its interpreter on CPU tensors; Triton reads this when
# it is imported, so it is set before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """The files with the most slow tests first, the rest in their order: pytest-xdist hands
    each file whole to one of its workers in this order (pytest.ini), so the long files start
    early and neither worker is left alone with one at the end."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: each file's tests stay in order


@pytest.fixture(scope="session")
def single_process():
    """torch.distributed and Megatron's parallel state for a world of one (TP=1)."""
    from megatron_focus import platform

    return platform.init_distributed(1)


@pytest.fixture(scope="session")
def embedded_cache(tmp_path_factory):
    """The embedded corpus and tokenizer, built once for the whole test session."""
    from megatron_focus.data.embedded import ensure_embedded_data

    cache = str(tmp_path_factory.mktemp("cache"))
    ensure_embedded_data(cache)
    return cache


@pytest.fixture
def forbid_topk(monkeypatch):
    """Call it to make torch.topk raise from then on in the test: its order of tied entries
    depends on k, so no Focus path may rank groups with it (model/focus/groups.py)."""
    import torch

    def refuse(*args, **kwargs):
        raise AssertionError("torch.topk called: its tie order depends on k")

    def forbid():
        monkeypatch.setattr(torch, "topk", refuse)
        monkeypatch.setattr(torch.Tensor, "topk", refuse)

    return forbid


@pytest.fixture
def cpu_varlen(monkeypatch):
    """torch's CUDA-only varlen flash ops run on CPU tensors (varlen.py) for the test; the
    fixture's value counts their forward and backward calls."""
    from varlen import varlen_on_the_cpu

    with varlen_on_the_cpu(monkeypatch) as calls:
        yield calls


@pytest.fixture
def run_tool():
    """`run_tool("tools/eval_ppl.py", *args)`: a script of this repository in a subprocess, from
    its root, without this test process's torch.distributed rendezvous variables."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }

    def run(script, *args):
        return subprocess.run(
            [sys.executable, script, *map(str, args)],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
        )

    return run
