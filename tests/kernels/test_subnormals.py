"""--flush-denormals: subnormal floats read and written as zero on every one of torch's CPU
threads, where torch.set_flush_denormal sets only the calling thread's."""

import subprocess
import sys
from pathlib import Path

import pytest

from llama_mini.kernels import build, subnormals

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh process: the mode stays set for the rest of a process, and torch's threads
# must already be running (a parallel operation first) for the test to mean anything.
FLUSH_ON_TWO_THREADS = """
import torch
from llama_mini.kernels.subnormals import every_thread_flushes, flush_subnormals
torch.set_num_threads(2)
assert not every_thread_flushes()  # subnormals computed as they are
torch.set_flush_denormal(True)
print("torch alone:", every_thread_flushes())
flush_subnormals()
print("flush_subnormals:", every_thread_flushes())
"""


@pytest.mark.usefixtures("kernel_library")
def test_flush_subnormals_reaches_every_thread_where_torchs_own_call_reaches_one():
    done = subprocess.run([sys.executable, "-c", FLUSH_ON_TWO_THREADS], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["torch alone: False", "flush_subnormals: True"], done.stdout


def test_without_the_kernels_the_flag_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(build, "checked", lambda make: (None, "no C++ compiler"))
    with pytest.raises(ValueError, match=r"^--flush-denormals sets each CPU thread through llama_mini's kernels, which are "
                                         r"unavailable here \(no C\+\+ compiler\); leave the flag out$"):
        subnormals.flush_subnormals()
