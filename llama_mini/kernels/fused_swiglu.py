"""Fused SwiGLU for training on the CPU, applied from outside: use_fused_swiglu(model).

FeedForward's gate, silu(w1 x) * w3 x, is two eager operations, each a pass over the hidden
activations, and autograd replays three in backward (mul, silu_backward, mul): on a CPU about a
tenth of a small model's training step (docs/train_vs_nanogpt.md). The kernels' swiglu
operator (csrc/swiglu.cpp) computes it in one pass each way, with its autograd node in C++.

Its silu is the kernels' own (every element computed alike, within 2 ulp of expf), as on the
kernels' decoding path; torch's rounds a tensor's last few elements differently. The same
function, other roundings: a run with it is not bit for bit one without it, and resumes
exactly, as every element's result depends on nothing but its inputs.
"""

import torch
from torch import nn

from ..model import FeedForward
from .operators import FLOATS, on_the_cpu, operators, swap_classes


class FusedFeedForward(FeedForward):
    """FeedForward whose gate runs the kernels' swiglu on CPU float32, bfloat16 and float16; its own
    code elsewhere, and under torch.compile (Inductor fuses it by itself)."""

    layer, computes = "fused SwiGLU", ("model:FeedForward.gate",)

    def gate(self, a, b):
        if a.is_cpu and a.dtype in FLOATS and not torch.compiler.is_compiling():
            return torch.ops.llama_mini.swiglu(a, b)
        return super().gate(a, b)


def use_fused_swiglu(model: nn.Module) -> nn.Module:
    """Run model's feed-forward gates fused where the CPU kernels load (each FeedForward becomes
    a FusedFeedForward, where FeedForward.gate is the code it was written for); returns model."""
    if on_the_cpu(model) and operators() is not None:
        swap_classes(model, {FeedForward: FusedFeedForward})
    return model
