"""llama.cpp's Q6_K as its GGUF file holds it, read where the file maps it: the Q6_K layer.

Every Q4_K_M and Q5_K_M file has Q6_K matrices, and a Q6_K file is nothing else. A block holds
256 inputs of a row in 210 bytes (6.56 bits a weight): 6-bit codes q, an int8 scale s per
sub-block of 16 inputs and a float16 d, w = d s (q - 32), exact in float32. Written into another
layout, a matrix would take its bytes once more, in memory the process has never touched, and
that first write of each page takes longer than llama.cpp takes to load the whole file; so the
layer keeps the file's bytes as they are, and the CPU kernels read them there (kernels/csrc/q6_k.cpp).

Its function is layers.py's with the activations rounded in blocks of 256, as llama.cpp rounds
them for Q6_K (its Q8_K): y = quantized_activations(x, 256) W^T. A block of weights then meets one
scale of x, so its sixteen sub-blocks' integer sums add up exactly before one float step, as in
llama.cpp's own kernel.
"""

import torch
from torch import nn

from .layers import quantized_linear
from .layout import as_words

SUPER_BLOCK, Q6_K_BYTES = 256, 210  # inputs and bytes of a block


def q6_k_codes_and_scales(blocks: torch.Tensor):
    """Q6_K blocks (n, blocks, 210) -> codes 0..63 as uint8 (n, blocks * 256), the sub-block scales
    s as int8 (n, blocks * 16) and d as float16 (n, blocks). A block: 128 bytes of low nibbles (half
    c of 128 inputs: bytes 64c .. 64c + 63, input 128c + j in the low nibble, 128c + 64 + j in the
    high one), 64 bytes of high two bits (byte 32c + j: input 128c + j + 32i in bits 2i, 2i + 1),
    16 scales s, then d."""
    n, supers = blocks.shape[:2]
    words = as_words(blocks[..., :128].reshape(n, supers, 2, 64))
    codes = torch.stack((words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F), dim=-2).view(n, supers, 2, 4, 8)  # half, i, words of j
    high = as_words(blocks[..., 128:192]).view(n, supers, 2, 1, 8) >> torch.tensor([0, 2, 4, 6], dtype=torch.int32)[:, None]
    codes |= high.bitwise_and_(0x03030303).bitwise_left_shift_(4)  # in place: a chunk's temporaries stay few
    scales = blocks[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    return codes.view(torch.uint8).view(n, -1), scales, blocks[..., 208:].contiguous().view(torch.float16).view(n, supers)


class Q6_KLinear(nn.Module):
    """y = quantized_activations(x, 256) W^T with W the dequantized weights of Q6_K blocks, uint8
    (out_features, in_features / 256, 210): a view of the mapped file, or of a checkpoint's tensor."""

    activation_block, float_dtype = SUPER_BLOCK, torch.float32

    def __init__(self, blocks: torch.Tensor, in_features: int):
        super().__init__()
        if in_features % SUPER_BLOCK or blocks.dtype != torch.uint8 or blocks.numel() != len(blocks) * in_features // SUPER_BLOCK * Q6_K_BYTES:
            raise ValueError(f"Q6_K rows of {in_features} inputs need a multiple of {SUPER_BLOCK} inputs and "
                             f"{in_features // SUPER_BLOCK * Q6_K_BYTES} bytes each; got {tuple(blocks.shape)} {blocks.dtype}")
        self.in_features, self.out_features = in_features, len(blocks)
        self.register_buffer("blocks", blocks.view(len(blocks), in_features // SUPER_BLOCK, Q6_K_BYTES))

    @classmethod
    def empty(cls, in_features: int, out_features: int, device=None) -> "Q6_KLinear":
        """A layer to load a checkpoint's blocks into."""
        return cls(torch.empty(out_features, in_features // SUPER_BLOCK * Q6_K_BYTES, dtype=torch.uint8, device=device), in_features)

    def weights(self, blocks: torch.Tensor) -> torch.Tensor:
        """d s (q - 32) of blocks (rows, in / 256, 210), float32 (rows, in)."""
        codes, scales, d = q6_k_codes_and_scales(blocks)
        sub_block_scales = d.float().repeat_interleave(SUPER_BLOCK // 16, dim=1) * scales.float()
        w = codes.view(len(blocks), -1, 16).float().sub_(32).mul_(sub_block_scales[..., None])
        return w.view(len(blocks), -1)

    def dequantize(self, dtype=None) -> torch.Tensor:
        """W (out_features, in_features), computed in float32, in dtype (default float32)."""
        return self.weights(self.blocks).to(dtype or self.float_dtype)

    def rows(self, ids: torch.Tensor, dtype=None) -> torch.Tensor:
        """Rows ids of W, (len(ids), in_features) in dtype (default float32), dequantizing those rows only."""
        return self.weights(self.blocks[ids]).to(dtype or self.float_dtype)

    def forward(self, x):
        return quantized_linear(self, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, a GGUF file's Q6_K blocks"
