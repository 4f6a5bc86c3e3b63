"""The linear operators' outputs on fixed inputs (float32 and bfloat16; tails of rows, tiles and
inputs), for comparing two builds of the kernels. A bf16 x bf16 dense layer is left out: it
uses a CPU's bf16 dot products where it has them (csrc/simd.h), a different order of sums."""

import torch

from llama_mini.quant.layers import Int4Linear, Int8Linear


def linear_outputs(ops) -> list:
    g = torch.Generator().manual_seed(0)
    outputs = []
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(37, 256, generator=g).to(dtype), torch.randn(72, 256, generator=g).to(dtype)
        int8, int4 = Int8Linear.from_weight(w), Int4Linear.from_weight(w)
        if dtype == torch.float32:
            outputs += [ops.linear_dense(x, w), ops.linear_dense(x[:, :250].contiguous(), w[:, :250].contiguous())]
        outputs += [ops.linear_int8(x, int8.weight, int8.scales), ops.linear_int4(x, int4.weight, int4.scales, int4.zeros)]
    return outputs
