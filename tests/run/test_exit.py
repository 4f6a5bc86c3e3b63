"""How train.py's process ends: one of K under torchrun skips Python's shutdown, where a
thread of torch's gloo backend that still drops a collective's tensors would abort it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import atexit, sys
from llama_mini.run.distributed import exit_process
atexit.register(lambda: print("shut down"))
print("output", end="")
print("warning", file=sys.stderr, end="")
exit_process(3)
"""


@pytest.mark.parametrize("world_size, shut_down", [("1", True), ("2", False)])
def test_exit_process_keeps_the_code_and_the_output_and_skips_shutdown_only_among_several(world_size, shut_down):
    env = {**os.environ, "WORLD_SIZE": world_size}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 3
    assert proc.stdout.startswith("output") and proc.stderr == "warning"
    assert ("shut down" in proc.stdout) == shut_down
