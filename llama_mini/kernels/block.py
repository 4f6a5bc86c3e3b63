"""A transformer block's forward in one call on the CPU kernels (the operator llama_mini::block).

On a CPU a decoding step is so small that the thirty-odd eager calls of the block's own code
cost as much as its arithmetic. The operator runs the norms, the seven products, RoPE, the
cache write, attention, SwiGLU and the residual adds from C++ (csrc/), in the order
TransformerBlock.forward gives them; its attention computes each query as a decoding step
would, so a prompt's numbers do not depend on how it is cut into calls. It mirrors the core
functions KernelBlock.computes names: where any of them is edited, the block runs its own code.
"""

import weakref
from typing import Optional

import torch
from torch import nn

from ..model import Attention, FeedForward, RMSNorm, TransformerBlock
from ..quant.layers import Int4Linear, Int8Linear
from .fused_rmsnorm import FusedRMSNorm, cpu_kernel
from .fused_rope import FusedAttention
from .fused_swiglu import FusedFeedForward
from .linear import (KernelInt4Linear, KernelInt8Linear, KernelLinear, KernelMappedQ8_0Linear, KernelQ5_KLinear, KernelQ6_KLinear,
                     kernel_operands)
from .operators import FLOATS, operators

class KernelBlock(TransformerBlock):
    """TransformerBlock whose forward without gradients runs in one call (block_on_kernels): a
    decoding step or a prompt read into the KV cache, or a whole sequence without one.

    On a CPU a decoding step is so small that the thirty-odd eager calls of the block's own
    code cost as much as its arithmetic; and its attention kernel computes each query as a
    decoding step would, so a prompt's numbers do not depend on how it is cut into calls."""

    layer = "block kernel"
    # The core functions the block operator (csrc/block_op.cpp, with the attention, SwiGLU and
    # RMSNorm kernels) computes: an edit to any of them leaves the block on its own code.
    computes = ("model:TransformerBlock.forward", "model:RMSNorm.forward", "model:RMSNorm._norm", "model:Attention.forward",
                "model:Attention.rotate", "model:apply_rotary_emb", "model:KVCache.__init__", "model:KVCache.update",
                "model:FeedForward.forward", "model:FeedForward.gate")

    def forward(self, x, cos, sin, start_pos: int = 0):
        out = None if torch.is_autocast_enabled("cpu") else block_on_kernels(self, x, cos, sin, start_pos)
        return super().forward(x, cos, sin, start_pos) if out is None else out


MAX_HEAD_DIM = 256  # the attention kernel takes head sizes that are multiples of 8 up to this (csrc/attention.cpp)
LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


# The classes of a block's parts whose code the block operator mirrors (the core's, or a kernel
# layer of it), and those of its linear layers once on the kernels.
PARTS = {"attention": (Attention, FusedAttention), "feed_forward": (FeedForward, FusedFeedForward),
         "attention_norm": (RMSNorm, FusedRMSNorm), "ffn_norm": (RMSNorm, FusedRMSNorm)}
KERNEL_LINEARS = (KernelLinear, KernelInt8Linear, KernelInt4Linear, KernelMappedQ8_0Linear, KernelQ5_KLinear, KernelQ6_KLinear)


def block_refusal(block, dtype) -> Optional[str]:
    """Why the kernels cannot run `block` computing in `dtype`, in a few words; None where they can."""
    for name, classes in PARTS.items():
        part = getattr(block, name)
        if type(part) not in classes:
            return f"its {name} is {type(part).__name__}, and the kernels run {classes[0].__name__}"
    if dtype not in FLOATS:
        return f"the kernels compute in float32, bfloat16 and float16, not {str(dtype).removeprefix('torch.')}"
    head_dim = block.attention.head_dim
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head size {head_dim}: the kernels take multiples of 8 up to {MAX_HEAD_DIM}"
    for norm in (block.attention_norm, block.ffn_norm):
        if norm.n_rms != norm.weight.shape[0]:
            return "its norm is a partial RMSNorm, and the kernels run RMSNorm over the whole row"
        if norm.weight.dtype != dtype:
            return f"its norms hold {norm.weight.dtype} weights in a {dtype} model"
    if block.attention_norm.eps != block.ffn_norm.eps:
        return "its two norms have different eps"
    for name in LINEARS:
        linear = block.get_submodule(name)
        if kernel_operands(linear) is None:
            return f"{name} is {_layer_kind(linear)}, which the kernels do not take"
        if type(linear) not in KERNEL_LINEARS:
            return f"{name} runs its own code"
    if cpu_kernel()[0] is None:
        return f"the fused RMSNorm does not load: {cpu_kernel()[1]}"
    return None


def _layer_kind(linear) -> str:
    shape = f"{getattr(linear, 'in_features', '?')} -> {getattr(linear, 'out_features', '?')}"
    if isinstance(linear, Int8Linear) and not linear.stored_in_sets:
        return f"int8 of shape {shape} (the kernels take outputs in sets of 8 and inputs in blocks of 32)"
    if isinstance(linear, (Int8Linear, Int4Linear)) and not linear.rows_of_8:
        return f"{type(linear).__name__} holding plain rows (the kernels read rows in sets of 8)"
    if isinstance(linear, nn.Linear) and linear.bias is not None:
        return "a linear layer with a bias"
    if isinstance(linear, nn.Linear) and linear.weight.dtype not in FLOATS:
        return f"a {linear.weight.dtype} layer"
    return f"a {type(linear).__name__} whose tensors are not each one piece of memory"


def block_on_kernels(block, x, cos, sin, start_pos: int):
    """A block's forward on the kernels: the norms, the seven products, RoPE, the cache write,
    attention, SwiGLU and the residual adds of x's positions, in one call (the operator
    llama_mini::block, csrc/block_op.cpp). Without a KV cache (a whole sequence from position 0)
    the keys and values go to a temporary one. None where the kernels cannot run the block:
    the model's own code then runs, and says what is wrong if anything is."""
    cache = block.attention.cache
    gathered = _layer_operands.get(cache) if cache is not None else None
    if gathered is None or gathered[0] != x.dtype:
        gathered = (x.dtype, *_gather_operands(block, x.dtype))
        if cache is not None:
            _layer_operands[cache] = gathered
    _, trainable, operands = gathered
    if operands is None or not x.is_cpu or x.dim() != 3:
        return None
    if torch.compiler.is_compiling() or torch.is_grad_enabled() and (x.requires_grad or trainable):
        return None  # autograd needs the model's own operations
    batch, rows = x.shape[:2]
    if cache is not None:
        keys, values = cache.k, cache.v
    elif start_pos == 0:
        keys = torch.empty(batch, block.attention.n_kv_heads, rows, block.attention.head_dim, dtype=x.dtype)
        values = torch.empty_like(keys)
    else:
        return None
    if keys.dtype not in FLOATS or batch > keys.shape[0] or start_pos + rows > keys.shape[2]:
        return None
    return operators().block(x, *operands, keys, values, cos, sin, start_pos)


# A block's operands, gathered once per KV cache (setup_cache begins each generation, and a
# model is not changed in the middle of one): reading a layer's twenty-odd module attributes
# costs as much as a small layer's arithmetic.
_layer_operands = weakref.WeakKeyDictionary()


def _gather_operands(block, dtype):
    """(whether any of them requires grad, the operator's operands for `block` computing in
    `dtype` but the cache, cos, sin and the position); the operands are None where the kernels
    do not run the block (block_refusal)."""
    if block_refusal(block, dtype) is not None:
        return False, None
    norms = (block.attention_norm, block.ffn_norm)
    operands = tuple(zip(*(kernel_operands(block.get_submodule(name)) for name in LINEARS)))  # weights, scales, ...
    trainable = any(t is not None and t.requires_grad for t in (norms[0].weight, norms[1].weight, *sum(operands, ())))
    return trainable, (norms[0].weight, norms[1].weight, norms[0].eps, cpu_kernel()[0].vector_bytes, *operands)


