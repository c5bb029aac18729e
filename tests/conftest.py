import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/distributed.py


@pytest.fixture(scope="session")
def single_process():
    """torch.distributed and Megatron's parallel state for a world of one (TP=1)."""
    from megatron_focus import platform

    return platform.init_distributed(1)
