"""Fixtures shared by test files."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module: tiny models run as fast on one as on two, a loaded
    machine stalls two, and runs in subprocesses with OMP_NUM_THREADS=1 then add their sums
    in the same order as the test does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
