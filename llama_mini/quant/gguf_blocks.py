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
- Q5_K and Q6_K -> their own blocks, where the file maps them (k_quants.py): 5.5 and 6.56 bits a
  weight, the file's.
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

from .k_quants import Q5_KLinear, Q6_KLinear, half, nibbles, scales_and_mins
from .layers import Int4Linear, Int8Linear, quantize_int8, row_chunks
from .layout import ROW_SET, as_words
from .mapped_q8_0 import MappedQ8_0Linear, q8_0_codes_and_scales

EXACT_INT8 = (T.Q8_0, T.Q5_0)
EXACT_INT4 = (T.Q4_0, T.Q4_1, T.Q4_K)
EXACT_K = {T.Q5_K: Q5_KLinear, T.Q6_K: Q6_KLinear}  # their own blocks
REQUANTIZED = (T.Q5_1, T.Q2_K, T.Q3_K)  # to int8
TYPES = EXACT_INT8 + EXACT_INT4 + tuple(EXACT_K) + REQUANTIZED


def layer_from_blocks(kind: T, blocks: np.ndarray, shape, converter=None) -> torch.nn.Module:
    """The integer layer of a GGUF matrix (out, in) of type kind, from its blocks: uint8
    (out, bytes per row), a view of the mapped file. Rows are converted a chunk at a time, by
    the functions here or by converter (kind, blocks, layer) -> whether it filled the layer:
    the CPU kernels' (kernels/gguf_blocks.py), the same bytes faster. Where the kernels convert,
    a Q8_0 matrix in sets of eight rows is not converted at all: they read its rows where the file
    maps them (MappedQ8_0Linear). A Q5_K or Q6_K matrix never is: its layer holds the file's blocks (k_quants.py)."""
    out_features, in_features = shape
    if kind == T.Q8_0 and converter is not None and out_features % ROW_SET == 0:
        return MappedQ8_0Linear(torch.from_numpy(blocks), in_features)
    if kind in EXACT_K:
        return EXACT_K[kind](torch.from_numpy(blocks), in_features)
    if kind in EXACT_INT4 and out_features % ROW_SET == 0:
        if kind == T.Q4_K:
            layer = Int4Linear(in_features, out_features, 32, torch.float16, super_group_size=256)
        else:
            layer = Int4Linear(in_features, out_features, 32, torch.float16, symmetric=kind == T.Q4_0)
        convert = _INT4[kind]
    elif kind in EXACT_INT8:
        layer, convert = Int8Linear(in_features, out_features, torch.float16), _INT8[kind]
    else:  # int4 needs sets of eight rows: a matrix without them takes int8, as the other types do
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
    if kind in EXACT_K:  # the file's blocks
        return n // 256 * EXACT_K[kind].BLOCK_BYTES
    return n + 2 * blocks  # int8: a float16 or bfloat16 scale per block of 32


def _blocks(rows: torch.Tensor, kind: T) -> torch.Tensor:
    """rows of uint8 -> (rows, blocks per row, bytes per block)."""
    return rows.view(len(rows), -1, GGML_QUANT_SIZES[kind][1])


def _q5_0(rows, k):
    """Q5_0: d, 4 bytes of high bits, 16 bytes of low nibbles; code j's fifth bit is bit j."""
    b = _blocks(rows, T.Q5_0)
    codes = as_words(nibbles(b[..., 6:])).view(len(rows), -1, 8)  # word w: codes 4w .. 4w + 3
    bits = as_words(b[..., 2:6]) >> torch.arange(0, 32, 4, dtype=torch.int32)  # word w's four fifth bits at 0..3
    for u in range(4):  # code 4w + u's fifth bit to bit 4 of byte u
        codes |= ((bits >> u) & 1) << (8 * u + 4)
    return codes.view(torch.uint8).sub_(16).view(torch.int8).view(len(rows), k), half(b[..., :2])


def _q4_0(rows, k):
    b = _blocks(rows, T.Q4_0)
    return nibbles(b[..., 2:]).reshape(len(rows), k), half(b[..., :2])


def _q4_1(rows, k):
    b = _blocks(rows, T.Q4_1)
    return nibbles(b[..., 4:]).reshape(len(rows), k), half(b[..., :2]), half(b[..., 2:4])


def _q4_k(rows, k):
    """Q4_K: super-blocks of 256, d, dmin, 12 bytes of 6-bit sub-block scales and mins, and 128
    bytes: run c of 32 holds sub-block 2c in its low nibbles and 2c + 1 in its high ones. ->
    codes, the factors sc and m, d and -dmin."""
    b = _blocks(rows, T.Q4_K)
    n, supers = len(rows), b.shape[1]
    sc, m = scales_and_mins(b[..., 4:16])
    codes = nibbles(b[..., 16:].reshape(n, supers, 4, 32)).reshape(n, k)
    return codes, sc, m, half(b[..., :2]), -half(b[..., 2:4])


def _requantized(kind: T):
    """The converter of a type no layer holds exactly: gguf's dequantization, then int8."""
    def convert(rows, k):
        with np.errstate(all="ignore"):  # a block may hold inf or NaN scales; the values say so
            weights = torch.from_numpy(quants.dequantize(rows.numpy(), kind)).view(len(rows), k)
        return quantize_int8(weights, torch.bfloat16)
    return convert


_INT8 = {T.Q8_0: q8_0_codes_and_scales, T.Q5_0: _q5_0}
_INT4 = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k}
