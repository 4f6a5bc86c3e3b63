"""llama.cpp's K-quant Q5_K as its GGUF files hold it: the int5 layer.

A GGUF file's Q5_K matrices (every Q5_K_M file has them) are carried into this layer code for code
and scale for scale (gguf_blocks.py), so that a file runs in about its own size and at its own
precision. It computes layers.py's function, quantized_activations(x) W^T, with W its dequantized
weights; --quantize makes int8 and int4 only. (Q6_K is read where the file maps it: q6_k.py.)
"""

import torch
from torch import nn

from .layers import quantized_linear, rows_of_sets
from .layout import BLOCK, ROW_SET, deinterleave_rows, interleave_rows, pack_int5, unpack_int5


class KQuantLinear(nn.Module):
    """One of llama.cpp's K-quants as its GGUF file holds it, codes of `bits` bits in sets of eight
    rows (layout.py), their factors (FACTORS: name, inputs each covers, dtype) in sets too,
    super-groups of 256 inputs; the weights, float32, are the subclass's function of the codes
    (weights)."""

    super_group_size, rows_of_8, float_dtype, activation_block = 256, True, torch.float32, BLOCK

    def __init__(self, in_features: int, out_features: int, device=None):
        super().__init__()
        if in_features % self.super_group_size or out_features % ROW_SET:
            raise ValueError(f"int{self.bits} needs inputs in multiples of {self.super_group_size} and outputs in multiples "
                             f"of {ROW_SET}, not {in_features} -> {out_features}")
        self.in_features, self.out_features = in_features, out_features
        sets = out_features // ROW_SET
        self.register_buffer("weight", torch.empty(sets, self.bits * in_features, dtype=torch.uint8, device=device))
        for name, inputs, dtype in self.FACTORS:
            self.register_buffer(name, torch.empty(sets, in_features // inputs * ROW_SET, dtype=dtype, device=device))

    def store_rows(self, start: int, codes: torch.Tensor, *factors: torch.Tensor) -> None:
        """Rows start .. start + len(codes) (multiples of eight) of the codes as uint8 (rows, in) and
        of each factor in FACTORS' order (rows, in / the inputs it covers)."""
        sets = slice(start // ROW_SET, (start + len(codes)) // ROW_SET)
        self.weight[sets] = self.pack(codes)
        for (name, _, _), t in zip(self.FACTORS, factors, strict=True):
            getattr(self, name)[sets] = interleave_rows(t)

    def codes(self) -> torch.Tensor:
        """The codes as uint8 (out_features, in_features)."""
        return self.unpack(self.weight)

    def dequantize(self, dtype=None) -> torch.Tensor:
        """W (out_features, in_features), computed in float32, in dtype (default float32)."""
        return self.weights(self.codes()).to(dtype or self.float_dtype)

    def rows(self, ids: torch.Tensor, dtype=None) -> torch.Tensor:
        """Rows ids of W, (len(ids), in_features) in dtype (default float32), dequantizing the
        sets of eight rows that hold them only."""
        codes = self.unpack(self.weight[ids // ROW_SET]).view(len(ids), ROW_SET, -1)[torch.arange(len(ids)), ids % ROW_SET]
        return self.weights(codes, ids).to(dtype or self.float_dtype)

    def forward(self, x):
        return quantized_linear(self, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits} groups of {self.group_size}"


class Int5Linear(KQuantLinear):
    """y = quantized_activations(x) W^T with W = q (d sc) - dmin m: 5-bit codes q (0..31) in groups
    of 32 inputs, each with uint8 factors sc and m, and float16 d and -dmin per row and 256 inputs.
    It is llama.cpp's Q5_K as the file holds it (5.5 bits a weight; here 5.75): Int4Linear's
    factored form with a fifth bit, exact in float32 as Q4_K's is (layout.py's int5)."""

    bits, group_size = 5, 32
    FACTORS = (("scales", 32, torch.uint8), ("offsets", 32, torch.uint8), ("super_scales", 256, torch.float16),
               ("super_offsets", 256, torch.float16))
    pack, unpack = staticmethod(pack_int5), staticmethod(unpack_int5)

    def group_scales_and_offsets(self, ids=None):
        """(d sc, -dmin m), each (out_features, groups) in float32; of rows ids only, where given."""
        rows = deinterleave_rows if ids is None else lambda t: rows_of_sets(t, ids)
        per = self.super_group_size // self.group_size
        return tuple(rows(supers).float().repeat_interleave(per, dim=1) * rows(factors).float()
                     for supers, factors in ((self.super_scales, self.scales), (self.super_offsets, self.offsets)))

    def weights(self, codes: torch.Tensor, ids=None) -> torch.Tensor:
        """q (d sc) + (-dmin m) of codes (rows, in): all rows, or rows ids."""
        scales, offsets = self.group_scales_and_offsets(ids)
        w = codes.view(len(codes), -1, self.group_size).float().mul_(scales[..., None]).add_(offsets[..., None])
        return w.view(len(codes), -1)
