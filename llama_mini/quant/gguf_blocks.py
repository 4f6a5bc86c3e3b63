"""llama.cpp's quantized blocks carried into the integer layers, a few rows at a time: a GGUF
file's matrix runs at the file's own precision, never held as a float matrix.

Where a GGUF type's blocks are one of the layers' forms, its codes and scales are carried over
as they are, and the layer's dequantized weights equal the file's (as gguf.quants, llama.cpp's
own code, dequantizes them), value for value:
- Q8_0 -> int8: blocks of 32, w = d q; on the CPU kernels, the file's own rows (mapped_q8_0.py).
  Q5_0 -> int8 too: w = d (q - 16), codes q - 16.
- Q4_0 -> symmetric int4, groups of 32: w = d (q - 8), the offset -8 d held by none.
- Q4_1 -> int4: w = q d + m.
- Q4_K -> int4 with factored scales and offsets: each sub-block of 32 has w = q (d sc) - dmin m,
  and the layer holds d and -dmin per super-block of 256 (the file's float16) and sc and m
  per group (uint8, where the file packs them in 6 bits): 4.63 bits a weight for Q4_K's 4.5.
  d sc and dmin m, a 16-bit float times a 6-bit integer, are exact in float32, and so is
  q (d sc), four bits more.
- Q5_K -> int5, as the file holds it: Q4_K's form (and factors) with a fifth bit: 5.63 bits a
  weight for Q5_K's 5.5.
- Q6_K -> its own blocks, where the file maps them (q6_k.py): w = (d sc) (q - 32), 6-bit codes in
  sub-blocks of 16 with an int8 sc each, d per super-block of 256: 6.56 bits a weight, the file's.
Every scale and offset is the file's 16-bit float, held as it is.

The other types (Q5_1, Q2_K, Q3_K) are dequantized by gguf.quants and rounded to
int8 in blocks of 32, the layer that adds the least error: at most half a step, about a block's
absmax / 254, to the file's weights (docs/gguf.md has the error measured for each type). Their
scales are bfloat16: 8.5 bits a weight, where a float32 scale would make 9; the codes are
rounded with the scale as stored, so the bound holds.
"""

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

from .k_quants import Int5Linear
from .layers import Int4Linear, Int8Linear, quantize_int8, row_chunks
from .layout import ROW_SET, as_words
from .mapped_q8_0 import MappedQ8_0Linear, q8_0_codes_and_scales
from .q6_k import Q6_KLinear

EXACT_INT8 = (T.Q8_0, T.Q5_0)
EXACT_INT4 = (T.Q4_0, T.Q4_1, T.Q4_K)
EXACT_K = (T.Q5_K, T.Q6_K)  # to int5, and Q6_K's own blocks
REQUANTIZED = (T.Q5_1, T.Q2_K, T.Q3_K)  # to int8
TYPES = EXACT_INT8 + EXACT_INT4 + EXACT_K + REQUANTIZED


def layer_from_blocks(kind: T, blocks: np.ndarray, shape, converter=None) -> torch.nn.Module:
    """The integer layer of a GGUF matrix (out, in) of type kind, from its blocks: uint8
    (out, bytes per row), a view of the mapped file. Rows are converted a chunk at a time, by
    the functions here or by converter (kind, blocks, layer) -> whether it filled the layer:
    the CPU kernels' (kernels/gguf_blocks.py), the same bytes faster. Where the kernels convert,
    a Q8_0 matrix in sets of eight rows is not converted at all: they read its rows where the file
    maps them (MappedQ8_0Linear). A Q6_K matrix never is: its layer holds the file's blocks (Q6_KLinear)."""
    out_features, in_features = shape
    if kind == T.Q8_0 and converter is not None and out_features % ROW_SET == 0:
        return MappedQ8_0Linear(torch.from_numpy(blocks), in_features)
    if kind == T.Q6_K:
        return Q6_KLinear(torch.from_numpy(blocks), in_features)
    if kind in EXACT_INT4 and out_features % ROW_SET == 0:
        if kind == T.Q4_K:
            layer = Int4Linear(in_features, out_features, 32, torch.float16, super_group_size=256)
        else:
            layer = Int4Linear(in_features, out_features, 32, torch.float16, symmetric=kind == T.Q4_0)
        convert = _INT4[kind]
    elif kind == T.Q5_K and out_features % ROW_SET == 0:
        layer, convert = Int5Linear(in_features, out_features), _q5_k
    elif kind in EXACT_INT8:
        layer, convert = Int8Linear(in_features, out_features, torch.float16), _INT8[kind]
    else:  # int4 and int5 need sets of eight rows: a matrix without them takes int8, as the other types do
        layer, convert = Int8Linear(in_features, out_features, torch.bfloat16), _requantized(kind)
    if converter is not None and converter(kind, blocks, layer):
        return layer
    for rows in row_chunks(out_features, in_features):
        layer.store_rows(rows.start, *convert(torch.from_numpy(np.ascontiguousarray(blocks[rows])), in_features))
    return layer


def held_bytes(kind: T, shape) -> int:
    """The bytes of the layer layer_from_blocks makes of a matrix of kind and shape (out, in)."""
    out_features, in_features = shape
    n, blocks = out_features * in_features, out_features * -(-in_features // 32)
    if kind == T.Q4_K and out_features % ROW_SET == 0:  # codes two a byte, uint8 factors per group, float16 per 256
        return n // 2 + 2 * blocks + 2 * 2 * (n // 256)
    if kind == T.Q4_0 and out_features % ROW_SET == 0:
        return n // 2 + 2 * blocks  # codes two a byte, a float16 scale per group of 32 (the offset is -8 times it)
    if kind in EXACT_INT4 and out_features % ROW_SET == 0:
        return n // 2 + 2 * 2 * blocks  # codes two a byte, a float16 scale and offset per group of 32
    if kind == T.Q5_K and out_features % ROW_SET == 0:  # five bits a code, two uint8 per 32, two float16 per 256
        return 5 * n // 8 + 2 * blocks + 2 * 2 * (n // 256)
    if kind == T.Q6_K:  # the file's blocks
        return n // 256 * 210
    return n + 2 * blocks  # int8: a float16 or bfloat16 scale per block of 32


def _blocks(rows: torch.Tensor, kind: T) -> torch.Tensor:
    """rows of uint8 -> (rows, blocks per row, bytes per block)."""
    return rows.view(len(rows), -1, GGML_QUANT_SIZES[kind][1])


def _half(field: torch.Tensor) -> torch.Tensor:
    """A 16-bit float field of each block (..., 2 bytes) -> float16 (...)."""
    return field.contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes (..., n), n % 4 == 0 -> codes (..., 2, n): the low nibbles, then the high ones."""
    words = as_words(qs)
    return torch.stack((words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F), dim=-2).view(torch.uint8)


def _q5_0(rows, k):
    """Q5_0: d, 4 bytes of high bits, 16 bytes of low nibbles; code j's fifth bit is bit j."""
    b = _blocks(rows, T.Q5_0)
    codes = as_words(_nibbles(b[..., 6:])).view(len(rows), -1, 8)  # word w: codes 4w .. 4w + 3
    bits = as_words(b[..., 2:6]) >> torch.arange(0, 32, 4, dtype=torch.int32)  # word w's four fifth bits at 0..3
    for u in range(4):  # code 4w + u's fifth bit to bit 4 of byte u
        codes |= ((bits >> u) & 1) << (8 * u + 4)
    return codes.view(torch.uint8).sub_(16).view(torch.int8).view(len(rows), k), _half(b[..., :2])


def _q4_0(rows, k):
    b = _blocks(rows, T.Q4_0)
    return _nibbles(b[..., 2:]).reshape(len(rows), k), _half(b[..., :2])


def _q4_1(rows, k):
    b = _blocks(rows, T.Q4_1)
    return _nibbles(b[..., 4:]).reshape(len(rows), k), _half(b[..., :2]), _half(b[..., 2:4])


def _scales_and_mins(q: torch.Tensor):
    """The 12 bytes of Q4_K's and Q5_K's 6-bit sub-block scales and mins (rows, supers, 12) ->
    (scales, mins), uint8 (rows, supers * 8), as llama.cpp's get_scale_min_k4 unpacks them: sub-
    block j < 4 in the low 6 bits of bytes j and 4 + j, j >= 4 in byte 4 + j's nibbles with the
    top 2 bits of bytes j - 4 and j."""
    low, mid, high = q[..., 0:4], q[..., 4:8], q[..., 8:12]
    scales = torch.cat((low & 63, (high & 0x0F) | (low >> 6 << 4)), -1)
    mins = torch.cat((mid & 63, (high >> 4) | (mid >> 6 << 4)), -1)
    return scales.reshape(len(q), -1), mins.reshape(len(q), -1)


def _q4_k(rows, k):
    """Q4_K: super-blocks of 256, d, dmin, 12 bytes of 6-bit sub-block scales and mins, and 128
    bytes: run c of 32 holds sub-block 2c in its low nibbles and 2c + 1 in its high ones. ->
    codes, the factors sc and m, d and -dmin."""
    b = _blocks(rows, T.Q4_K)
    n, supers = len(rows), b.shape[1]
    sc, m = _scales_and_mins(b[..., 4:16])
    codes = _nibbles(b[..., 16:].reshape(n, supers, 4, 32)).reshape(n, k)
    return codes, sc, m, _half(b[..., :2]), -_half(b[..., 2:4])


def _q5_k(rows, k):
    """Q5_K: super-blocks of 256: d, dmin, 12 bytes of 6-bit sub-block scales and mins, 32 bytes
    of fifth bits (byte j: input 32i + j's in bit i) and Q4_K's 128 bytes of low nibbles. ->
    codes, sc, m, d and -dmin."""
    b = _blocks(rows, T.Q5_K)
    n, supers = len(rows), b.shape[1]
    sc, m = _scales_and_mins(b[..., 4:16])
    codes = as_words(_nibbles(b[..., 48:].reshape(n, supers, 4, 32))).view(n, supers, 8, 8)  # ..., sub-block, words of 4
    fifth = as_words(b[..., 16:48]).view(n, supers, 1, 8) >> torch.arange(8, dtype=torch.int32)[:, None]
    codes |= fifth.bitwise_and_(0x01010101).bitwise_left_shift_(4)  # in place: a chunk's temporaries stay few
    return codes.view(torch.uint8).view(n, k), sc, m, _half(b[..., :2]), -_half(b[..., 2:4])


def _requantized(kind: T):
    """The converter of a type no layer holds exactly: gguf's dequantization, then int8."""
    def convert(rows, k):
        with np.errstate(all="ignore"):  # a block may hold inf or NaN scales; the values say so
            weights = torch.from_numpy(quants.dequantize(rows.numpy(), kind)).view(len(rows), k)
        return quantize_int8(weights, torch.bfloat16)
    return convert


_INT8 = {T.Q8_0: q8_0_codes_and_scales, T.Q5_0: _q5_0}
_INT4 = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k}
