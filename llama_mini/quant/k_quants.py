"""llama.cpp's K-quants Q5_K and Q6_K as its GGUF files hold them, read where the file maps them.

Every Q4_K_M file has Q6_K matrices, every Q5_K_M file Q5_K and Q6_K ones, and a Q6_K file is
nothing else. A block holds 256 inputs of a row:
- Q6_K, 210 bytes (6.56 bits a weight): 6-bit codes q, an int8 scale s per sub-block of 16 inputs
  and a float16 d; w = d s (q - 32).
- Q5_K, 176 bytes (5.5 bits a weight): 5-bit codes q, 6-bit factors sc and m per sub-block of 32
  inputs and float16 d and dmin; w = (d sc) q - dmin m.
Both are exact in float32. Written into another layout, a matrix would take its bytes once more,
in memory the process has never touched, and that first write of each page takes longer than
llama.cpp takes to load the whole file; so a layer keeps the file's bytes as they are, and the CPU
kernels read them there (kernels/csrc/k_quants.cpp).

Their function is layers.py's with the activations rounded in blocks of 256, as llama.cpp rounds
them for the K-quants (its Q8_K): y = quantized_activations(x, 256) W^T. A block of weights then
meets one scale of x, so its sub-blocks' integer sums add up exactly before its float steps, as in
llama.cpp's own kernels.
"""

import torch
from torch import nn

from .layers import quantized_linear
from .layout import as_words

SUPER_BLOCK = 256  # inputs of a block


def scales_and_mins(q: torch.Tensor):
    """The 12 bytes of Q4_K's and Q5_K's 6-bit sub-block factors (rows, blocks, 12) -> (sc, m),
    uint8 (rows, blocks * 8), as llama.cpp's get_scale_min_k4 unpacks them: sub-block j < 4 in the
    low 6 bits of bytes j and 4 + j, j >= 4 in byte 4 + j's nibbles with the top 2 bits of bytes
    j - 4 and j."""
    low, mid, high = q[..., 0:4], q[..., 4:8], q[..., 8:12]
    scales = torch.cat((low & 63, (high & 0x0F) | (low >> 6 << 4)), -1)
    mins = torch.cat((mid & 63, (high >> 4) | (mid >> 6 << 4)), -1)
    return scales.reshape(len(q), -1), mins.reshape(len(q), -1)


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes (..., n), n % 4 == 0 -> codes (..., 2, n): the low nibbles, then the high ones."""
    words = as_words(qs)
    return torch.stack((words & 0x0F0F0F0F, (words >> 4) & 0x0F0F0F0F), dim=-2).view(torch.uint8)


def half(field: torch.Tensor) -> torch.Tensor:
    """A 16-bit float field of each block (..., 2 bytes) -> float16 (...)."""
    return field.contiguous().view(torch.float16).squeeze(-1)


def q5_k_codes_and_factors(blocks: torch.Tensor):
    """Q5_K blocks (n, blocks, 176) -> codes 0..31 as uint8 (n, blocks * 256), sc and m as uint8
    (n, blocks * 8), d and dmin as float16 (n, blocks). A block: d, dmin, 12 bytes of sc and m, 32
    bytes of fifth bits (byte j: input 32i + j's in bit i) and 128 bytes of low nibbles (run c of
    32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones)."""
    n, supers = blocks.shape[:2]
    sc, m = scales_and_mins(blocks[..., 4:16])
    codes = as_words(nibbles(blocks[..., 48:].reshape(n, supers, 4, 32))).view(n, supers, 8, 8)  # ..., sub-block, words of 4
    fifth = as_words(blocks[..., 16:48]).view(n, supers, 1, 8) >> torch.arange(8, dtype=torch.int32)[:, None]
    codes |= fifth.bitwise_and_(0x01010101).bitwise_left_shift_(4)  # in place: a chunk's temporaries stay few
    return codes.view(torch.uint8).view(n, -1), sc, m, half(blocks[..., :2]), half(blocks[..., 2:4])


def q6_k_codes_and_scales(blocks: torch.Tensor):
    """Q6_K blocks (n, blocks, 210) -> codes 0..63 as uint8 (n, blocks * 256), the sub-block scales
    s as int8 (n, blocks * 16) and d as float16 (n, blocks). A block: 128 bytes of low nibbles (half
    c of 128 inputs: bytes 64c .. 64c + 63, input 128c + j in the low nibble, 128c + 64 + j in the
    high one), 64 bytes of high two bits (byte 32c + j: input 128c + j + 32i in bits 2i, 2i + 1),
    16 scales s, then d."""
    n, supers = blocks.shape[:2]
    codes = as_words(nibbles(blocks[..., :128].reshape(n, supers, 2, 64))).view(n, supers, 2, 4, 8)  # half, i, words of j
    high = as_words(blocks[..., 128:192]).view(n, supers, 2, 1, 8) >> torch.tensor([0, 2, 4, 6], dtype=torch.int32)[:, None]
    codes |= high.bitwise_and_(0x03030303).bitwise_left_shift_(4)  # in place: a chunk's temporaries stay few
    scales = blocks[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    return codes.view(torch.uint8).view(n, -1), scales, half(blocks[..., 208:]).view(n, supers)


class KQuantLinear(nn.Module):
    """y = quantized_activations(x, 256) W^T with W the dequantized weights of a K-quant's blocks,
    uint8 (out_features, in_features / 256, BLOCK_BYTES): a view of the mapped file, or of a
    checkpoint's tensor. The subclass's weights(blocks) is W."""

    activation_block, float_dtype = SUPER_BLOCK, torch.float32

    def __init__(self, blocks: torch.Tensor, in_features: int):
        super().__init__()
        row_bytes = in_features // SUPER_BLOCK * self.BLOCK_BYTES
        if in_features % SUPER_BLOCK or blocks.dtype != torch.uint8 or blocks.numel() != len(blocks) * row_bytes:
            raise ValueError(f"{self.KIND} rows of {in_features} inputs need a multiple of {SUPER_BLOCK} inputs and "
                             f"{row_bytes} bytes each; got {tuple(blocks.shape)} {blocks.dtype}")
        self.in_features, self.out_features = in_features, len(blocks)
        self.register_buffer("blocks", blocks.view(len(blocks), in_features // SUPER_BLOCK, self.BLOCK_BYTES))

    @classmethod
    def empty(cls, in_features: int, out_features: int, device=None) -> "KQuantLinear":
        """A layer to load a checkpoint's blocks into."""
        return cls(torch.empty(out_features, in_features // SUPER_BLOCK * cls.BLOCK_BYTES, dtype=torch.uint8, device=device), in_features)

    def dequantize(self, dtype=None) -> torch.Tensor:
        """W (out_features, in_features), computed in float32, in dtype (default float32)."""
        return self.weights(self.blocks).to(dtype or self.float_dtype)

    def rows(self, ids: torch.Tensor, dtype=None) -> torch.Tensor:
        """Rows ids of W, (len(ids), in_features) in dtype (default float32), dequantizing those rows only."""
        return self.weights(self.blocks[ids]).to(dtype or self.float_dtype)

    def forward(self, x):
        return quantized_linear(self, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, a GGUF file's {self.KIND} blocks"


class Q5_KLinear(KQuantLinear):
    """llama.cpp's Q5_K: w = (d sc) q - dmin m per sub-block of 32 inputs."""

    KIND, BLOCK_BYTES = "Q5_K", 176

    def weights(self, blocks: torch.Tensor) -> torch.Tensor:
        """(d sc) q - dmin m of blocks (rows, in / 256, 176), float32 (rows, in): each factor's product
        exact in float32, as gguf's dequantization computes them."""
        codes, sc, m, d, dmin = q5_k_codes_and_factors(blocks)
        per = SUPER_BLOCK // 32
        scales = d.float().repeat_interleave(per, dim=1) * sc.float()
        offsets = dmin.float().repeat_interleave(per, dim=1) * m.float()
        w = codes.view(len(blocks), -1, 32).float().mul_(scales[..., None]).sub_(offsets[..., None])
        return w.view(len(blocks), -1)


class Q6_KLinear(KQuantLinear):
    """llama.cpp's Q6_K: w = d s (q - 32) per sub-block of 16 inputs."""

    KIND, BLOCK_BYTES = "Q6_K", 210

    def weights(self, blocks: torch.Tensor) -> torch.Tensor:
        """d s (q - 32) of blocks (rows, in / 256, 210), float32 (rows, in)."""
        codes, scales, d = q6_k_codes_and_scales(blocks)
        sub_block_scales = d.float().repeat_interleave(SUPER_BLOCK // 16, dim=1) * scales.float()
        w = codes.view(len(blocks), -1, 16).float().sub_(32).mul_(sub_block_scales[..., None])
        return w.view(len(blocks), -1)
