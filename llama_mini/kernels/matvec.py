"""Matrix-vector products for decoding: every weight streamed once, at memory speed.

Decoding a token multiplies each weight matrix by one activation row, so on a CPU tokens/s is
bounded by memory bandwidth / weight bytes. torch's CPU kernels are matrix-matrix kernels run
at one row: on a 2-core machine they read bf16 weights at well under the copy bandwidth, and
the int8 and int4 kernels convert every weight to float (figures in docs/generate_speed.md).
The operators of csrc/matvec.cpp stream the weights in bands per thread and, for integer
weights, multiply integers as llama.cpp does (activations rounded to int8 in blocks of 32).

They run for inputs of at most MAX_ROWS rows (a decoding step, a short prompt), on CPU,
without autograd; everything else (a long prompt, training, CUDA) runs torch's kernels.
use_matvec also gives each transformer block decode_layer, which runs a decoding step of the
whole block in one call. Compiled with the fused RMSNorm (build.py), and self-checked when
first loaded.
"""

import functools
import logging
import subprocess
import weakref

import torch
from torch import nn

from ..model import RMSNorm
from . import build
from .fused_rmsnorm import cpu_kernel

# Rows of x up to which the matrix-vector kernels beat torch's matrix-matrix ones: each row
# costs the kernels a pass over the weights in cache.
MAX_ROWS = 16
BLOCK = 32  # activations per int8 block (csrc/matvec.h)

log = logging.getLogger(__name__)


@functools.cache
def operators():
    """torch.ops.llama_mini with the matvec operators loaded and checked, or None (said once)."""
    try:
        with torch.device("cpu"), torch.inference_mode():
            build.load()
            ops = torch.ops.llama_mini
            if not ops.matvec_available():
                log.debug("llama_mini: no matrix-vector kernels for this CPU (they need AVX2 and FMA)")
                return None
            _self_check(ops)
        return ops
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        log.warning("llama_mini: decoding kernels unavailable (%s); using torch's", (str(e).splitlines() or ["?"])[0])
        return None


FLOATS = (torch.float32, torch.bfloat16)  # the activation, weight and scale dtypes the kernels read


def operators_for(x: torch.Tensor, floats: torch.Tensor):
    """The operators, if they should compute x W^T (floats: W, or its scales); None where
    torch's kernels should. Cheapest checks first: this runs for every layer of every step."""
    if not x.is_cpu or x.dtype not in FLOATS or floats.dtype not in FLOATS or x.numel() > MAX_ROWS * x.shape[-1]:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or floats.requires_grad):
        return None
    if torch.compiler.is_compiling():  # Inductor compiles torch's own ops; ours would break the graph
        return None
    return operators()


class MatvecLinear(nn.Linear):
    """nn.Linear (no bias) whose decoding steps run the matrix-vector kernel."""

    def forward(self, x):
        ops = operators_for(x, self.weight) if self.bias is None else None
        return super().forward(x) if ops is None else ops.matvec_dense(x, self.weight)

    def kernel_operands(self):
        """(weight, scales, zeros) as decode_layer passes them to the kernels, or None."""
        return (self.weight, None, None) if self.bias is None and self.weight.dtype in FLOATS else None


HEAD_DIMS = (8, 16, 32, 64, 128)  # the head sizes the attention kernel takes


def decode_layer(block, x, cos, sin, start_pos: int):
    """TransformerBlock.decode_step on the kernels: the norms, the seven products, RoPE, the
    cache write, attention and the residual adds of one decoded position, in one call (the
    operator llama_mini::decode_layer, csrc/decode_layer_op.cpp). None where the kernels
    cannot run the block: the model's own code then runs, and says what is wrong if anything is."""
    cache = block.attention.cache
    gathered = _layer_operands.get(cache)
    if gathered is None or gathered[0] != x.dtype:
        gathered = _layer_operands[cache] = (x.dtype, *_gather_operands(block, x.dtype))
    _, trainable, operands = gathered
    if operands is None or not x.is_cpu or x.shape[0] > min(MAX_ROWS, cache.k.shape[0]) or start_pos >= cache.k.shape[2]:
        return None
    if torch.compiler.is_compiling() or torch.is_grad_enabled() and (x.requires_grad or trainable):
        return None  # autograd needs the model's own operations
    return operators().decode_layer(x, *operands, cos, sin, start_pos)


# A block's operands, gathered once per KV cache (setup_cache begins each generation, and a
# model is not changed in the middle of one): reading them from the modules costs about a
# microsecond per attribute, tens of microseconds a layer, as much as a small layer's arithmetic.
_layer_operands = weakref.WeakKeyDictionary()


def _gather_operands(block, dtype):
    """(whether any of them requires grad, decode_layer's operands for `block` decoding `dtype`
    but cos, sin and the position); the operands are None where the kernels do not run the
    block (other norms, head sizes or dtypes, layers without kernel operands)."""
    attention, cache = block.attention, block.attention.cache
    if dtype not in FLOATS or cache.k.dtype != dtype or attention.head_dim not in HEAD_DIMS:
        return False, None
    norms = (block.attention_norm, block.ffn_norm)
    if not all(isinstance(norm, RMSNorm) and norm.n_rms == norm.weight.shape[0] and norm.weight.dtype == dtype for norm in norms):
        return False, None
    ffn = block.feed_forward
    linears = (attention.wq, attention.wk, attention.wv, attention.wo, ffn.w1, ffn.w2, ffn.w3)
    operands = [linear.kernel_operands() if hasattr(linear, "kernel_operands") else None for linear in linears]
    rms_norm = cpu_kernel()[0]
    if None in operands or rms_norm is None or norms[0].eps != norms[1].eps:
        return False, None
    weights, scales, zeros = zip(*operands)
    trainable = any(t is not None and t.requires_grad for t in (norms[0].weight, norms[1].weight, *weights, *scales, *zeros))
    return trainable, (norms[0].weight, norms[1].weight, norms[0].eps, rms_norm.vector_bytes, weights, scales, zeros, cache.k, cache.v)


def use_matvec(model: nn.Module) -> nn.Module:
    """Run model's decoding steps on the kernels; returns model.

    Every plain nn.Linear becomes a MatvecLinear sharing its weight, and every transformer
    block runs its decoding steps with decode_layer. Builds or loads the kernels now (a first
    build says so), not at the first token; where they cannot run, model is left as it is.
    """
    if operators() is None:
        return model
    for module in model.modules():
        if hasattr(module, "decode_step"):
            module.decode_step = decode_layer
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                with torch.device("meta"):
                    faster = MatvecLinear(child.in_features, child.out_features, bias=child.bias is not None)
                faster.weight, faster.bias = child.weight, child.bias
                setattr(parent, name, faster)
    return model


# --- Known answers at load ---------------------------------------------------------------------


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the integer kernels see it: rounded to int8 in blocks of 32 along the last axis,
    each block with the scale absmax / 127 (float32 arithmetic, ties to even)."""
    blocks = x.float().unflatten(-1, (-1, BLOCK))
    absmax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.div(torch.tensor(127.0), absmax)  # not 127 / absmax: torch computes that as 127 * (1 / absmax)
    codes = torch.round(blocks * torch.where(absmax > 0, inverse, 0.0))
    return (codes * (absmax / 127)).flatten(-2)


def _self_check(ops) -> None:
    """Refuse kernels that compiled but compute something else: each operator, every dtype
    pair, shapes with tails (rows and inputs not a multiple of the blocks), against float64."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 320, generator=g).to(dtype)
        xq = quantized_activations(x).double()
        w = torch.randn(7, 320, generator=g)
        codes = torch.randint(-127, 128, (16, 320), generator=g, dtype=torch.int8)
        scales = (torch.rand(16, generator=g) + 0.5).to(dtype)
        nibbles = torch.randint(0, 16, (16, 320), generator=g, dtype=torch.uint8)
        group_scales, zeros = (torch.rand(16, 5, generator=g) + 0.5).to(dtype), torch.randn(16, 5, generator=g).to(dtype)
        int4 = ((nibbles.double() - 8).unflatten(-1, (5, 64)) * group_scales.double()[..., None] + zeros.double()[..., None]).flatten(-2)
        checks = (
            (ops.matvec_dense(x, w.to(dtype)), x.double() @ w.to(dtype).double().t()),
            (ops.matvec_int8(x, pack_int8(codes), scales), xq @ (codes.double() * scales.double()[:, None]).t()),
            (ops.matvec_int4(x, pack_int4(nibbles), interleave_rows(group_scales), interleave_rows(zeros)), xq @ int4.t()),
        )
        for got, expected in checks:
            if got.dtype != dtype or not torch.allclose(got.double(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3):
                raise RuntimeError("the compiled matrix-vector kernels disagree with the reference")


# --- The integer layouts (csrc/matvec.h) ------------------------------------------------------
#
# Rows in sets of eight, so that one load feeds eight rows. int8: for each set, runs of 32 bytes
# in input order, bytes 4j..4j+3 of run c holding inputs 4c..4c+3 of row j. int4: for each set
# and block of 32 inputs, 128 bytes; in run c (32 bytes) of a block, bytes 4j..4j+3 are row j's,
# byte 4j + u holding input 8c + u in its low nibble and 8c + 4 + u in its high nibble. int4's
# scales and zeros likewise hold the eight rows of a set side by side.

ROW_SET = 8


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes (n, k), n % 8 == 0 and k % 32 == 0 -> the kernel's layout (n / 8, 8 k)."""
    n, k = codes.shape
    return codes.reshape(n // ROW_SET, ROW_SET, k // 4, 4).transpose(1, 2).reshape(n // ROW_SET, ROW_SET * k)


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """pack_int8's inverse: (n / 8, 8 k) -> (n, k)."""
    sets, k = packed.shape[0], packed.shape[1] // ROW_SET
    return packed.reshape(sets, k // 4, ROW_SET, 4).transpose(1, 2).reshape(sets * ROW_SET, k)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 (n, k), n % 8 == 0 and k % 32 == 0 -> the kernel's bytes (n / 8, 4 k)."""
    n, k = codes.shape
    nibbles = codes.reshape(n // ROW_SET, ROW_SET, k // BLOCK, 4, 2, 4)  # set, row, block, run, high?, u
    bytes_ = nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)  # set, row, block, run, u
    return bytes_.permute(0, 2, 3, 1, 4).reshape(n // ROW_SET, 4 * k)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: (n / 8, 4 k) bytes -> codes (n, k)."""
    sets, k = packed.shape[0], packed.shape[1] // 4
    bytes_ = packed.reshape(sets, k // BLOCK, 4, ROW_SET, 4)  # set, block, run, row, u
    nibbles = torch.stack((bytes_ & 0xF, bytes_ >> 4), dim=-2)  # set, block, run, row, high?, u
    return nibbles.permute(0, 3, 1, 2, 4, 5).reshape(sets * ROW_SET, k)


def interleave_rows(t: torch.Tensor) -> torch.Tensor:
    """(n, groups) -> (n / 8, groups * 8): each set's eight rows side by side."""
    n, groups = t.shape
    return t.reshape(n // ROW_SET, ROW_SET, groups).transpose(1, 2).reshape(n // ROW_SET, groups * ROW_SET)


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    sets, width = t.shape
    return t.reshape(sets, width // ROW_SET, ROW_SET).transpose(1, 2).reshape(sets * ROW_SET, width // ROW_SET)
