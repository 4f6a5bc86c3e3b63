"""How int8 and int4 weights are laid out, in memory and in a quantized checkpoint alike.

Rows come in sets of eight, so that one load of the CPU kernels (kernels/csrc/kernels.h) feeds
eight rows. int8: for each set, runs of 32 bytes in input order, bytes 4j..4j+3 of run c holding
inputs 4c..4c+3 of row j. int4: for each set and block of 32 inputs, 128 bytes; in run c (32
bytes) of a block, bytes 4j..4j+3 are row j's, byte 4j + u holding input 8c + u in its low nibble
and 8c + 4 + u in its high nibble. The scales (int8's per block of 32 inputs, int4's per group)
and int4's offsets likewise hold the eight rows of a set side by side. Loading a checkpoint is
then a plain read.

Off the kernels the layers hold their rows plainly instead (layers.py), the layout the loops
torch.compile writes read in order: int8 codes (n, k), and int4 codes two to a byte, byte j of
each block of 32 inputs holding input j in its low nibble and input 16 + j in its high one
(llama.cpp's Q4_0 order), with the scales and offsets one row each.
"""

import torch

ROW_SET = 8  # rows interleaved together
BLOCK = 32  # inputs per block


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes (n, k), n % 8 == 0 and k % 32 == 0 -> the layout (n / 8, 8 k). A row's four
    bytes of a run move as one int32, as in every packing here: a quarter as many elements."""
    n, k = codes.shape
    words = as_words(codes).view(n // ROW_SET, ROW_SET, k // 4)
    return _bytes(words.transpose(1, 2), n // ROW_SET, ROW_SET * k, torch.int8)


def as_words(field: torch.Tensor) -> torch.Tensor:
    """Bytes (..., n), n % 4 == 0, as int32 words (..., n / 4), word i holding bytes 4i..4i+3:
    bit operations then take four bytes at once, a quarter as many elements."""
    field = field.contiguous()
    if field.numel() == 0:  # no strides to reinterpret
        return field.new_empty((*field.shape[:-1], field.shape[-1] // 4), dtype=torch.int32)
    if any(stride % 4 for stride in field.stride()[:-1]):  # a slice of one row counts as contiguous, its parent's strides kept
        field = field.clone(memory_format=torch.contiguous_format)
    return field.view(torch.int32)


def _bytes(words: torch.Tensor, sets: int, width: int, dtype=torch.uint8) -> torch.Tensor:
    """int32 words -> their bytes in order, (sets, width) of dtype."""
    if words.numel() == 0:  # no strides to reinterpret
        return torch.empty(sets, width, dtype=dtype, device=words.device)
    return words.contiguous().view(dtype).view(sets, width)


def _int4_runs(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Words of codes 0..15 (n, k / 4) -> int4's runs as words (n / 8, blocks, 4 runs, 8 rows):
    a code's nibble shifts within its byte, so a word shifts as four bytes would."""
    halves = words.view(n // ROW_SET, ROW_SET, k // BLOCK, 4, 2)  # set, row, block, run, high?
    return (halves[..., 0] | (halves[..., 1] << 4)).permute(0, 2, 3, 1)


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """pack_int8's inverse: (n / 8, 8 k) -> (n, k). The four bytes of a row's run move as one
    int32, so the copy moves a quarter as many elements."""
    sets, k = packed.shape[0], packed.shape[1] // ROW_SET
    runs = packed.contiguous().view(torch.int32).view(sets, k // 4, ROW_SET)
    return runs.transpose(1, 2).contiguous().view(torch.int8).view(sets * ROW_SET, k)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 (n, k), n % 8 == 0 and k % 32 == 0 -> the layout's bytes (n / 8, 4 k)."""
    n, k = codes.shape
    return _bytes(_int4_runs(as_words(codes), n, k), n // ROW_SET, 4 * k)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: (n / 8, 4 k) bytes -> codes (n, k). A row's four bytes of a run are
    read as one int32: its low nibbles are inputs 8c..8c+3, its high ones 8c+4..8c+7."""
    sets, k = packed.shape[0], packed.shape[1] // 4
    runs = packed.contiguous().view(torch.int32).view(sets, k // BLOCK, 4, ROW_SET).permute(0, 3, 1, 2)  # set, row, block, run
    low, high = runs & 0x0F0F0F0F, (runs >> 4) & 0x0F0F0F0F
    return torch.stack((low, high), dim=-1).view(torch.uint8).view(sets * ROW_SET, k)


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 (n, k), k % 32 == 0 -> plain rows of bytes (n, k / 2)."""
    n, k = codes.shape
    halves = codes.view(n, k // BLOCK, 2, BLOCK // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4_rows' inverse: (n, k / 2) bytes -> codes (n, k)."""
    n, half = packed.shape
    blocks = packed.view(n, -1, BLOCK // 2)
    return torch.stack((blocks & 0x0F, blocks >> 4), dim=2).view(n, 2 * half)


def interleave_rows(t: torch.Tensor) -> torch.Tensor:
    """(n, groups) -> (n / 8, groups * 8): each set's eight rows side by side."""
    n, groups = t.shape
    return t.reshape(n // ROW_SET, ROW_SET, groups).transpose(1, 2).reshape(n // ROW_SET, groups * ROW_SET)


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """interleave_rows' inverse."""
    sets, width = t.shape
    return t.reshape(sets, width // ROW_SET, ROW_SET).transpose(1, 2).reshape(sets * ROW_SET, width // ROW_SET)
