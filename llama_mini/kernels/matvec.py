"""Decoding on the CPU kernels, applied from outside: use_matvec(model).

Decoding a token multiplies each weight matrix by one activation row, so on a CPU tokens/s is
bounded by memory bandwidth / weight bytes. torch's CPU kernels are matrix-matrix kernels run
at one row, and its int8 and int4 kernels convert every weight to float. The operators of
csrc/matvec.cpp stream the weights in bands per thread and, for integer weights, multiply
integers with the activations rounded to int8 in blocks of 32 (quant/layers.py's definition,
as llama.cpp does).

use_matvec swaps the class of each linear layer and transformer block for a subclass that adds
a fast path and keeps the module's state: inputs of at most MAX_ROWS rows (a decoding step, a
short prompt) on CPU, without autograd, run the kernels, and a block's decoding step runs in one
call (decode_layer). Everything else runs the parent class's own code. Compiled with the fused
RMSNorm (build.py), and checked against known answers when first loaded.
"""

import functools
import logging
import subprocess
import weakref

import torch
from torch import nn

from ..model import RMSNorm, TransformerBlock
from ..quant.layers import Int4Linear, Int8Linear, quantized_activations
from ..quant.layout import interleave_rows, pack_int4, pack_int8
from . import build
from .fused_rmsnorm import cpu_kernel

# Rows of x up to which the matrix-vector kernels beat torch's matrix-matrix ones: each row
# costs the kernels a pass over the weights in cache.
MAX_ROWS = 16

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


class MatvecInt8Linear(Int8Linear):
    """Int8Linear whose decoding steps run the integer kernel (rows held in sets of eight)."""

    def forward(self, x):
        ops = operators_for(x, self.scales) if self.rows_of_8 else None
        return super().forward(x) if ops is None else ops.matvec_int8(x, self.weight, self.scales)


class MatvecInt4Linear(Int4Linear):
    """Int4Linear whose decoding steps run the integer kernel."""

    def forward(self, x):
        ops = operators_for(x, self.scales)
        return super().forward(x) if ops is None else ops.matvec_int4(x, self.weight, self.scales, self.zeros)


class KernelBlock(TransformerBlock):
    """TransformerBlock whose decoding steps (one position, read from a KV cache) run in one call.

    On a CPU a decoding step is so small that the thirty-odd eager calls of the block's own
    code cost as much as its arithmetic."""

    def forward(self, x, cos, sin, start_pos: int = 0):
        if x.shape[1] == 1 and self.attention.cache is not None:
            out = decode_layer(self, x, cos, sin, start_pos)
            if out is not None:
                return out
        return super().forward(x, cos, sin, start_pos)


# The subclass each module's class becomes under use_matvec.
FASTER = {nn.Linear: MatvecLinear, Int8Linear: MatvecInt8Linear, Int4Linear: MatvecInt4Linear, TransformerBlock: KernelBlock}


def use_matvec(model: nn.Module) -> nn.Module:
    """Run model's decoding steps on the kernels; returns model.

    Each nn.Linear, Int8Linear, Int4Linear and TransformerBlock of model gets the subclass of
    FASTER as its class: the module keeps its parameters, buffers and state-dict names, and gains
    the kernels' fast path. Builds or loads the kernels now (a first build says so), not at the
    first token; where they cannot run, model is left as it is.
    """
    if operators() is None:
        return model
    for module in model.modules():
        module.__class__ = FASTER.get(type(module), type(module))
    return model


def kernel_operands(linear):
    """(weight, scales, zeros) of a linear layer as decode_layer passes them, or None where the
    kernels do not take it."""
    if isinstance(linear, Int8Linear):
        return (linear.weight, linear.scales, None) if linear.rows_of_8 else None
    if isinstance(linear, Int4Linear):
        return linear.weight, linear.scales, linear.zeros
    if isinstance(linear, nn.Linear) and linear.bias is None and linear.weight.dtype in FLOATS:
        return linear.weight, None, None
    return None


HEAD_DIMS = (8, 16, 32, 64, 128)  # the head sizes the attention kernel takes


def decode_layer(block, x, cos, sin, start_pos: int):
    """A block's decoding step on the kernels: the norms, the seven products, RoPE, the
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
# model is not changed in the middle of one): reading a layer's twenty-odd module attributes
# costs as much as a small layer's arithmetic.
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
    operands = [kernel_operands(linear) for linear in linears]
    rms_norm = cpu_kernel()[0]
    if None in operands or rms_norm is None or norms[0].eps != norms[1].eps:
        return False, None
    weights, scales, zeros = zip(*operands)
    trainable = any(t is not None and t.requires_grad for t in (norms[0].weight, norms[1].weight, *weights, *scales, *zeros))
    return trainable, (norms[0].weight, norms[1].weight, norms[0].eps, rms_norm.vector_bytes, weights, scales, zeros, cache.k, cache.v)


# --- Known answers at load ---------------------------------------------------------------------


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
