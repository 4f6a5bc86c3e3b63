"""Linear layers and decoding steps on the CPU kernels, applied from outside: use_matvec(model).

Decoding a token multiplies each weight matrix by one activation row, so on a CPU tokens/s is
bounded by memory bandwidth / weight bytes; reading a prompt multiplies them by hundreds of
rows, and its time is arithmetic. torch's CPU kernels read the weights slowly at one row, its
int8 and int4 kernels convert every weight to float, and its bfloat16 products are slow on
CPUs without bf16 arithmetic. The operators of csrc/matvec.cpp compute a tile of rows against a
few weight rows at a time, for any number of rows, each output summed in one order whatever the
rows beside it; integer weights meet the activations rounded to int8 in blocks of 32 (quant/
layers.py's definition, as llama.cpp does) as integers.

use_matvec swaps the class of each linear layer and transformer block for a subclass that adds
a fast path and keeps the module's state: inputs on CPU, without autograd or autocast, with
weights the kernels read in place, run the kernels, and a block's forward runs in one call
(block_on_kernels). float32 weights are held in panels of sixteen outputs instead, which prompts
read at BLAS speed or faster (MatvecLinear.hold_panels).
Everything else runs the parent class's own code: the same function, up to the order of float
sums. Compiled with the fused RMSNorm (build.py), and checked against known answers when first
loaded.
"""

import collections
import functools
import logging
import weakref
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..model import RMSNorm, TransformerBlock
from ..quant.layers import Int4Linear, Int8Linear, quantized_activations
from ..quant.layout import interleave_rows, pack_int4, pack_int8
from . import build
from .fused_rmsnorm import cpu_kernel

log = logging.getLogger(__name__)


@functools.cache
def operators():
    """torch.ops.llama_mini with the matvec operators loaded and checked, or None (said once)."""
    ops, why = build.checked(_checked_operators)
    if why is not None:
        log.warning("llama_mini: CPU kernels unavailable (%s); using torch's", why)
    return ops


def _checked_operators():
    with torch.inference_mode():
        ops = torch.ops.llama_mini
        if not ops.matvec_available():
            log.debug("llama_mini: no matrix-vector kernels for this CPU (they need AVX2 and FMA)")
            return None
        _self_check(ops)
    return ops


FLOATS = (torch.float32, torch.bfloat16)  # the activation, weight and scale dtypes the kernels read


def swap_on_cpu(model: nn.Module, base: type, faster: type) -> nn.Module:
    """Give each module of model whose class is `base` the class `faster` (its weights and
    state-dict names stay) where the model is on the CPU and the kernels load, loading them now
    (building them once per machine); model is left as it is elsewhere. Returns model."""
    layers = [m for m in model.modules() if type(m) is base]
    if not layers or next(layers[0].parameters()).device.type != "cpu" or operators() is None:
        return model
    for layer in layers:
        layer.__class__ = faster
    return model


def operators_for(x: torch.Tensor, floats: torch.Tensor):
    """The operators, if they should compute x W^T (floats: W, or its scales); None where the
    layer's own code should. Cheapest checks first: this runs for every layer of every step."""
    if not x.is_cpu or x.dtype not in FLOATS or floats.dtype not in FLOATS:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or floats.requires_grad):
        return None
    if torch.compiler.is_compiling():  # Inductor compiles torch's own ops; ours would break the graph
        return None
    return operators()


PANEL = 16  # outputs per panel of a float32 weight held in panels (csrc/matvec.h)


class MatvecLinear(nn.Linear):
    """nn.Linear (no bias) on the dense kernel: y = x W^T in float32 arithmetic, in x's dtype.
    Under autocast, torch's F.linear (autocast decides the dtypes).

    A float32 weight the kernels read in panels (holds_panels), hold_panels keeps as
    (out / 16, in, 16); state_dict, load_state_dict and torch's code still see rows
    (weight_rows)."""

    in_panels = False

    def forward(self, x):
        usable = kernel_operands(self) is not None and not torch.is_autocast_enabled("cpu")
        ops = operators_for(x, self.weight) if usable else None
        return F.linear(x, self.weight_rows(), self.bias) if ops is None else ops.linear_dense(x, self.weight)

    def weight_rows(self) -> torch.Tensor:
        """The weight as nn.Linear holds it, (out, in): a copy where held in panels."""
        if not self.in_panels:
            return self.weight
        return self.weight.transpose(1, 2).reshape(self.out_features, self.in_features)

    def hold_panels(self) -> None:
        """Hold the weight in panels from now on (a copy: the rows are freed)."""
        weight = self.weight
        self.weight = nn.Parameter(to_panels(weight.detach()), requires_grad=weight.requires_grad)
        self.in_panels = True

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.in_panels:
            destination[prefix + "weight"] = self.weight_rows() if keep_vars else self.weight_rows().detach()

    def _load_from_state_dict(self, state_dict, prefix, *args):
        key = prefix + "weight"
        if self.in_panels and key in state_dict and state_dict[key].shape == (self.out_features, self.in_features):
            state_dict = {**state_dict, key: to_panels(state_dict[key])}
        super()._load_from_state_dict(state_dict, prefix, *args)


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (out / 16, in, 16): each panel's sixteen outputs side by side, input by input."""
    return weight.unflatten(0, (-1, PANEL)).transpose(1, 2).contiguous()


def holds_panels(linear, shared: set) -> bool:
    """Whether the kernels read this layer's weight in panels: float32, one piece of memory,
    outputs a multiple of 16, no bias, and not shared with another module (a tied embedding
    keeps its rows)."""
    if type(linear) is not MatvecLinear or linear.in_panels or linear.bias is not None:
        return False
    weight = linear.weight
    return (weight.dim() == 2 and weight.dtype == torch.float32 and weight.is_cpu and weight.is_contiguous()
            and linear.out_features % PANEL == 0 and id(weight) not in shared)


class IntegerKernel:
    """An integer layer on its kernel (kernel(ops, x)), where the operands allow; its own
    function otherwise. The same function either way, autocast or not."""

    def forward(self, x):
        ops = operators_for(x, self.scales) if kernel_operands(self) is not None else None
        return super().forward(x) if ops is None else self.kernel(ops, x)


class MatvecInt8Linear(IntegerKernel, Int8Linear):
    """Int8Linear on the integer kernel (rows held in sets of eight)."""

    def kernel(self, ops, x):
        return ops.linear_int8(x, self.weight, self.scales)


class MatvecInt4Linear(IntegerKernel, Int4Linear):
    """Int4Linear on the integer kernel."""

    def kernel(self, ops, x):
        return ops.linear_int4(x, self.weight, self.scales, self.zeros)


class KernelBlock(TransformerBlock):
    """TransformerBlock whose forward without gradients runs in one call (block_on_kernels): a
    decoding step or a prompt read into the KV cache, or a whole sequence without one.

    On a CPU a decoding step is so small that the thirty-odd eager calls of the block's own
    code cost as much as its arithmetic; and its attention kernel computes each query as a
    decoding step would, so a prompt's numbers do not depend on how it is cut into calls."""

    def forward(self, x, cos, sin, start_pos: int = 0):
        out = None if torch.is_autocast_enabled("cpu") else block_on_kernels(self, x, cos, sin, start_pos)
        return super().forward(x, cos, sin, start_pos) if out is None else out


# The subclass each module's class becomes under use_matvec.
FASTER = {nn.Linear: MatvecLinear, Int8Linear: MatvecInt8Linear, Int4Linear: MatvecInt4Linear, TransformerBlock: KernelBlock}


def use_matvec(model: nn.Module) -> nn.Module:
    """Run model's linear layers and decoding steps on the kernels; returns model.

    Each nn.Linear, Int8Linear and Int4Linear of model, and each TransformerBlock the kernels
    can run (block_refusal), gets the subclass of FASTER as its class: the module keeps its
    parameters, buffers and state-dict names, and gains the kernels' fast path. A block they
    cannot run keeps the model's own code, and one line says which and why. Builds or loads the
    kernels now (a first build says so), not at the first token; where they cannot run, model
    is left as it is.
    """
    if operators() is None:
        return model
    refused = {}
    for module in model.modules():
        if isinstance(module, TransformerBlock) and (why := block_refusal(module, _compute_dtype(module))):
            refused[module], module.__class__ = why, TransformerBlock
            continue
        module.__class__ = FASTER.get(type(module), type(module))
    counts = collections.Counter(id(t) for _, t in model.named_parameters(remove_duplicate=False))
    shared = {key for key, count in counts.items() if count > 1}
    for module in model.modules():
        if holds_panels(module, shared):
            module.hold_panels()
    if refused:
        log.warning("llama_mini: %s", _describe_refusals(model, refused))
    return model


def on_kernels(model: nn.Module) -> bool:
    """Whether use_matvec put every transformer block of model (or model, a block) on the kernels."""
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    return bool(blocks) and all(isinstance(block, KernelBlock) for block in blocks)


def _compute_dtype(block) -> torch.dtype:
    """The dtype a block computes in: its norms' (the model's dtype, the quantized layers' included)."""
    floats = [t for t in (*block.parameters(), *block.buffers()) if t.is_floating_point()]
    norm = getattr(block.attention_norm, "weight", None)
    return norm.dtype if norm is not None else floats[0].dtype if floats else torch.float32


def _describe_refusals(model, refused: dict) -> str:
    """One line: the blocks (numbered as in model.layers) that run torch's code, and why."""
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    by_reason = {}
    for block, why in refused.items():
        by_reason.setdefault(why, []).append(blocks.index(block))
    which = "; ".join(f"block{'s' if len(numbers) > 1 else ''} {_ranges(numbers)} ({why})" for why, numbers in by_reason.items())
    return (f"torch's code runs {which} of {len(blocks)}, not the CPU kernels: slower, and a prompt's numbers "
            "then depend on how it is read")


def _ranges(numbers) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    numbers, runs = sorted(numbers), []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def kernel_operands(linear):
    """(weight, scales, zeros) of a linear layer as the kernels read them, or None where they do
    not take it: other shapes, biases, dtypes, or tensors not laid out in one piece."""
    if isinstance(linear, Int8Linear):
        operands = (linear.weight, linear.scales, None) if linear.rows_of_8 else None
    elif isinstance(linear, Int4Linear):
        operands = (linear.weight, linear.scales, linear.zeros) if linear.rows_of_8 else None
    elif isinstance(linear, nn.Linear) and linear.bias is None and linear.weight.dtype in FLOATS:
        # panels hold float32 (a model cast after use_matvec holds bfloat16 ones: torch's code)
        in_panels = getattr(linear, "in_panels", False)
        operands = (linear.weight, None, None) if not in_panels or linear.weight.dtype == torch.float32 else None
    else:
        return None
    return operands if operands and all(t is None or t.is_contiguous() for t in operands) else None


MAX_HEAD_DIM = 256  # the attention kernel takes head sizes that are multiples of 8 up to this (csrc/attention.cpp)
LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def block_refusal(block, dtype) -> Optional[str]:
    """Why the kernels cannot run `block` computing in `dtype`, in a few words; None where they can."""
    if dtype not in FLOATS:
        return f"the kernels compute in float32 and bfloat16, not {str(dtype).removeprefix('torch.')}"
    head_dim = block.attention.head_dim
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head size {head_dim}: the kernels take multiples of 8 up to {MAX_HEAD_DIM}"
    for norm in (block.attention_norm, block.ffn_norm):
        if not isinstance(norm, RMSNorm):
            return f"its norm is {type(norm).__name__}, and the kernels run RMSNorm"
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
    if keys.dtype != x.dtype or batch > keys.shape[0] or start_pos + rows > keys.shape[2]:
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
    weights, scales, zeros = zip(*(kernel_operands(block.get_submodule(name)) for name in LINEARS))
    trainable = any(t is not None and t.requires_grad for t in (norms[0].weight, norms[1].weight, *weights, *scales, *zeros))
    return trainable, (norms[0].weight, norms[1].weight, norms[0].eps, cpu_kernel()[0].vector_bytes, weights, scales, zeros)


# --- Known answers at load ---------------------------------------------------------------------


def _self_check(ops) -> None:
    """Refuse kernels that compiled but compute something else: each operator, every dtype
    pair, shapes with tails (rows, tiles and inputs not a multiple of the blocks), against float64."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 320, generator=g).to(dtype)
        xq = quantized_activations(x).double()
        w, w16 = torch.randn(7, 320, generator=g), torch.randn(32, 320, generator=g)
        codes = torch.randint(-127, 128, (24, 320), generator=g, dtype=torch.int8)
        scales = (torch.rand(24, 10, generator=g) + 0.5).to(dtype)
        nibbles = torch.randint(0, 16, (24, 320), generator=g, dtype=torch.uint8)
        group_scales, zeros = (torch.rand(24, 5, generator=g) + 0.5).to(dtype), torch.randn(24, 5, generator=g).to(dtype)
        int8 = codes.double() * scales.double().repeat_interleave(32, dim=1)
        int4 = ((nibbles.double() - 8).unflatten(-1, (5, 64)) * group_scales.double()[..., None] + zeros.double()[..., None]).flatten(-2)
        checks = (
            (ops.linear_dense(x, w.to(dtype)), x.double() @ w.to(dtype).double().t()),
            (ops.linear_dense(x, to_panels(w16)), x.double() @ w16.double().t()),
            (ops.linear_int8(x, pack_int8(codes), interleave_rows(scales)), xq @ int8.t()),
            (ops.linear_int4(x, pack_int4(nibbles), interleave_rows(group_scales), interleave_rows(zeros)), xq @ int4.t()),
        )
        for got, expected in checks:
            if got.dtype != dtype or not torch.allclose(got.double(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3):
                raise RuntimeError("the compiled linear kernels disagree with the reference")
