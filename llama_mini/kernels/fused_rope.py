"""Fused RoPE for training on the CPU, applied from outside: use_fused_rope(model).

apply_rotary_emb (model.py) is four eager operations over q and k, and autograd replays five
in backward; at a small model's shapes on a CPU each is a pass over the activations that costs
more than its arithmetic. The kernels' rope operator (csrc/rope.cpp) takes the same float32
steps in one pass each way, with its autograd node in C++: the same bits as the model's own
code, forward and gradient, so a run with it is a run without it, faster.
"""

import torch
from torch import nn

from ..model import Attention
from .operators import FLOATS, on_the_cpu, operators, swap_classes


class FusedAttention(Attention):
    """Attention whose RoPE runs the kernels' rope on CPU float32, bfloat16 and float16 with head sizes a
    multiple of 8; the model's own code elsewhere, and under torch.compile (Inductor fuses it)."""

    layer, computes = "fused RoPE", ("model:Attention.rotate", "model:apply_rotary_emb")

    def rotate(self, x, cos, sin):
        if x.is_cpu and x.dtype in FLOATS and x.shape[-1] % 8 == 0 and not torch.compiler.is_compiling():
            return torch.ops.llama_mini.rope(x, cos, sin)
        return super().rotate(x, cos, sin)


def use_fused_rope(model: nn.Module) -> nn.Module:
    """Run model's RoPE fused where the CPU kernels load (each Attention becomes a FusedAttention,
    where Attention.rotate and apply_rotary_emb are the code it was written for); returns model."""
    if on_the_cpu(model) and operators() is not None:
        swap_classes(model, {Attention: FusedAttention})
    return model
