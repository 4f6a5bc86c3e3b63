"""Subnormal floats read and written as zero on every CPU thread: train.py's --flush-denormals.

x86 CPUs compute on subnormal floats (below 1.2e-38) in microcode, up to a hundred times
slower. A training run whose activations and gradients meet them slows as it trains, by a
different amount in each seed (docs/ablation.md), enough to hide a difference of a few percent
in speed. The mode is each thread's own, and torch.set_flush_denormal sets only the calling
thread's, so the kernels' operator sets it on each of torch's threads (csrc/subnormals_op.cpp).
"""

import torch

from . import build


def flush_subnormals() -> None:
    """From now on, for the rest of the process, every CPU thread of torch's reads and writes
    subnormal floats as zero; one line where that cannot be done."""
    ops, why = build.checked(lambda: torch.ops.llama_mini)
    if ops is None:
        raise ValueError(f"--flush-denormals sets each CPU thread through llama_mini's kernels, which are unavailable "
                         f"here ({why}); leave the flag out")
    if not ops.flush_subnormals(True) or not every_thread_flushes():
        ops.flush_subnormals(False)
        raise ValueError("--flush-denormals: this CPU cannot read and write subnormal floats as zero on every thread; "
                         "leave the flag out")


def every_thread_flushes() -> bool:
    """Whether an operation torch spreads over all its threads writes a subnormal input as zero."""
    n = 2 * torch.get_num_threads() * 32768  # each thread's share above torch's grain of 32768 elements
    smallest = torch.ones(n, dtype=torch.int32).view(torch.float32)  # 1.4e-45, made from its bits
    return not smallest.mul(1.0).view(torch.int32).any()
