"""The CPU kernels (llama_mini/kernels/linear.py, block.py): each operator against a float64 known
answer at every row count, the attention step against the model's own code, a layer's step
against its operators, and a model on the kernels against transformers and through generate.py."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llama_mini import ModelArgs, generate, load_checkpoint, save_checkpoint
from llama_mini.kernels import use_cpu_kernels
from llama_mini.kernels.block import KernelBlock, block_on_kernels
from llama_mini.kernels.linear import KernelLinear
from llama_mini.kernels.operators import operators
from llama_mini.quant.layers import Int4Linear, Int8Linear, quantized_activations
from llama_mini.quant.layout import interleave_rows, pack_int8, unpack_int8
from llama_mini.model import KVCache, apply_rotary_emb, rope_cos_sin
from fixtures import tiny_model
from generate_cli_helpers import LLAMA2_TOKENIZER, require, run

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ops():
    ops = operators()
    if ops is None:
        pytest.skip("no matrix-vector kernels on this machine (they need x86-64 with AVX2 and FMA)")
    return ops


def close(got, expected, dtype):
    """Within float32 summation-order error, or one bfloat16 (or float16) rounding of the output."""
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.double(), expected, **tolerance)


# --- Operators against float64 -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, n, k", [(1, 4, 16), (1, 37, 200), (3, 64, 768), (16, 9, 40), (67, 21, 100), (130, 64, 64)])  # tails of rows, tiles and inputs
@pytest.mark.parametrize("threads", [1, 2])
def test_dense_matches_float64(ops, dtype, rows, n, k, threads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(rows * n + k)
    x, w = torch.randn(rows, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    y = ops.linear_dense(x, w)
    assert y.dtype == dtype and y.shape == (rows, n)
    close(y, x.double() @ w.double().t(), dtype)
    torch.set_num_threads(1)


# Weights in panels of sixteen outputs, as use_cpu_kernels holds them: float32, and a
# bfloat16 or float16 model's own.
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
@pytest.mark.parametrize("rows, n, k", [(1, 16, 1), (2, 48, 200), (3, 64, 768), (4, 32, 40), (67, 80, 300), (130, 272, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_panels_match_float64_and_are_the_rows_weight(ops, x_dtype, w_dtype, rows, n, k, threads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(rows * n + k)
    x, w = torch.randn(rows, k, generator=g).to(x_dtype), torch.randn(n, k, generator=g).to(w_dtype)
    y = ops.linear_dense(x, to_panels(w))
    assert y.dtype == x_dtype and y.shape == (rows, n)
    close(y, x.double() @ w.double().t(), x_dtype)
    torch.set_num_threads(1)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_panels_sum_each_output_input_after_input_from_zero(ops, w_dtype):
    """The order the panels' kernel promises (csrc/linear.cpp): a fused multiply-add per input,
    in order, from zero; the same bits as that loop written out in float32. Half-precision
    weights are made float32 exactly, and take the same steps."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(11, 50, generator=g), torch.randn(32, 50, generator=g).to(w_dtype)  # a prompt's tiles, and one of 5 rows
    expected = torch.zeros(11, 32, dtype=torch.float64)
    for j in range(50):  # one rounding to float32 per step; float64 holds each exact product and sum
        expected = (expected + x[:, j:j + 1].double() * w[:, j].double()).float().double()
    assert torch.equal(ops.linear_dense(x, to_panels(w)).double(), expected)
    assert torch.equal(ops.linear_dense(x[:3], to_panels(w)).double(), expected[:3])  # a decoding step's


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_panels_compute_each_row_as_if_alone_and_carry_a_nan_where_it_belongs(ops, threads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 160, generator=g)
    w[7, 33] = float("nan")
    panels = to_panels(w)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 128, 129, 200):
        x = torch.randn(rows, 160, generator=g)
        x[rows // 2, 100] = float("nan")
        y = ops.linear_dense(x, panels)
        alone = torch.cat([ops.linear_dense(row, panels) for row in x.split(1)])
        assert torch.equal(y.view(torch.int32), alone.view(torch.int32)), rows  # bit for bit, NaNs too
        nan = torch.zeros_like(y, dtype=torch.bool)
        nan[:, 7], nan[rows // 2] = True, True
        assert torch.equal(y.isnan(), nan), rows
    torch.set_num_threads(1)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_panels_keep_rows_alone_over_chunks_of_rows_and_groups_of_panels(ops, threads):
    """A prompt longer than a chunk (1026 rows), against more panels than a group holds (a
    quarter of the L2: a few panels of 2048 inputs), is still each row computed alone."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(160, 2048, generator=g), torch.randn(1100, 2048, generator=g)
    panels = to_panels(w)
    y = ops.linear_dense(x, panels)
    alone = torch.cat([ops.linear_dense(row, panels) for row in x.split(1)])
    assert torch.equal(y, alone)
    expected = torch.zeros(1100, 160, dtype=torch.float64)
    for j in range(2048):  # the promised order, as in the test above
        expected = (expected + x[:, j:j + 1].double() * w[:, j].double()).float().double()
    assert torch.equal(y.double(), expected)
    torch.set_num_threads(1)


def to_panels(w):
    """(n, k) -> (n / 16, k, 16), as the kernels hold float weights in panels."""
    return w.unflatten(0, (-1, 16)).transpose(1, 2).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_int8_matches_float64_with_activations_rounded_in_blocks_of_32(ops, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2048, generator=g).to(dtype)
    x[0, 7] = 40.0  # one outlier: only its own block's scale grows
    w = torch.randint(-127, 128, (296, 2048), generator=g, dtype=torch.int8)
    w[5] = 127  # the extremes: products of the largest codes must not saturate
    w[6] = -127
    w[7, :32] = -128  # a code the quantizer never writes, but a file may hold
    x[-1, :32] = -1.0  # a block whose codes are all -127
    scales = (torch.rand(296, 64, generator=g) * 1e-2).to(dtype)
    expected = quantized_activations(x).double() @ (w.double() * scales.double().repeat_interleave(32, dim=1)).t()
    close(ops.linear_int8(x, pack_int8(w), interleave_rows(scales)), expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 15, 16, 70])
def test_factored_int4_matches_float64_with_scales_multiplied_out(ops, dtype, rows):
    """Scales and offsets as llama.cpp's Q4_K holds them: uint8 factors per group of 32, float32
    per super-group of 256; each group's products, then the int4 function. From 16 rows they are
    multiplied out once for the call (csrc/linear.cpp), for fewer in the tiles; the activations are
    rounded in blocks of 256, as llama.cpp rounds Q4_K's. Without VNNI a block's products are summed
    in int16 before widening: the largest codes and activations too."""
    from llama_mini.quant.layers import Int4Linear

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 768, generator=g).to(dtype)
    x[-1, :32] = 8.0  # its block's absmax, codes 127: with row 2's codes 15, a block's largest sums (int16 pairs, csrc/simd.h)
    codes = torch.randint(0, 16, (48, 768), generator=g, dtype=torch.uint8)
    codes[2] = 15
    factors = torch.randint(0, 64, (2, 48, 24), generator=g, dtype=torch.uint8)
    factors[0, 3, 5] = 255  # the largest a factor can hold
    supers = (torch.rand(2, 48, 3, generator=g) * 1e-3 * torch.tensor([1.0, -1.0])[:, None, None]).half().float()
    layer = Int4Linear.from_codes(codes, *factors, 32, *supers)
    scales, offsets = (s.double().repeat_interleave(8, dim=1) * f.double() for s, f in zip(supers, factors))
    assert all(torch.equal(a.double(), b) for a, b in zip(layer.group_scales_and_offsets(), (scales, offsets)))  # exact
    w = (codes.double().unflatten(-1, (24, 32)) * scales[..., None] + offsets[..., None]).flatten(-2)
    got = ops.linear_int4(x, layer.weight, layer.scales, layer.offsets, layer.super_scales, layer.super_offsets)
    assert layer.activation_block == 256
    close(got, quantized_activations(x, 256).double() @ w.t(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 70])
def test_symmetric_int4_matches_float64_with_offsets_minus_8_scales(ops, dtype, rows):
    """llama.cpp's Q4_0 as Int4Linear holds it, no offsets: w = d (q - 8), d float16 and over
    8188 too (where -8 d would overflow a float16 offset), computed in float32."""
    from llama_mini.quant.layers import Int4Linear

    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 768, generator=g) * 1e-3).to(dtype)
    x[-1, 32:64] = -1e-3  # a block of codes -127: with row 4's, a block's largest sums
    codes = torch.randint(0, 16, (48, 768), generator=g, dtype=torch.uint8)
    codes[3], codes[4] = 0, 15  # the extremes
    d = (torch.rand(48, 24, generator=g) * 1e-2).half()
    d[5, 2] = 30000.0
    layer = Int4Linear.from_codes(codes, d, None)
    assert layer.symmetric and not hasattr(layer, "offsets")
    w = ((codes.double() - 8).unflatten(-1, (24, 32)) * d.double()[..., None]).flatten(-2)
    assert torch.equal(layer.dequantize(torch.float64), w)
    got, xq = ops.linear_int4(x, layer.weight, layer.scales, None).double(), quantized_activations(x).double()
    close(got[:, 6:], xq @ w[6:].t(), dtype)
    terms = xq.abs() @ w[:6].abs().t()  # row 5's products are large: float32 error in their size
    assert ((got[:, :6] - xq @ w[:6].t()).abs() <= 1e-5 * terms + (0 if dtype == torch.float32 else 8e-3 * terms)).all()


def q5_k_layer(n, k, g):
    """llama.cpp's Q5_K as its file holds it (Q5_KLinear): codes 0..31 (all 31 and all 0 in two
    rows), 6-bit sc and m per sub-block of 32 inputs (63 too), float16 d and dmin per 256, packed
    here as llama.cpp packs them (ggml-common.h's block_q5_K)."""
    from llama_mini.quant.k_quants import Q5_KLinear

    supers = k // 256
    codes = torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8)
    codes[3], codes[4] = 31, 0
    sc, m = torch.randint(0, 64, (2, n, supers, 8), generator=g, dtype=torch.uint8).long()
    sc[3], m[4] = 63, 63
    d, dmin = (torch.rand(2, n, supers, generator=g) * 1e-3 * torch.tensor([1.0, -1.0])[:, None, None]).half()
    factors = torch.cat((sc[..., :4] | (sc[..., 4:] >> 4 << 6), m[..., :4] | (m[..., 4:] >> 4 << 6),
                         (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)), -1)  # get_scale_min_k4's twelve bytes
    c = codes.view(n, supers, 8, 32).long()  # sub-block t: inputs 32t + i
    qh = sum(((c[:, :, t] >> 4) & 1) << t for t in range(8))  # byte i: input 32t + i's fifth bit in bit t
    ql = (c[:, :, 0::2] & 15) | ((c[:, :, 1::2] & 15) << 4)  # byte 32h + i: inputs 64h + i (low), 64h + 32 + i (high)
    halves = torch.stack((d, dmin), -1).view(torch.uint8).view(n, supers, 4).long()
    blocks = torch.cat((halves, factors, qh, ql.reshape(n, supers, 128)), -1).to(torch.uint8)
    per_input = lambda f, s: (s.double()[..., None] * f.double()).repeat_interleave(32, dim=-1).view(n, k)
    w = codes.double() * per_input(sc, d) - per_input(m, dmin)
    return Q5_KLinear(blocks.view(n, -1), k), w


def q6_k_layer(n, k, g):
    """llama.cpp's Q6_K as its file holds it (Q6_KLinear): codes 0..63 (all 63 and all 0 in two
    rows), an int8 scale per sub-block of 16 inputs (its extremes -128 and 127 too), a float16 d
    per 256, packed here as llama.cpp packs them (ggml-common.h's block_q6_K)."""
    from llama_mini.quant.k_quants import Q6_KLinear

    codes = torch.randint(0, 64, (n, k), generator=g, dtype=torch.uint8)
    codes[3], codes[4] = 63, 0
    factors = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
    factors[3, :], factors[4, :] = -128, 127
    d = (torch.rand(n, k // 256, generator=g) * 1e-3).half()
    c = codes.view(n, k // 256, 2, 2, 2, 32).long()  # block, half, high nibble?, second 32?, j: input 128 half + 64 nib + 32 sec + j
    ql = (c[:, :, :, 0] & 15) | ((c[:, :, :, 1] & 15) << 4)  # byte 64 half + 32 sec + j
    qh = sum(((c[:, :, :, i // 2, i % 2] >> 4) & 3) << (2 * i) for i in range(4))  # byte 32 half + j: input 128 half + 32 i + j
    blocks = torch.cat((ql.reshape(n, k // 256, 128), qh.reshape(n, k // 256, 64), factors.view(torch.uint8).view(n, k // 256, 16).long(),
                        d.view(torch.uint8).view(n, k // 256, 2).long()), -1).to(torch.uint8)
    w = (codes.double() - 32) * (d.double().repeat_interleave(16, dim=1) * factors.double()).repeat_interleave(16, dim=1)
    return Q6_KLinear(blocks.view(n, -1), k), w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 70, 130])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("make", [q5_k_layer, q6_k_layer], ids=["Q5_K", "Q6_K"])
def test_q5_k_and_q6_k_match_float64_as_the_files_blocks_hold_them(ops, make, dtype, rows, threads):
    """A decoding step reads the blocks where they are; from 16 rows a prompt widens them once per
    call (csrc/k_quants.cpp). The dequantized weights are exact in float32 to one rounding. Outputs
    of 92 rows: sets of eight in threads' bands and tiles, with four left over; the last row of x
    has a block whose first half is all -127 and its second +127 (each sub-block carries its own sums)."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 768, generator=g).to(dtype)
    x[-1, :16], x[-1, 16:32] = -1.0, 1.0
    layer, w = make(92, 768, g)
    assert torch.equal(layer.dequantize(), w.float())  # one float32 rounding of the exact weight, as gguf's
    got = ops.linear_k_quant(x, layer.blocks)
    close(got, quantized_activations(x, layer.activation_block).double() @ w.t(), dtype)
    torch.set_num_threads(1)


@pytest.mark.parametrize("rows", [1, 16])
def test_the_factored_int4_kernel_reads_super_scales_held_as_float32_alike(ops, rows):
    """Q4_K's layer holds d and -dmin as the file's float16; a checkpoint converted before held
    them as float32, the same values, and loads them as they are: the same outputs."""
    from llama_mini.quant.layers import Int4Linear

    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 768, generator=g)
    factors = torch.randint(0, 64, (2, 16, 24), generator=g, dtype=torch.uint8)
    supers = (torch.rand(2, 16, 3, generator=g) - 0.5).half()
    layer = Int4Linear.from_codes(torch.randint(0, 16, (16, 768), generator=g, dtype=torch.uint8), *factors, 32, *supers)
    op = ops.linear_int4
    names = [name for name in ("weight", "scales", "offsets", "super_scales", "super_offsets") if hasattr(layer, name)]
    held = [getattr(layer, name) for name in names]
    assert layer.super_scales.dtype == torch.float16
    widened = [t.float() if name.startswith("super") else t for name, t in zip(names, held)]
    assert torch.equal(op(x, *held), op(x, *widened))


def test_the_int8_layout_puts_each_rows_inputs_where_the_kernel_reads_them():
    """Row 8p + j's inputs 4c..4c+3 are bytes 4j..4j+3 of run c of set p (int4's layout is
    tests/quant/test_quantize.py's)."""
    codes = (torch.arange(16 * 64).reshape(16, 64) % 251 - 125).to(torch.int8)
    int8 = pack_int8(codes)
    assert int8.shape == (2, 512) and torch.equal(int8[1, 32 * 3 + 4 * 5: 32 * 3 + 4 * 5 + 4], codes[13, 12:16])
    assert torch.equal(unpack_int8(int8), codes)


def test_wrong_shapes_are_refused_by_the_operators(ops):
    with pytest.raises(RuntimeError, match="input of shape"):
        ops.linear_dense(torch.randn(1, 10), torch.randn(4, 12))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.linear_int8(torch.randn(1, 40), torch.zeros(1, 320, dtype=torch.int8), torch.ones(1, 8))
    with pytest.raises(RuntimeError, match="one per row and block of 32 inputs"):
        ops.linear_int8(torch.randn(1, 32), torch.zeros(1, 256, dtype=torch.int8), torch.ones(8))
    with pytest.raises(RuntimeError, match="Q5_K or Q6_K rows"):
        ops.linear_k_quant(torch.randn(1, 256), torch.zeros(1, 1, 192, dtype=torch.uint8))
    for block_bytes in (176, 210):
        with pytest.raises(RuntimeError, match="input of shape"):
            ops.linear_k_quant(torch.randn(1, 32), torch.zeros(1, 1, block_bytes, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="a contiguous 2-D weight"):
        ops.linear_dense(torch.randn(1, 12), torch.randn(12, 4).t())


# --- Attention over the cache -------------------------------------------------------------------


def reference_attention(q, k, v, cache, cos, sin, start):
    """model.py's path: rotate, store in the cache, attend with SDPA (float64), causally."""
    q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
    keys, values = cache.update(start, k.transpose(1, 2), v.transpose(1, 2))
    repeat, rows = q.shape[2] // k.shape[2], q.shape[1]
    mask = torch.ones(rows, start + rows, dtype=torch.bool).tril(start)
    out = F.scaled_dot_product_attention(q.transpose(1, 2).double(), keys.double().repeat_interleave(repeat, 1),
                                         values.double().repeat_interleave(repeat, 1), attn_mask=mask)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (8, 2, 16), (2, 1, 128)])
def test_attention_stores_the_cache_bit_for_bit_and_attends_as_sdpa(ops, dtype, heads, kv_heads, head_dim, cache_dtype=None):
    """A prompt from position 0, a decoding step, a chunk after cached positions, the last position."""
    args = ModelArgs(dim=heads * head_dim, n_heads=heads, n_kv_heads=kv_heads, vocab_size=8, max_seq_len=64)
    g = torch.Generator().manual_seed(heads + head_dim)
    ours, theirs = (KVCache(2, 40, kv_heads, head_dim, "cpu", cache_dtype or dtype) for _ in range(2))
    for start, rows in ((0, 20), (20, 1), (21, 18), (39, 1)):
        q = torch.randn(2, rows, heads, head_dim, generator=g).to(dtype)
        k, v = (torch.randn(2, rows, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
        cos, sin = rope_cos_sin(args, start, rows)
        got = ops.attention(q, k, v, ours.k, ours.v, cos, sin, start)
        expected = reference_attention(q, k, v, theirs, cos, sin, start)
        assert torch.equal(ours.k, theirs.k) and torch.equal(ours.v, theirs.v)  # RoPE and the write, exactly
        assert got.shape == (2, rows, heads, head_dim) and got.dtype == dtype
        close(got, expected, dtype)


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float16), (torch.bfloat16, torch.float16),
                                                (torch.float32, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (8, 2, 16), (2, 1, 48)])
def test_attention_over_a_cache_of_another_dtype_stores_and_reads_it_as_kvcache_does(ops, dtype, cache_dtype, heads,
                                                                                      kv_heads, head_dim):
    """A float16 cache (llama.cpp's) under float32 or bfloat16 activations, and the others:
    keys and values rounded to the cache's dtype as KVCache.update stores them, bit for bit,
    and attended as SDPA attends to them read back."""
    test_attention_stores_the_cache_bit_for_bit_and_attends_as_sdpa(ops, dtype, heads, kv_heads, head_dim, cache_dtype)


@pytest.mark.parametrize("head_dim", [8, 24, 48, 80, 96, 256])  # llama2.c's 8 and 48; a multiple of 8, not 16; Gemma's 256
def test_attention_takes_every_head_size_that_is_a_multiple_of_8(ops, head_dim):
    test_attention_stores_the_cache_bit_for_bit_and_attends_as_sdpa(ops, torch.float32, 4, 2, head_dim)


@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
                                                (torch.float32, torch.float16), (torch.bfloat16, torch.float16)])
def test_a_nan_in_a_key_gives_what_sdpa_gives(ops, dtype, cache_dtype):
    """A NaN score makes its query's softmax NaN: the queries that see the key, and no other;
    a float16 cache holds the NaN as it is."""
    args = ModelArgs(dim=128, n_heads=2, n_kv_heads=1, vocab_size=8, max_seq_len=64)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 12, 2, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, 12, 1, 64, generator=g).to(dtype) for _ in range(2))
    k[0, 5, 0, 7] = float("nan")
    cos, sin = rope_cos_sin(args, 0, 12)
    cache = KVCache(1, 16, 1, 64, "cpu", cache_dtype or dtype)
    got = ops.attention(q, k, v, cache.k, cache.v, cos, sin, 0)
    rq, rk = apply_rotary_emb(q, cos, sin).transpose(1, 2), apply_rotary_emb(k, cos, sin).transpose(1, 2)
    rk, rv = (t.to(cache.k.dtype).to(dtype) for t in (rk, v.transpose(1, 2)))  # as the cache holds them
    expected = F.scaled_dot_product_attention(rq, rk, rv, is_causal=True, enable_gqa=True).transpose(1, 2)
    assert torch.equal(got.isnan(), expected.isnan()) and got[0, 5:].isnan().all() and not got[0, :5].isnan().any()
    close(got[0, :5], expected[0, :5].double(), dtype)
    step = ops.attention(q[:, :1], k[:, :1], v[:, :1], cache.k, cache.v, *rope_cos_sin(args, 12, 1), 12)  # a decoding step sees it too
    assert step.isnan().all()


@pytest.mark.parametrize("kind", ["int8", "int4", "int8, float16 scales", "factored int4", "symmetric int4", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_or_inf_in_an_integer_layers_input_gives_what_its_definition_gives(ops, kind, dtype, value):
    """quantized_activations turns a block (of 32, or the K-quants' 256) holding a NaN or an infinity into NaNs (inf * 0,
    NaN * anything), so every output of that row is NaN; the other rows are untouched. Wherever
    the value sits in its block, the first lane, the last, or between."""
    from llama_mini.quant.layers import Int4Linear, Int8Linear

    g = torch.Generator().manual_seed(0)
    k = 256 if kind in ("Q5_K", "Q6_K") else 96  # the K-quants' super-blocks
    w = torch.randn(16, k, generator=g).to(dtype)
    layer = {"int8": lambda: Int8Linear.from_weight(w), "int4": lambda: Int4Linear.from_weight(w),
             "int8, float16 scales": lambda: Int8Linear.from_weight(w, torch.float16),  # a GGUF file's Q8_0
             "factored int4": lambda: factored_int4(16, 96, g).to(dtype),  # a GGUF file's Q4_K
             "symmetric int4": lambda: Int4Linear.from_codes(torch.randint(0, 16, (16, k), generator=g, dtype=torch.uint8),
                                                             (torch.rand(16, k // 32, generator=g) / 8).half(), None),  # Q4_0
             "Q5_K": lambda: q5_k_layer(16, k, g)[0], "Q6_K": lambda: q6_k_layer(16, k, g)[0]}[kind]()
    fast = use_cpu_kernels(torch.nn.Sequential(copy.deepcopy(layer)))[0]
    for position in (0, 5, 31, 32, 63, 95, k - 1):
        x = torch.randn(5, k, generator=g).to(dtype)  # a tile of four rows and one of one
        x[1, position] = value
        with torch.inference_mode():
            got, expected = fast(x), layer(x)
        assert got[1].isnan().all() and expected[1].isnan().all(), position
        assert torch.equal(got[[0, 2, 3, 4]], fast(x[[0, 2, 3, 4]])) and not got[[0, 2, 3, 4]].isnan().any()


def q8_0_layer(n, k, g):
    """A GGUF file's Q8_0 rows as the kernels read them where the file maps them: per block of 32
    inputs a float16 scale, then 32 int8 codes."""
    from llama_mini.quant.mapped_q8_0 import MappedQ8_0Linear

    scales = (torch.rand(n, k // 32, 1, generator=g) / 64).half().view(torch.uint8)
    codes = torch.randint(-127, 128, (n, k // 32, 32), generator=g, dtype=torch.int8).view(torch.uint8)
    return MappedQ8_0Linear(torch.cat((scales, codes), -1).view(n, -1), k)


SHARED_BANDS = {"float32": lambda w, g: torch.nn.Linear(w.shape[1], w.shape[0], bias=False).requires_grad_(False),
                "bfloat16 panels": lambda w, g: torch.nn.Linear(w.shape[1], w.shape[0], bias=False).bfloat16().requires_grad_(False),
                "int8": lambda w, g: Int8Linear.from_weight(w), "int4": lambda w, g: Int4Linear.from_weight(w),
                "factored int4": lambda w, g: factored_int4(w.shape[0], w.shape[1], g),
                "symmetric int4": lambda w, g: Int4Linear.from_codes(torch.randint(0, 16, w.shape, generator=g, dtype=torch.uint8),
                                                                     (torch.rand(w.shape[0], w.shape[1] // 32, generator=g) / 8).half(), None),
                "Q8_0": lambda w, g: q8_0_layer(*w.shape, g), "Q5_K": lambda w, g: q5_k_layer(*w.shape, g)[0],
                "Q6_K": lambda w, g: q6_k_layer(*w.shape, g)[0]}


@pytest.mark.parametrize("kind", SHARED_BANDS)
@pytest.mark.parametrize("rows", [1, 70])
def test_every_kernel_gives_the_same_bits_however_its_threads_share_the_bands(ops, kind, rows):
    """Threads take pieces of each other's bands as they finish theirs (csrc/simd.h,
    for_row_bands), so who computes which rows changes from call to call. More threads than this
    machine's cores make them finish unevenly; every call, on any count of threads, gives the
    bits one thread gives."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(1024, 768, generator=g)
    layer = use_cpu_kernels(torch.nn.Sequential(SHARED_BANDS[kind](w, g)))[0]
    dtype = torch.bfloat16 if kind == "bfloat16 panels" else torch.float32
    x = torch.randn(rows, 768, generator=g).to(dtype)
    with torch.inference_mode():
        alone = layer(x)
        for threads in (2, 3, 5):
            torch.set_num_threads(threads)
            for _ in range(10):
                assert torch.equal(layer(x), alone), threads
    torch.set_num_threads(1)


# A layer without inputs runs in a child process: a division by zero would kill the process.
NO_INPUTS = r"""
import torch
from llama_mini.kernels import use_cpu_kernels
from llama_mini.kernels.operators import operators
from llama_mini.quant.layers import Int4Linear, Int8Linear
ops = operators()
layers = [torch.nn.Linear(0, 5, bias=False), Int8Linear.from_weight(torch.empty(8, 0)), Int4Linear.from_weight(torch.empty(8, 0))]
with torch.inference_mode():
    for layer in layers:
        for x in (torch.randn(3, 0), torch.randn(2, 4, 0).bfloat16()):
            fast = use_cpu_kernels(torch.nn.Sequential(layer.to(x.dtype)))[0]
            assert torch.equal(fast(x), torch.nn.functional.linear(x, torch.zeros(layer.out_features, 0, dtype=x.dtype))), layer
    assert torch.equal(ops.linear_int8(torch.randn(2, 0), torch.zeros(1, 0, dtype=torch.int8), torch.ones(1, 0)), torch.zeros(2, 8))
print("zeros")
"""


def test_a_layer_without_inputs_gives_zeros_as_torch_does(ops):
    result = subprocess.run([sys.executable, "-c", NO_INPUTS], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0 and result.stdout == "zeros\n", (result.returncode, result.stdout + result.stderr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglus_gate_is_silu_times_b_computed_alike_for_every_element(ops, dtype):
    """The gate of csrc/swiglu.cpp is F.silu(a) * b within float rounding, and each element's
    value does not depend on where it sits: alone, at any offset or tensor size, at any thread count."""
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(50_000, generator=g) * 6).to(dtype)
    b = torch.randn(50_000, generator=g).to(dtype)
    a[:4] = torch.tensor([float("nan"), 100.0, -100.0, 0.0]).to(dtype)  # NaN stays NaN; exp's ends
    got = ops.swiglu(a, b)
    expected = F.silu(a.double()) * b.double()
    assert got.dtype == dtype and got[0].isnan() and not got[1:].isnan().any()
    close(got[1:], expected[1:], dtype)
    alone = torch.cat([ops.swiglu(a[i:i + 1], b[i:i + 1]) for i in range(1, 300)])
    assert torch.equal(alone, got[1:300])
    for size in (1, 7, 15, 16, 17, 172, 200):
        assert torch.equal(ops.swiglu(a[3:3 + size], b[3:3 + size]), got[3:3 + size]), size
    for threads in (2, 3, 6):
        torch.set_num_threads(threads)
        torch.testing.assert_close(ops.swiglu(a, b), got, rtol=0, atol=0, equal_nan=True, msg=f"{threads} threads")
    torch.set_num_threads(1)


# --- A model on the kernels ------------------------------------------------------------------------


def kernel_model(seed=0, **overrides):
    """The shared tiny model (tests/fixtures.py) with 8 query heads to each pair of key-value heads."""
    return tiny_model(seed, **{"n_heads": 8, "vocab_size": 128, "max_seq_len": 256, **overrides})


def test_use_cpu_kernels_swaps_every_linear_and_keeps_the_weights(ops):
    model = kernel_model()
    weights = {name: p.data_ptr() for name, p in model.named_parameters()}
    state = {name: t.clone() for name, t in model.state_dict().items()}
    use_cpu_kernels(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is KernelLinear for m in linears)
    # Shared, not copied; but float32 weights the kernels read in panels, those.
    in_panels = {name + ".weight" for name, m in model.named_modules() if getattr(m, "in_panels", False)}
    assert in_panels
    assert {name: p.data_ptr() for name, p in model.named_parameters() if name not in in_panels} == {
        name: ptr for name, ptr in weights.items() if name not in in_panels}
    for name in in_panels:
        rows = state[name]
        assert torch.equal(model.get_parameter(name), rows.unflatten(0, (-1, 16)).transpose(1, 2))
    assert all(type(layer) is KernelBlock for layer in model.layers)  # a block's decoding step in one call
    saved = model.state_dict()  # the checkpoint it saves is the plain model's
    assert list(saved) == list(state) and all(torch.equal(saved[name], state[name]) for name in state)
    model.load_state_dict({name: 2 * t for name, t in state.items()})  # and it loads one
    assert all(torch.equal(t, 2 * state[name]) for name, t in model.state_dict().items())
    assert all(model.get_parameter(name).dim() == 3 for name in in_panels)


def test_a_model_cast_after_use_cpu_kernels_computes_what_the_cast_model_does(ops):
    """Cast to bfloat16 after use_cpu_kernels, float32 weights held in panels become bfloat16
    panels, which the kernels read as such."""
    model, reference = use_cpu_kernels(kernel_model()), kernel_model()
    model.to(torch.bfloat16), reference.to(torch.bfloat16)
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_holds_its_own_weights_in_panels(ops, dtype):
    """A bfloat16 or float16 model's linear weights are read in panels of their own dtype: the
    same bytes as its rows (none made float32), the layer's outputs the rows' product. An input
    of another dtype than the weight's gets torch's own error, as the layer off the kernels does."""
    model = kernel_model().to(dtype)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    use_cpu_kernels(model)
    in_panels = [m for m in model.modules() if getattr(m, "in_panels", False)]
    assert in_panels and all(m.weight.dtype == dtype and m.weight.dim() == 3 for m in in_panels)
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == size
    layer = in_panels[0]
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.inference_mode():
        close(layer(x), x.double() @ layer.weight_rows().double().t(), dtype)
        with pytest.raises(RuntimeError, match="dtype"):
            layer(x.float())


def block_on_the_operators(ops, block, x, cos, sin, start):
    """TransformerBlock.forward over the cache, written out on the kernels: the block's own norm
    and linear modules (which run them), the attention operator and SwiGLU's gate."""
    attention, ffn, (batch, rows) = block.attention, block.feed_forward, x.shape[:2]
    h = block.attention_norm(x)
    q, k, v = (linear(h).view(batch, rows, -1, attention.head_dim) for linear in (attention.wq, attention.wk, attention.wv))
    out = ops.attention(q, k, v, attention.cache.k, attention.cache.v, cos, sin, start)
    h = x + attention.wo(out.view(batch, rows, -1))
    g = block.ffn_norm(h)
    return h + ffn.w2(ops.swiglu(ffn.w1(g), ffn.w3(g)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("cache_dtype", [None, torch.float16], ids=["cache-as-model", "cache-f16"])
def test_a_layers_forward_is_its_operators_bit_for_bit(ops, dtype, quantization, cache_dtype):
    from llama_mini.quant import quantize

    model = kernel_model(n_layers=1).to(dtype)
    model.cache_dtype = cache_dtype
    if quantization:
        quantize(model, quantization)
    use_cpu_kernels(model)
    block = model.layers[0]
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        model.setup_cache(2, 40)
        model(torch.randint(0, 128, (2, 12), generator=g), 0)  # a prompt in the cache
        cache = block.attention.cache
        before = cache.k.clone(), cache.v.clone()
        for start, rows in ((12, 1), (13, 1), (14, 20)):  # decoding steps, then a chunk of a prompt
            x = torch.randn(2, rows, 64, generator=g).to(dtype)
            cos, sin = rope_cos_sin(model.args, start, rows)
            got = block_on_kernels(block, x, cos, sin, start)
            after = cache.k.clone(), cache.v.clone()
            cache.k.copy_(before[0]), cache.v.copy_(before[1])
            expected = block_on_the_operators(ops, block, x, cos, sin, start)
            assert got is not None and torch.equal(got, expected)
            assert torch.equal(after[0], cache.k) and torch.equal(after[1], cache.v)
            before = after


# (dtype, quantization, shape): 110M-like proportions, and an odd head size (48) and hidden size (172)
REUSED = [(torch.float32, None, dict(dim=256, hidden_dim=768)), (torch.float32, "int8", dict(dim=256, hidden_dim=768)),
          (torch.bfloat16, None, dict(dim=256, hidden_dim=768)),
          (torch.float32, None, dict(dim=96, n_heads=2, n_kv_heads=1, hidden_dim=172))]


@pytest.mark.parametrize("dtype, quantization, shape", REUSED, ids=["fp32", "int8", "bf16", "head-48-hidden-172"])
def test_a_prompt_chunks_activations_in_reused_buffers_are_its_operators_bit_for_bit(ops, dtype, quantization, shape):
    """Activations of 64 KB and more (here a batch of two rows of 256 positions) come from buffers
    earlier layers let go (csrc/activations.cpp): the same numbers, layer after layer and chunk
    after chunk (the last ones short: 70 rows, 17, 1), NaN where the operators give it, as the
    operators give in buffers of their own."""
    from llama_mini.quant import quantize

    model = kernel_model(n_layers=2, max_seq_len=700, **shape).to(dtype)
    if quantization:
        quantize(model, quantization)
    use_cpu_kernels(model)
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        model.setup_cache(2, 700)
        for start, rows in ((0, 256), (256, 256), (512, 70), (582, 17), (599, 1)):
            x = torch.randn(2, rows, model.args.dim, generator=g).to(dtype)
            if rows == 70:
                x[1, 3, 5] = float("nan")  # the second row's positions from 3 on attend to it
            cos, sin = rope_cos_sin(model.args, start, rows)
            for block in model.layers:
                cache = block.attention.cache
                before = cache.k.clone(), cache.v.clone()
                expected = block_on_the_operators(ops, block, x, cos, sin, start)
                cache.k.copy_(before[0]), cache.v.copy_(before[1])
                got = block_on_kernels(block, x, cos, sin, start)
                assert got is not None
                torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
                x = got


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_a_prompt_chunk_holds_about_one_layers_activations_at_once(ops):
    """A chunk of 256 positions through twelve layers of 110M's shape (dim 768, hidden 2048)
    raises a process's peak by about what one layer holds at once, five activations of dim and
    two of hidden (8.1 MB), whatever the layer count: each layer's activations take the buffers
    the layer before let go. Allocated anew in each layer, the C library's heap grew around them
    to 18-19 MB."""
    code = (
        "import torch\n"
        "from llama_mini import ModelArgs, Transformer\n"
        "from llama_mini.generation import prefill\n"
        "from llama_mini.kernels import use_cpu_kernels\n"
        "torch.manual_seed(0)\n"
        "args = ModelArgs(dim=768, n_layers=12, n_heads=12, vocab_size=512, hidden_dim=2048, max_seq_len=512)\n"
        "model = use_cpu_kernels(Transformer(args).eval())\n"
        "tokens = torch.randint(0, 512, (1, 256))\n"
        "peak = lambda: next(int(line.split()[1]) * 1024 for line in open('/proc/self/status') if line.startswith('VmHWM'))\n"
        "with torch.inference_mode():\n"
        "    model.setup_cache(1, 300)\n"
        "    prefill(model, tokens[:, :1])  # the threads and their buffers\n"
        "    before = peak()\n"
        "    prefill(model, tokens)\n"
        "print(peak() - before)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    one_layer = (5 * 768 + 2 * 2048) * 4 * 256
    assert int(result.stdout.split()[-1]) < 1.25 * one_layer


def test_a_step_past_the_cache_is_left_to_the_models_own_error(ops):
    model = use_cpu_kernels(kernel_model())
    model.setup_cache(1, 4)
    with torch.inference_mode(), pytest.raises(ValueError, match="do not fit the KV cache"):
        model(torch.tensor([[3]]), 4)  # block_on_kernels declines; KVCache.update says what is wrong


def test_a_model_changed_between_generations_decodes_with_its_new_weights(ops):
    """block_on_kernels gathers a block's weights once per KV cache: quantizing a model after
    use_cpu_kernels, then generating (which sets up a new cache), runs the quantized weights."""
    from llama_mini.quant import quantize

    changed, expected = use_cpu_kernels(kernel_model()), kernel_model()
    generate(changed, [[1, 2, 3]], 8, temperature=0)
    quantize(changed, "int8")
    use_cpu_kernels(changed)  # the quantized layers onto the kernels too
    quantize(expected, "int8")
    use_cpu_kernels(expected)
    assert generate(changed, [[1, 2, 3]], 30, temperature=0) == generate(expected, [[1, 2, 3]], 30, temperature=0)
    with torch.inference_mode():
        changed.setup_cache(1, 8), expected.setup_cache(1, 8)
        changed(torch.tensor([[1, 2]]), 0), expected(torch.tensor([[1, 2]]), 0)
        assert torch.equal(changed(torch.tensor([[5]]), 2), expected(torch.tensor([[5]]), 2))


def test_decoding_with_gradients_runs_the_models_own_operations(ops):
    model = use_cpu_kernels(kernel_model())
    model.setup_cache(1, 8)
    with torch.no_grad():
        model(torch.tensor([[1, 2]]), 0)
    logits = model(torch.tensor([[5]]), 2)  # grad mode, trainable weights: autograd needs torch's operations
    logits.sum().backward()
    assert model.layers[0].feed_forward.w2.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])  # a norm the block operator does not take: the blocks' own code runs
@pytest.mark.parametrize("cache_dtype", [None, torch.float16, torch.float32], ids=["cache-as-model", "cache-f16", "cache-f32"])
def test_decoding_on_the_kernels_gives_the_models_logits(ops, dtype, norm, cache_dtype):
    reference = kernel_model(norm=norm).to(dtype)
    reference.cache_dtype = cache_dtype
    fast = use_cpu_kernels(copy.deepcopy(reference))
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for model in (reference, fast):
            model.setup_cache(2, 24)
        steps = [(tokens[:, :8], 0)] + [(tokens[:, p:p + 1], p) for p in range(8, 24)]  # a prompt, then 16 steps
        for chunk, position in steps:
            expected, got = reference(chunk, position), fast(chunk, position)
            spread = (expected.amax(-1) - expected.amin(-1)).max()
            assert (got - expected).abs().max() <= (1e-5 if dtype == torch.float32 else 0.03) * spread


def test_training_runs_torchs_kernels():
    """Gradients flow through a KernelLinear: with autograd, torch's F.linear runs."""
    layer = use_cpu_kernels(torch.nn.Sequential(torch.nn.Linear(32, 8, bias=False)))[0]
    x = torch.randn(1, 3, 32, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_row_is_computed_as_if_alone_at_every_row_count(ops, dtype):
    """A row's output does not depend on the rows beside it, bit for bit: a decoding step, a
    batch and a prompt of any length run one kernel per layer type, each output summed in one
    order (csrc/simd.h)."""
    from llama_mini.quant.layers import Int4Linear, Int8Linear

    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g)
    layers = {"dense": torch.nn.Linear(96, 40, bias=False), "int8": Int8Linear.from_weight(w), "int4": Int4Linear.from_weight(w),
              "factored int4": factored_int4(40, 96, g), "Q5_K": q5_k_layer(44, 512, g)[0], "Q6_K": q6_k_layer(44, 512, g)[0]}
    for name, layer in layers.items():
        layer = use_cpu_kernels(torch.nn.Sequential(layer.to(dtype)))[0]
        for rows in (2, 5, 17, 64, 150):  # tiles of 4 and 1, a prompt's tiles
            x = torch.randn(rows, layer.in_features, generator=g).to(dtype)
            with torch.inference_mode():
                assert torch.equal(layer(x), torch.cat([layer(row) for row in x.split(1)])), (name, rows)


def factored_int4(n, k, g):
    """An Int4Linear with factored scales and offsets (super-groups of 96 inputs, groups of 32)."""
    from llama_mini.quant.layers import Int4Linear

    codes, factors = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), torch.randint(0, 64, (2, n, k // 32), generator=g, dtype=torch.uint8)
    return Int4Linear.from_codes(codes, *factors, 32, torch.rand(n, k // 96, generator=g) * 0.01, -torch.rand(n, k // 96, generator=g) * 0.2)


def test_a_weight_that_is_not_one_piece_of_memory_runs_the_layers_own_code(ops):
    """A transposed or sliced weight (a view, not contiguous) is not an error: torch's F.linear runs."""
    model = kernel_model()
    reference = copy.deepcopy(model)
    wq = model.layers[0].attention.wq
    wq.weight = torch.nn.Parameter(wq.weight.detach().t().contiguous().t())  # the same values, column-major
    assert not wq.weight.is_contiguous()
    use_cpu_kernels(model)
    x = torch.randn(1, 5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(wq(x), F.linear(x, wq.weight), rtol=0, atol=0)
    prompt = [1, 17, 42, 99, 5]
    assert generate(model, [prompt], 20, temperature=0) == generate(reference, [prompt], 20, temperature=0)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_under_autocast_a_model_on_the_kernels_computes_what_it_does_off_them(ops, quantization):
    """torch.autocast(bfloat16) rounds the float layers' operands to bf16: on the kernels too, the
    output is autocast's (KernelLinear steps aside). The quantized layers compute their own
    function, float32 arithmetic, autocast or not."""
    from llama_mini.quant import quantize

    reference = kernel_model()
    if quantization:
        quantize(reference, quantization)
    fast = use_cpu_kernels(copy.deepcopy(reference))
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        off = reference(tokens)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = reference(tokens), fast(tokens)
        for model in (reference, fast):
            model.setup_cache(2, 24)
            model(tokens[:, :8], 0)
        step = reference(tokens[:, 8:9], 8), fast(tokens[:, 8:9], 8)  # decoding steps too
    spread = (expected.amax(-1) - expected.amin(-1)).max()
    assert (got - expected).abs().max() <= 1e-5 * spread
    assert (step[1] - step[0]).abs().max() <= 1e-5 * spread
    # autocast changes the float model's numbers: the test tells them apart
    assert quantization or (off - expected).abs().max() > 1e-3 * spread


def test_greedy_decoding_on_the_kernels_equals_transformers(ops):
    transformers = pytest.importorskip("transformers")
    from llama_mini.formats.hf import hf_config_from_args, to_hf_state_dict

    ours = kernel_model(seed=0)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config_from_args(ours.args))).eval()
    theirs.load_state_dict(to_hf_state_dict(ours.state_dict(), ours.args), strict=False)
    theirs.generation_config.eos_token_id = None  # token 2 is an ordinary token here: nothing stops or is suppressed
    prompt = [1, 17, 42, 99, 5]
    expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False, pad_token_id=0)
    assert generate(use_cpu_kernels(ours), [prompt], 60, temperature=0)[0] == expected[0, len(prompt):].tolist()


@pytest.mark.slow
def test_generate_cli_decodes_on_the_kernels_what_the_model_does(ops, tmp_path):
    """generate.py runs use_cpu_kernels: its sampled text is generate()'s on a model on the kernels."""
    from llama_mini.tokenizers import open_tokenizer

    fixture = require(LLAMA2_TOKENIZER)
    model = kernel_model(seed=4, vocab_size=32000, dim=128, n_heads=4, n_kv_heads=4)
    save_checkpoint(model, tmp_path, tokenizer_path=fixture)
    result = run("--ckpt", tmp_path, "--prompt", "Hello", "--max-new-tokens", 40, "--seed", 7)
    assert result.returncode == 0, result.stderr
    tokenizer = open_tokenizer(fixture)
    prompt = tokenizer.encode("Hello")
    fast = use_cpu_kernels(load_checkpoint(tmp_path))
    new = generate(fast, [prompt], 40, temperature=0.6, top_p=0.9, eos_id=tokenizer.stop_ids, seed=7)[0]
    assert result.stdout == tokenizer.decode(prompt + new) + "\n"
