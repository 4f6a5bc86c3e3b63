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


@pytest.fixture
def kernel_library():
    """Skip where the CPU kernels' library does not build (no compiler): what needs its
    operators, not its vector code (which operators() also needs)."""
    from llama_mini.kernels import build

    why = build.checked(lambda: None)[1]
    if why is not None:
        pytest.skip(f"the CPU kernels do not build here: {why}")
