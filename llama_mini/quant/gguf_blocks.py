"""llama.cpp's quantized blocks carried into the integer layers, a few rows at a time: a GGUF
file's matrix runs at the file's own precision, never held as a float matrix.

Where a GGUF type's blocks are one of the layers' forms, its codes and scales are carried over
as they are, and the layer's dequantized weights equal the file's (as gguf.quants, llama.cpp's
own code, dequantizes them), value for value:
- Q8_0 -> int8: blocks of 32, w = d q. Q5_0 -> int8 too: w = d (q - 16), codes q - 16.
- Q4_0 -> int4, groups of 32: w = d (q - 8) = q d + (-8 d).
- Q4_1 -> int4: w = q d + m.
- Q4_K -> int4: each sub-block of 32 has w = q (d sc) - dmin m; d sc and dmin m are a 16-bit
  float times a 6-bit integer, exact in float32, and so is q (d sc), four bits more.
Scales and offsets are float32, the only dtype that holds all of these exactly.

The other types (Q5_1, Q2_K, Q3_K, Q5_K, Q6_K) are dequantized by gguf.quants and rounded to
int8 in blocks of 32, the layer that adds the least error: at most half a step, about a block's
absmax / 254, to the file's weights (docs/gguf.md has the error measured for each type). Their
scales are bfloat16: 8.5 bits a weight, where a float32 scale would make 9; the codes are
rounded with the scale as stored, so the bound holds.
"""

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

from .layers import Int4Linear, Int8Linear, quantize_int8
from .layout import ROW_SET, interleave_rows, pack_int4, pack_int8

EXACT_INT8 = (T.Q8_0, T.Q5_0)
EXACT_INT4 = (T.Q4_0, T.Q4_1, T.Q4_K)
REQUANTIZED = (T.Q5_1, T.Q2_K, T.Q3_K, T.Q5_K, T.Q6_K)  # to int8
TYPES = EXACT_INT8 + EXACT_INT4 + REQUANTIZED
_CHUNK_ELEMENTS = 1 << 20  # weights converted at once: a few MB beside the layer


def layer_from_blocks(kind: T, blocks: np.ndarray, shape) -> torch.nn.Module:
    """The int8 or int4 layer of a GGUF matrix (out, in) of type kind, from its blocks: uint8
    (out, bytes per row), a view of the mapped file. Rows are converted a chunk at a time."""
    out_features, in_features = shape
    if kind in EXACT_INT4 and out_features % ROW_SET == 0:
        layer = Int4Linear(in_features, out_features, 32, torch.float32)
        convert, store = _INT4[kind], _store_int4
    else:  # int4 needs sets of eight rows; a matrix without them takes int8, exact for Q8_0 and Q5_0
        layer = Int8Linear(in_features, out_features, torch.float32 if kind in EXACT_INT8 else torch.bfloat16)
        convert, store = (_INT8[kind] if kind in EXACT_INT8 else _requantized(kind)), _store_int8
    step = max(ROW_SET, _CHUNK_ELEMENTS // max(in_features, 1) // ROW_SET * ROW_SET)
    for start in range(0, out_features, step):
        rows = torch.from_numpy(np.ascontiguousarray(blocks[start : start + step]))
        store(layer, start, *convert(rows, in_features))
    return layer


def held_bytes(kind: T, shape) -> int:
    """The bytes of the layer layer_from_blocks makes of a matrix of kind and shape (out, in)."""
    out_features, in_features = shape
    n, blocks = out_features * in_features, out_features * -(-in_features // 32)
    if kind in EXACT_INT4 and out_features % ROW_SET == 0:
        return n // 2 + 2 * 4 * blocks  # codes two a byte, a float32 scale and offset per group of 32
    return n + (4 if kind in EXACT_INT8 else 2) * blocks


def _store_int8(layer: Int8Linear, start: int, codes: torch.Tensor, scales: torch.Tensor) -> None:
    if layer.rows_of_8:
        layer.weight[start // ROW_SET : (start + len(codes)) // ROW_SET] = pack_int8(codes)
        layer.scales[start // ROW_SET : (start + len(codes)) // ROW_SET] = interleave_rows(scales)
    else:
        layer.weight[start : start + len(codes)], layer.scales[start : start + len(codes)] = codes, scales


def _store_int4(layer: Int4Linear, start: int, codes, scales, offsets) -> None:
    sets = slice(start // ROW_SET, (start + len(codes)) // ROW_SET)
    layer.weight[sets], layer.scales[sets], layer.offsets[sets] = pack_int4(codes), interleave_rows(scales), interleave_rows(offsets)


def _blocks(rows: torch.Tensor, kind: T) -> torch.Tensor:
    """rows of uint8 -> (rows, blocks per row, bytes per block)."""
    return rows.view(len(rows), -1, GGML_QUANT_SIZES[kind][1])


def _half(field: torch.Tensor) -> torch.Tensor:
    """A 16-bit float field of each block (..., 2 bytes) -> float32 (...)."""
    return field.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes (..., n) -> codes (..., 2, n): the low nibbles, then the high ones."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _q8_0(rows, k):
    b = _blocks(rows, T.Q8_0)
    return b[..., 2:].contiguous().view(torch.int8).reshape(len(rows), k), _half(b[..., :2])


def _q5_0(rows, k):
    """Q5_0: d, 4 bytes of high bits, 16 bytes of low nibbles; code j's fifth bit is bit j."""
    b = _blocks(rows, T.Q5_0)
    high = b[..., 2:6].contiguous().view(torch.int32)  # bit j: code j's fifth bit
    fifth = (high >> torch.arange(32, dtype=torch.int32)) & 1
    codes = _nibbles(b[..., 6:]).flatten(-2).to(torch.int32) | (fifth << 4)
    return (codes - 16).to(torch.int8).reshape(len(rows), k), _half(b[..., :2])


def _q4_0(rows, k):
    b = _blocks(rows, T.Q4_0)
    d = _half(b[..., :2])
    return _nibbles(b[..., 2:]).reshape(len(rows), k), d, -8 * d


def _q4_1(rows, k):
    b = _blocks(rows, T.Q4_1)
    return _nibbles(b[..., 4:]).reshape(len(rows), k), _half(b[..., :2]), _half(b[..., 2:4])


def _q4_k(rows, k):
    """Q4_K: super-blocks of 256, d, dmin, 12 bytes of 6-bit sub-block scales and mins (unpacked
    by gguf's own code), and 128 bytes: run c of 32 holds sub-block 2c in its low nibbles and
    2c + 1 in its high ones."""
    b = _blocks(rows, T.Q4_K)
    n, supers = len(rows), b.shape[1]
    d, dmin = _half(b[..., :2])[..., None], _half(b[..., 2:4])[..., None]
    sc, m = (torch.from_numpy(t.astype(np.float32)).view(n, supers, 8)
             for t in quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12).numpy()))
    codes = _nibbles(b[..., 16:].reshape(n, supers, 4, 32)).reshape(n, k)
    return codes, (d * sc).view(n, -1), (-(dmin * m)).view(n, -1)


def _requantized(kind: T):
    """The converter of a type no layer holds exactly: gguf's dequantization, then int8."""
    def convert(rows, k):
        with np.errstate(all="ignore"):  # a block may hold inf or NaN scales; the values say so
            weights = torch.from_numpy(quants.dequantize(rows.numpy(), kind)).view(len(rows), k)
        return quantize_int8(weights, torch.bfloat16)
    return convert


_INT8 = {T.Q8_0: _q8_0, T.Q5_0: _q5_0}
_INT4 = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k}
