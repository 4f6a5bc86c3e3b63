"""A GGUF file's Q8_0 matrices held where the file maps them: loading writes none of their bytes.

llama.cpp's Q8_0 is the int8 layer's form (layers.py): blocks of 32 inputs, an int8 code q each
and a float16 scale d, w = d q. Laid out in int8's sets of eight rows, a matrix is written once
more, into memory the process has never touched, and that first write of each page takes longer
than llama.cpp takes to map the whole file. The CPU kernels read the file's own rows instead
(kernels/csrc/linear.cpp, linear_q8_0), so this layer keeps a view of the mapped file and is the
int8 layer of its codes and scales: the same function, bit for bit the same outputs on the
kernels, the same state_dict and record.
"""

import torch
from torch import nn

from .layers import BLOCK, Int8Linear
from .layout import ROW_SET, interleave_rows, pack_int8

Q8_0_BYTES = 34  # a block: its float16 scale, then its 32 codes


def q8_0_codes_and_scales(rows: torch.Tensor, in_features: int):
    """Q8_0 rows, uint8 (n, in_features / 32 * 34) -> int8 codes (n, in_features) and float16 scales (n, blocks)."""
    b = rows.view(len(rows), -1, Q8_0_BYTES)
    return b[..., 2:].contiguous().view(torch.int8).reshape(len(rows), in_features), b[..., :2].contiguous().view(torch.float16).squeeze(-1)


class MappedQ8_0Linear(Int8Linear):
    """Int8Linear over a GGUF file's Q8_0 rows as mapped: blocks, uint8 (out_features, in_features
    / 32 * 34), out_features a multiple of 8 and in_features of 32. Its codes and scales are read
    from the blocks (the scales as a view); hold_plain_rows copies them out into Int8Linear's
    plain rows, for torch.compile's loops."""

    rows_of_8 = True  # not plain rows, which one_row reads: compiled, quantized_linear dequantizes

    def __init__(self, blocks: torch.Tensor, in_features: int):
        nn.Module.__init__(self)
        if len(blocks) % ROW_SET or in_features % BLOCK or blocks.shape[1] != in_features // BLOCK * Q8_0_BYTES:
            raise ValueError(f"Q8_0 rows of {in_features} inputs need {in_features // BLOCK * Q8_0_BYTES} bytes each, "
                             f"in sets of {ROW_SET} rows; got {tuple(blocks.shape)}")
        self.in_features, self.out_features, self.stored_in_sets = in_features, len(blocks), True
        self.register_buffer("blocks", blocks)

    @property
    def scales(self) -> torch.Tensor:
        return self.block_scales()

    def codes(self) -> torch.Tensor:
        """The codes as int8 (out_features, in_features)."""
        return q8_0_codes_and_scales(self.blocks, self.in_features)[0]

    def block_scales(self) -> torch.Tensor:
        """The float16 scales (out_features, blocks of 32 inputs): a view of the file's bytes."""
        halves = self.blocks.view(torch.float16)
        return halves.as_strided((self.out_features, self.in_features // BLOCK), (halves.stride(0), Q8_0_BYTES // 2))

    def rows(self, ids: torch.Tensor, dtype=None) -> torch.Tensor:
        """Rows ids of W, (len(ids), in_features) in dtype (default: float_dtype), dequantizing those rows only."""
        codes, scales = q8_0_codes_and_scales(self.blocks[ids], self.in_features)
        w = codes.float().view(len(ids), -1, BLOCK) * scales.float()[..., None]
        return w.view(len(ids), -1).to(dtype or self.float_dtype)

    def hold_plain_rows(self) -> None:
        """Int8Linear's plain rows from now on, copied out of the file."""
        codes, scales = q8_0_codes_and_scales(self.blocks, self.in_features)
        del self.blocks
        self.__class__ = Int8Linear
        self.rows_of_8 = False
        self.register_buffer("weight", codes)
        self.register_buffer("scales", scales)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        codes, scales = q8_0_codes_and_scales(self.blocks, self.in_features)
        destination[prefix + "weight"], destination[prefix + "scales"] = pack_int8(codes), interleave_rows(scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, a GGUF file's Q8_0 rows as mapped"
