"""The integer layers' outputs (int8, int4, symmetric too, and GGUF's Q5_K and Q6_K) on fixed inputs (float32 and bfloat16 activations; tails of rows
and tiles), for comparing builds of the kernels for two instruction sets: their sums are exact
integers, then the same float32 steps in the same order, on either. (The dense layers sum in
sixteen lanes with AVX-512 and eight with AVX2: the same function, other roundings.)"""

import torch

from llama_mini.quant.layers import Int4Linear, Int8Linear


def linear_outputs(ops) -> list:
    g = torch.Generator().manual_seed(0)
    outputs = []
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(37, 256, generator=g).to(dtype), torch.randn(72, 256, generator=g).to(dtype)
        int8, int4 = Int8Linear.from_weight(w), Int4Linear.from_weight(w)
        factors = torch.randint(0, 64, (2, 72, 8), generator=g, dtype=torch.uint8)  # K-quants' factored scales and offsets
        factored = Int4Linear.from_codes(int4.codes(), *factors, 32, torch.rand(72, 1, generator=g), -torch.rand(72, 1, generator=g))
        outputs += [ops.linear_int8(x, int8.weight, int8.scales), ops.linear_int4(x, int4.weight, int4.scales, int4.offsets),
                    ops.linear_int4(x, int4.weight, int4.scales, None),  # symmetric (GGUF's Q4_0): offsets -8 scales
                    ops.linear_int4(x, factored.weight, factored.scales, factored.offsets, factored.super_scales,
                                    factored.super_offsets)]
        q5_k = torch.randint(0, 256, (76, 1, 176), generator=g, dtype=torch.uint8)  # GGUF's Q5_K: random bytes, d and dmin 0.5 .. 1
        q5_k[..., :4] = (torch.rand(76, 1, 2, generator=g) / 2 + 0.5).half().view(torch.uint8).view(76, 1, 4)
        q6_k = torch.randint(0, 256, (76, 1, 210), generator=g, dtype=torch.uint8)  # GGUF's Q6_K: random bytes, a d of 0.5 .. 1
        q6_k[..., 208:] = (torch.rand(76, 1, 1, generator=g) / 2 + 0.5).half().view(torch.uint8)
        for rows in (x, x[:3]):  # a prompt's rows (widened) and a decoding step's (read in place)
            outputs += [ops.linear_k_quant(rows, q5_k), ops.linear_k_quant(rows, q6_k)]
    return outputs
