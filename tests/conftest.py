import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/distributed.py


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
