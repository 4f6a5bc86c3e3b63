"""int8 and int4 linear layers: the function each computes, in plain torch.

Decoding one token reads every weight once, so on a CPU tokens/s is bounded by memory
bandwidth / weight bytes: fewer bytes per weight is the speed-up. Both layers compute

    y = quantized_activations(x) @ W^T

with W the dequantized weight and quantized_activations(x) the input rounded to int8 in blocks
of 32 along its features (llama.cpp's Q8_0 activations), whatever the number of rows, so a
prompt's logits do not depend on what else is in its batch or how it was cut into calls. The
arithmetic is float32 (autocast or not) and y has x's dtype. This is the definition the CPU
kernels (kernels/matvec.py) are held to; here it is computed directly (quantized_linear).

- int8: symmetric, one scale per row and block of 32 inputs (the last block shorter where the
  inputs are not a multiple of 32): w ~= q * scale, q in [-127, 127]. llama.cpp's Q8_0 at the
  same bytes per weight with bf16 or fp16 scales: a block's scale follows the few weights it
  covers, where one scale per row must span the row's largest.
- int4: groups of `group_size` consecutive inputs of a row (default 32, llama.cpp's Q4_0 block),
  asymmetric: w ~= q * scale + offset, q in [0, 15], where offset is the value code 0 stands
  for. Sixteen levels are few, so spanning each group's [min, max] (rather than a symmetric
  [-absmax, absmax], which wastes a level or a half range on lopsided groups) matters. It is
  llama.cpp's own formula for Q4_1 and Q4_K (and Q4_0's, with offset -8 scale), so their blocks
  are carried over exactly (gguf_blocks.py). A layer may hold its scales and offsets factored,
  as llama.cpp's K-quants do (super_group_size): a float factor per super-group of inputs
  times a uint8 per group, 4.63 bits a weight where float32 per group takes 6; their products
  are the scales and offsets, exact in float32 for Q4_K's 16-bit floats and 6-bit integers.
  Such a layer rounds its activations in blocks of its super-group (activation_block), as
  llama.cpp rounds a K-quant's (its Q8_K, 256 inputs for Q4_K).
The layers of GGUF's Q5_K and Q6_K blocks (k_quants.py) compute the same function with the
activations in blocks of 256, as llama.cpp computes its K-quants.

Codes, scales and offsets are held in the layout of layout.py where the shape allows it: rows in
sets of eight, as the kernels read them and checkpoints store them. Off the kernels a layer
holds its rows plainly instead (hold_plain_rows), and under torch.compile a decoding step's
product is then one reduction over the codes (one_row), which the compiler turns into a single
pass that reads each code once, where dequantizing first writes and reads a float matrix each
step. state_dict gives the stored layout either way.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .layout import (BLOCK, ROW_SET, deinterleave_rows, interleave_rows, pack_int4, pack_int4_rows, pack_int8, unpack_int4,
                     unpack_int4_rows, unpack_int8)

INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
# With torch's AVX2 CPU code the compiled loops are eight floats wide and read int8 codes eight
# at a time through a buffer, three times slower than float; one_row then reads the codes as
# int32 words, eight a vector. With its AVX-512 code the bytes read directly are faster.
CODES_AS_WORDS = torch.backends.cpu.get_cpu_capability() == "AVX2"


def quantized_activations(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """x in float32 as the integer layers see it: cut into blocks of `block` (32; 256 for Q5_K and Q6_K,
    k_quants.py) along the last axis (the last block shorter where the features are not a multiple
    of it), each block rounded to int8 with the scale absmax / 127 (float32 arithmetic, ties to even)."""
    features = x.shape[-1]
    padded = F.pad(x.float(), (0, -features % block))  # zeros change no block's absmax
    blocks = padded.unflatten(-1, (-1, block))
    absmax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.div(torch.tensor(127.0), absmax)  # not 127 / absmax: torch computes that as 127 * (1 / absmax)
    codes = torch.round(blocks * torch.where(absmax > 0, inverse, 0.0))
    return (codes * (absmax / 127)).flatten(-2)[..., :features]


def float32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T of float32 x and W in float32, also under autocast (which would round both to its dtype)."""
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x, weight)


class Int8Linear(nn.Module):
    """y = quantized_activations(x) W^T with W stored as int8 codes and a scale (in the model's
    dtype) per row and block of 32 inputs. Rows are stored in sets of eight (layout.py) where
    out_features % 8 == 0 and in_features % 32 == 0, as in every Llama matrix; other shapes,
    and every shape once hold_plain_rows is called, keep plain rows: (out_features,
    in_features) codes and (out_features, blocks) scales."""

    activation_block = BLOCK

    def __init__(self, in_features: int, out_features: int, dtype=torch.float32, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.rows_of_8 = self.stored_in_sets = out_features % ROW_SET == 0 and in_features % BLOCK == 0
        blocks = -(-in_features // BLOCK)
        if self.rows_of_8:
            shape, scales = (out_features // ROW_SET, ROW_SET * in_features), (out_features // ROW_SET, blocks * ROW_SET)
        else:
            shape, scales = (out_features, in_features), (out_features, blocks)
        self.register_buffer("weight", torch.empty(shape, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(scales, dtype=dtype, device=device))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, dtype=None, device=None) -> "Int8Linear":
        """The layer of a float weight (out, in), scales in dtype (default: the weight's), quantized
        a chunk of rows at a time on device (default: the weight's): a few megabytes of
        temporaries, where the whole matrix at once would take several copies of it in float32."""
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, dtype or weight.dtype, device or weight.device)
        for rows in row_chunks(out_features, in_features):
            layer.store_rows(rows.start, *quantize_int8(weight[rows].to(layer.scales.device, layer.scales.dtype)))
        return layer

    def store_rows(self, start: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Rows start .. start + len(codes) of the codes (rows, in) and scales (rows, blocks), start
        and the count a multiple of eight where the layer holds sets of eight rows."""
        if self.rows_of_8:
            sets = slice(start // ROW_SET, (start + len(codes)) // ROW_SET)
            self.weight[sets], self.scales[sets] = pack_int8(codes), interleave_rows(scales)
        else:
            self.weight[start : start + len(codes)], self.scales[start : start + len(codes)] = codes, scales

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor) -> "Int8Linear":
        """The layer of int8 codes (out, in) and scales (out, blocks of 32 inputs)."""
        layer = cls(codes.shape[1], codes.shape[0], scales.dtype, device=codes.device)
        layer.store_rows(0, codes, scales)
        return layer

    def codes(self) -> torch.Tensor:
        """The codes as int8 (out_features, in_features)."""
        return unpack_int8(self.weight) if self.rows_of_8 else self.weight

    @property
    def float_dtype(self) -> torch.dtype:
        """The dtype its weights dequantize to by default (float_dtype_of)."""
        return float_dtype_of(self.scales)

    def block_scales(self) -> torch.Tensor:
        """The scales, (out_features, blocks of 32 inputs)."""
        return deinterleave_rows(self.scales) if self.rows_of_8 else self.scales

    def dequantize(self, dtype=None) -> torch.Tensor:
        """W (out_features, in_features), computed in float32, in dtype (default: float_dtype)."""
        codes, scales = self.codes(), self.block_scales().float()
        if self.in_features % BLOCK:  # a shorter last block
            w = codes.float() * scales.repeat_interleave(BLOCK, dim=1)[:, : self.in_features]
        else:  # each block of codes times its scale, in one operation
            w = torch.mul(codes.view(self.out_features, -1, BLOCK), scales[..., None]).view(self.out_features, self.in_features)
        return w.to(dtype or self.float_dtype)

    def rows(self, ids: torch.Tensor, dtype=None) -> torch.Tensor:
        """Rows ids of W, (len(ids), in_features) in dtype (default: float_dtype), dequantizing those rows only."""
        if self.rows_of_8:  # row 8p + j: bytes 4j..4j+3 of each run of 32 in set p (layout.py)
            codes = self.weight.view(-1, self.in_features // 4, ROW_SET, 4)[ids // ROW_SET, :, ids % ROW_SET]
            scales = rows_of_sets(self.scales, ids)
        else:
            codes, scales = self.weight[ids], self.scales[ids]
        w = codes.reshape(len(ids), -1).float()
        return (w.view(len(ids), -1, BLOCK) * scales.float()[..., None]).view(len(ids), -1).to(dtype or self.float_dtype)

    def hold_plain_rows(self) -> None:
        """Codes (out_features, in_features) and scales (out_features, blocks) from now on."""
        if self.rows_of_8:
            self.weight, self.scales, self.rows_of_8 = self.codes(), self.block_scales(), False

    def one_row(self, xq: torch.Tensor) -> torch.Tensor:
        """xq W^T for one row xq (in_features) of quantized activations, held in plain rows and
        in_features % 32 == 0, in float32: each block's two halves multiplied side by side
        (two products per add in the compiled loop), times its scale, summed; by words where
        torch's CPU code is AVX2."""
        if xq.is_cpu and CODES_AS_WORDS:
            return self.one_row_by_words(xq)
        blocks = self.in_features // BLOCK
        codes, x = self.weight.view(-1, blocks, 2, BLOCK // 2), stored(xq, (1, blocks, 2, BLOCK // 2))
        products = codes[:, :, 0].float() * x[:, :, 0] + codes[:, :, 1].float() * x[:, :, 1]
        return (products * self.scales.float()[..., None]).sum((1, 2))

    def one_row_by_words(self, xq: torch.Tensor) -> torch.Tensor:
        """one_row with each block's codes read as eight int32 words: code j of word i is input
        4i + j, sign-extended by two shifts, and meets x[j] (four rows of x, one per j)."""
        blocks = self.in_features // BLOCK
        words = self.weight.view(torch.int32).view(self.out_features, blocks, BLOCK // 4)
        x = stored(xq.reshape(blocks, BLOCK // 4, 4).permute(2, 0, 1), (4, blocks, BLOCK // 4))
        products = sum(((words << 24 - 8 * j) >> 24).float() * x[j] for j in range(4))
        return (products * self.scales.float()[..., None]).sum((1, 2))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.stored_in_sets and not self.rows_of_8:
            destination[prefix + "weight"], destination[prefix + "scales"] = pack_int8(self.weight), interleave_rows(self.scales)

    def forward(self, x):
        return quantized_linear(self, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per block of {BLOCK}"


class Int4Linear(nn.Module):
    """y = quantized_activations(x) W^T with W stored as 4-bit codes in groups along the input,
    each with a scale and an offset, rows in sets of eight (layout.py) or, once hold_plain_rows is
    called, plain rows of two codes a byte. With super_group_size, scales and offsets are uint8
    factors of float super_scales and super_offsets, one per super-group of inputs, and the
    activations are rounded in blocks of a super-group. Symmetric, each group's offset is -8 times
    its scale (llama.cpp's Q4_0: w = d (q - 8)), so none is held."""

    def __init__(self, in_features: int, out_features: int, group_size: int = DEFAULT_GROUP_SIZE,
                 dtype=torch.float32, device=None, super_group_size: int = 0, symmetric: bool = False):
        super().__init__()
        check_int4_shape(in_features, out_features, group_size)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.rows_of_8, self.super_group_size, self.symmetric = True, super_group_size, symmetric
        self.activation_block = super_group_size or BLOCK  # kept when hold_plain_rows multiplies the factors out
        sets, groups = out_features // ROW_SET, in_features // group_size
        factors = torch.uint8 if super_group_size else dtype
        self.register_buffer("weight", torch.empty(sets, 4 * in_features, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(sets, groups * ROW_SET, dtype=factors, device=device))
        if not symmetric:
            self.register_buffer("offsets", torch.empty(sets, groups * ROW_SET, dtype=factors, device=device))
        if super_group_size:
            supers = in_features // super_group_size
            self.register_buffer("super_scales", torch.empty(sets, supers * ROW_SET, dtype=dtype, device=device))
            self.register_buffer("super_offsets", torch.empty(sets, supers * ROW_SET, dtype=dtype, device=device))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, dtype=None, device=None) -> "Int4Linear":
        """The layer of a float weight (out, in), as Int8Linear.from_weight makes its own."""
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, group_size, dtype or weight.dtype, device or weight.device)
        for rows in row_chunks(out_features, in_features):
            layer.store_rows(rows.start, *quantize_int4(weight[rows].to(layer.scales.device, layer.scales.dtype), group_size))
        return layer

    def store_rows(self, start: int, codes, scales, offsets=None, super_scales=None, super_offsets=None) -> None:
        """Rows start .. start + len(codes) (multiples of eight) of from_codes' arguments (offsets
        None where symmetric)."""
        sets = slice(start // ROW_SET, (start + len(codes)) // ROW_SET)
        self.weight[sets], self.scales[sets] = pack_int4(codes), interleave_rows(scales)
        if not self.symmetric:
            self.offsets[sets] = interleave_rows(offsets)
        if super_scales is not None:
            self.super_scales[sets], self.super_offsets[sets] = interleave_rows(super_scales), interleave_rows(super_offsets)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, offsets: Optional[torch.Tensor],
                   group_size: int = DEFAULT_GROUP_SIZE, super_scales=None, super_offsets=None) -> "Int4Linear":
        """The layer of codes 0..15 as uint8 (out, in) and scales and offsets (out, in / group_size),
        symmetric where offsets is None; with super_scales and super_offsets (out, super-groups),
        the latter are their uint8 factors."""
        factored = super_scales is not None
        dtype, super_group_size = (super_scales.dtype, codes.shape[1] // super_scales.shape[1]) if factored else (scales.dtype, 0)
        layer = cls(codes.shape[1], codes.shape[0], group_size, dtype, device=codes.device, super_group_size=super_group_size,
                    symmetric=offsets is None)
        layer.store_rows(0, codes, scales, offsets, super_scales, super_offsets)
        return layer

    def codes(self) -> torch.Tensor:
        """The codes 0..15 as uint8 (out_features, in_features)."""
        return unpack_int4(self.weight) if self.rows_of_8 else unpack_int4_rows(self.weight)

    @property
    def float_dtype(self) -> torch.dtype:
        """The dtype its weights dequantize to by default (float_dtype_of)."""
        return float_dtype_of(self.super_scales if self.super_group_size else self.scales)

    def group_scales_and_offsets(self):
        """(scales, offsets), each (out_features, groups); factored ones multiplied out in float32,
        symmetric ones' offsets -8 times their scales, in float32 (exact)."""
        scales = deinterleave_rows(self.scales) if self.rows_of_8 else self.scales
        if self.symmetric:
            return scales, self.symmetric_offsets(scales)
        if not self.rows_of_8:
            return self.scales, self.offsets
        offsets = deinterleave_rows(self.offsets)
        if self.super_group_size:
            scales, offsets = (self.factored(t, deinterleave_rows(s)) for t, s in ((scales, self.super_scales),
                                                                                 (offsets, self.super_offsets)))
        return scales, offsets

    def factored(self, factors: torch.Tensor, supers: torch.Tensor) -> torch.Tensor:
        """Rows of uint8 factors (..., groups) times their super-groups' floats (..., supers), in float32."""
        return supers.float().repeat_interleave(self.super_group_size // self.group_size, dim=-1) * factors.float()

    def dequantize(self, dtype=None) -> torch.Tensor:
        """W (out_features, in_features), computed in float32 as q * scale + offset, in dtype
        (default: float_dtype), group by group."""
        scales, offsets = self.group_scales_and_offsets()
        w = self.codes().view(self.out_features, -1, self.group_size).float()
        w.mul_(scales.float()[..., None]).add_(offsets.float()[..., None])
        return w.view(self.out_features, self.in_features).to(dtype or self.float_dtype)

    def rows(self, ids: torch.Tensor, dtype=None) -> torch.Tensor:
        """Rows ids of W, (len(ids), in_features) in dtype (default: float_dtype), dequantizing those rows only."""
        if self.rows_of_8:  # row 8p + j: bytes 4j..4j+3 of each run of 32 in set p (layout.py)
            words = self.weight.view(torch.int32).view(len(self.weight), -1, ROW_SET)[ids // ROW_SET, :, ids % ROW_SET]
            codes = torch.stack((words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F), -1).view(torch.uint8)
            scales = rows_of_sets(self.scales, ids)
            offsets = self.symmetric_offsets(scales) if self.symmetric else rows_of_sets(self.offsets, ids)
            if self.super_group_size:
                scales = self.factored(scales, rows_of_sets(self.super_scales, ids))
                offsets = self.factored(offsets, rows_of_sets(self.super_offsets, ids))
        else:
            codes, scales = unpack_int4_rows(self.weight[ids]), self.scales[ids]
            offsets = self.symmetric_offsets(scales) if self.symmetric else self.offsets[ids]
        w = codes.reshape(len(ids), -1, self.group_size).float()
        w.mul_(scales.float()[..., None]).add_(offsets.float()[..., None])
        return w.view(len(ids), -1).to(dtype or self.float_dtype)

    def hold_plain_rows(self) -> None:
        """Codes two a byte (out_features, in_features / 2, layout.pack_int4_rows), scales and
        offsets (out_features, groups) from now on: factored ones multiplied out."""
        if self.rows_of_8:
            codes, (self.scales, offsets) = self.codes(), self.group_scales_and_offsets()
            if not self.symmetric:
                self.offsets = offsets
            self.weight, self.rows_of_8 = pack_int4_rows(codes), False
            if self.super_group_size:
                del self.super_scales, self.super_offsets
                self.super_group_size = 0

    def one_row(self, xq: torch.Tensor) -> torch.Tensor:
        """xq W^T for one row xq (in_features) of quantized activations, held in plain rows, in
        float32: per group, sum(q x) scale + sum(x) offset, with sum(q x) taken over each
        block's low and high nibbles side by side, as int8's halves; by words where torch's CPU
        code is AVX2 and in_features % 64 == 0."""
        if xq.is_cpu and CODES_AS_WORDS and self.in_features % 64 == 0:
            return self.one_row_by_words(xq)
        groups = self.in_features // self.group_size
        nibbles = self.weight.view(self.out_features, groups, -1, BLOCK // 2)  # row, group, block, byte
        x = stored(xq, (1, groups, self.group_size // BLOCK, 2, BLOCK // 2))
        products = ((nibbles & 0x0F).float() * x[..., 0, :] + (nibbles >> 4).float() * x[..., 1, :]).sum((2, 3))
        x_sums = x.sum((2, 3, 4))
        return (products * self.scales.float() + x_sums * self.plain_offsets()).sum(1)

    def one_row_by_words(self, xq: torch.Tensor) -> torch.Tensor:
        """one_row with the codes read as int32 words, eight a vector (64 inputs): byte j of word
        i of a block holds inputs 4i + j (low nibble) and 16 + 4i + j (high), and each word's
        products take its group's scale; sum over q x scale + x offset, as one_row."""
        n, k, group = self.out_features, self.in_features, self.group_size
        words = self.weight.view(torch.int32).view(n, k // 64, 8)
        x = stored(xq.reshape(k // BLOCK, 2, 4, 4).permute(1, 3, 0, 2), (2, 4, k // 64, 8))  # nibble, byte, words
        scales = self.scales.float()[..., None].expand(-1, -1, group // 8).reshape(n, k // 64, 8)
        products = sum(((words >> 8 * j) & 0x0F).float() * x[0, j] + ((words >> 8 * j + 4) & 0x0F).float() * x[1, j]
                       for j in range(4))
        x_sums = stored(xq, (k // group, group)).sum(1)
        return (products * scales).sum((1, 2)) + (self.plain_offsets() * x_sums).sum(1)

    def plain_offsets(self) -> torch.Tensor:
        """The offsets of plain rows, float32 (out_features, groups)."""
        return self.symmetric_offsets(self.scales) if self.symmetric else self.offsets.float()

    @staticmethod
    def symmetric_offsets(scales: torch.Tensor) -> torch.Tensor:
        """A symmetric layer's offsets (Q4_0's, w = d (q - 8)): -8 times its scales, in float32, exact."""
        return scales.float() * -8

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self.rows_of_8:
            scales, offsets = self.group_scales_and_offsets()
            destination.update({prefix + "weight": pack_int4(self.codes()), prefix + "scales": interleave_rows(scales)})
            if not self.symmetric:
                destination[prefix + "offsets"] = interleave_rows(offsets)

    def forward(self, x):
        return quantized_linear(self, x)

    def extra_repr(self) -> str:
        symmetric = ", symmetric" if self.symmetric else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group_size}{symmetric}"


def rows_of_sets(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids of scales held in sets of eight rows side by side, (n / 8, groups * 8) -> (len(ids), groups)."""
    return t.view(len(t), -1, ROW_SET)[ids // ROW_SET, :, ids % ROW_SET]


CHUNK_ELEMENTS = 1 << 20  # weights quantized or converted at once


def row_chunks(out_features: int, in_features: int) -> list:
    """Slices of rows of about CHUNK_ELEMENTS weights each, whole sets of eight rows but the last."""
    step = max(ROW_SET, CHUNK_ELEMENTS // max(in_features, 1) // ROW_SET * ROW_SET)
    return [slice(start, min(start + step, out_features)) for start in range(0, out_features, step)]


def float_dtype_of(scales: torch.Tensor) -> torch.dtype:
    """The dtype an integer layer's weights dequantize to by default: its scales' (the model's),
    float32 for a GGUF file's float16 ones (its models compute in float32; float16 weights would
    round the file's)."""
    return torch.float32 if scales.dtype == torch.float16 else scales.dtype


def quantized_linear(layer, x: torch.Tensor) -> torch.Tensor:
    """An integer layer's function, computed directly: quantized_activations(x) W^T in float32,
    in x's dtype. Off the CPU kernels this is what runs: under torch.compile, one row of a layer
    held in plain rows goes through one_row; otherwise W is dequantized for the call, then
    multiplied (quantized_notice says what that costs)."""
    xq = quantized_activations(x, layer.activation_block)
    if (torch.compiler.is_compiling() and not layer.rows_of_8 and layer.in_features % BLOCK == 0
            and x.shape[:-1].numel() == 1):
        return layer.one_row(xq).view(*x.shape[:-1], -1).to(x.dtype)
    return float32_linear(xq, layer.dequantize(torch.float32)).to(x.dtype)


def stored(xq: torch.Tensor, shape) -> torch.Tensor:
    """One row of activations, viewed as `shape`, through as_strided: a view the compiler can only
    take of memory, so under torch.compile the activations are computed and stored once, where
    the compiler would otherwise recompute them inside the loop, for every row of the weight."""
    return xq.contiguous().as_strided(shape, torch.empty(shape, device="meta").stride())


def check_int4_shape(in_features: int, out_features: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {group_size}")
    if in_features % group_size:
        fix = "use int8" if in_features % DEFAULT_GROUP_SIZE else f"use group size {DEFAULT_GROUP_SIZE}"
        raise ValueError(f"int4 needs every input size divisible by the group size {group_size}; {in_features} is not ({fix})")
    if out_features % ROW_SET:
        raise ValueError(f"int4 needs every output size divisible by {ROW_SET}; {out_features} is not (use int8)")


# --- Quantizers (float weights -> codes and scales) --------------------------------------


def quantize_int8(weight: torch.Tensor, dtype=None):
    """(int8 codes (out, in), scales (out, blocks of 32 inputs) in dtype, default weight's). The
    codes are computed with the scales as stored, so dequantizing gives each weight to within
    half a (stored) scale."""
    in_features = weight.shape[1]
    blocks = F.pad(weight.float(), (0, -in_features % BLOCK)).unflatten(-1, (-1, BLOCK))  # zeros change no absmax
    scales = (blocks.abs().amax(-1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(dtype or weight.dtype)
    codes = torch.round(blocks / scales.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.flatten(-2)[:, :in_features], scales


def quantize_int4(weight: torch.Tensor, group_size: int):
    """(codes 0..15 as uint8 (out, in), scales, offsets (out, in // group_size) in weight's dtype).
    The codes are computed with the scales and offsets as stored."""
    groups = weight.float().unflatten(-1, (-1, group_size))
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(weight.dtype)
    offsets = low.to(weight.dtype)
    codes = torch.round((groups - offsets.float()[..., None]) / scales.float()[..., None])
    return codes.clamp(0, 15).to(torch.uint8).flatten(-2), scales, offsets


LOOKUP_ROWS = 32  # tokens looked up at a time (QuantizedEmbedding)


class QuantizedEmbedding(nn.Module):
    """A token embedding whose table is an integer layer's rows (int8 or int4, as a GGUF file
    holds it): looking tokens up dequantizes their rows only, to dtype (the activations'). With a
    tied head the table is the head itself, one copy of the codes for both."""

    def __init__(self, table: nn.Module, dtype=torch.float32):
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.flatten()
        if torch.compiler.is_compiling():  # one graph for every prompt length
            return self.table.rows(ids, self.dtype).view(*tokens.shape, -1)
        out = torch.empty(len(ids), self.table.in_features, dtype=self.dtype, device=ids.device)
        # A few rows at a time: each dequantizes its set of eight rows, and a prompt's chunk of
        # 256 tokens at once would hold more temporaries than a layer's activations.
        for start in range(0, len(ids), LOOKUP_ROWS):
            out[start:start + LOOKUP_ROWS] = self.table.rows(ids[start:start + LOOKUP_ROWS], self.dtype)
        return out.view(*tokens.shape, -1)
