"""Every instruction set a CPU may run the kernels with, on this machine: each variant this CPU
executes below its own (LLAMA_MINI_ISA, kernels/build.py) is built, and the kernel tests run
against it in a child process. A machine with AVX-512 thereby tests the AVX2 code most users
run, and the x86-64 build that has no vector kernels (the layers on torch's code, the fused
norm in plain C++)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llama_mini.kernels import build
from llama_mini.kernels.operators import operators

ROOT = Path(__file__).resolve().parents[2]
# The tests of the kernels' numbers: operators, a model on the kernels, the fused norm and gate, the
# integer layers against their definition, speculative decoding's exactness, which rests on each
# row computed alone (not those of the build's machinery, the same for all).
KERNEL_TESTS = ["tests/kernels/test_matvec.py", "tests/kernels/test_one_function.py", "tests/kernels/test_fused_rmsnorm.py",
                "tests/kernels/test_fused_swiglu.py", "tests/kernels/test_fused_rope.py",
                "tests/quant/test_quantize.py", "tests/test_speculative.py", "tests/formats/test_gguf_blocks.py"]
# The first instruction set this CPU executes is its own (the native build, which the suite ran
# already); the others are those below it.
BELOW_NATIVE = build.runnable_isas()[1:]
pytestmark = pytest.mark.slow  # a build of the kernels and a child pytest per instruction set: minutes each


def in_child(isa: str, *args, timeout=1800) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLAMA_MINI_ISA": isa}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


def kernels_load(isa: str) -> subprocess.CompletedProcess:
    """Whether a child process built for isa loads vector kernels that pass their self-check: "True" on stdout."""
    return in_child(isa, "-c", "from llama_mini.kernels.operators import operators; print(operators() is not None)")


def test_this_cpus_own_build_has_its_kernels():
    """The suite runs the kernel tests on this CPU's own build, and they skip where a CPU has no
    kernels. On a CPU with AVX2 and FMA, kernels that failed to build or failed their self-check
    against the core would make them skip in the same way, so that is a failure here. A machine
    without a C++ compiler is the exception."""
    if "avx2" not in build.runnable_isas():
        pytest.skip("no vector kernels for this CPU (they need x86-64 with AVX2 and FMA)")
    result = kernels_load("native")
    if "no C++ compiler found" in result.stderr:
        pytest.skip("no C++ compiler on this machine")
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr


@pytest.mark.parametrize("isa", BELOW_NATIVE)
def test_the_kernel_tests_pass_built_for_every_instruction_set_this_cpu_runs(isa):
    has_vectors = kernels_load(isa)
    assert has_vectors.returncode == 0 and has_vectors.stdout.strip() == str(isa != "x86-64"), has_vectors.stderr
    result = in_child(isa, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS, "-k", "not build")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


LINEAR_OUTPUTS = r"""
import sys, torch
sys.path.insert(0, "tests/kernels")
from llama_mini.kernels.operators import operators
from linear_outputs import linear_outputs
torch.save(linear_outputs(operators()), sys.argv[1])
"""


@pytest.mark.parametrize("isa", [isa for isa in BELOW_NATIVE if isa != "x86-64"])
def test_the_integer_layers_give_the_same_numbers_under_every_instruction_set(isa, tmp_path):
    """int8 and int4 sum each block exactly as integers, then take the same float32 steps in
    the same order, in sixteen lanes or two halves of eight: the same bits on every CPU."""
    ops = operators()
    if ops is None:
        pytest.skip("no vector kernels on this CPU")
    from linear_outputs import linear_outputs

    result = in_child(isa, "-c", LINEAR_OUTPUTS, str(tmp_path / "theirs.pt"))
    assert result.returncode == 0, result.stderr
    theirs, ours = torch.load(tmp_path / "theirs.pt"), linear_outputs(ops)
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))
