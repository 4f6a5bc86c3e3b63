"""Linear layers on the CPU kernels: nn.Linear and the integer layers, for prompts and decoding.

Decoding a token multiplies each weight matrix by one activation row, so on a CPU tokens/s is
bounded by memory bandwidth / weight bytes; reading a prompt multiplies them by hundreds of
rows, and its time is arithmetic. torch's CPU kernels read the weights slowly at one row, its
int8 and int4 kernels convert every weight to float, and its bfloat16 products are slow on CPUs
without bf16 arithmetic. The linear operators compute a tile of rows against a few weight rows
at a time, for any number of rows, each output summed in one order whatever the rows beside it;
integer weights meet the activations rounded to int8 in blocks of 32 (256 for the K-quants, Q4_K's too; quant/layers.py's
definition, as llama.cpp does) as integers. Float weights (float32, bfloat16, float16) are held
in panels of sixteen outputs, which prompts read at BLAS speed or faster (KernelLinear.hold_panels).

Each class here is its parent with a fast path: inputs on CPU, without autograd or autocast,
with weights the kernels read in place, run the kernels; everything else runs the parent's
own code, the same function up to the order of float sums.
"""

import torch
from torch import nn
from torch.nn import functional as F

from ..quant.k_quants import KQuantLinear, Q5_KLinear, Q6_KLinear
from ..quant.layers import Int4Linear, Int8Linear
from ..quant.mapped_q8_0 import MappedQ8_0Linear
from ..support.memory import release_file_pages
from .operators import FLOATS, PANEL, operators, to_panels


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


class KernelLinear(nn.Linear):
    """nn.Linear (no bias) on the dense kernel: y = x W^T in float32 arithmetic, in x's dtype.
    Under autocast, torch's F.linear (autocast decides the dtypes), and for x of another dtype
    than W (its error).

    A weight the kernels read in panels (holds_panels), hold_panels keeps as
    (out / 16, in, 16); state_dict, load_state_dict and torch's code still see rows
    (weight_rows)."""

    layer, computes = "linear kernel", ()  # torch's nn.Linear: no core code
    in_panels = False

    def forward(self, x):
        usable = x.dtype == self.weight.dtype and kernel_operands(self) is not None and not torch.is_autocast_enabled("cpu")
        ops = operators_for(x, self.weight) if usable else None
        return F.linear(x, self.weight_rows(), self.bias) if ops is None else ops.linear_dense(x, self.weight)

    def weight_rows(self) -> torch.Tensor:
        """The weight as nn.Linear holds it, (out, in): a copy where held in panels."""
        if not self.in_panels:
            return self.weight
        return self.weight.transpose(1, 2).reshape(self.out_features, self.in_features)

    def hold_panels(self) -> None:
        """Hold the weight in panels from now on (a copy: the rows are freed, or, read from a
        mapped file, their pages given back)."""
        weight = self.weight
        self.weight = nn.Parameter(to_panels(weight.detach()), requires_grad=weight.requires_grad)
        self.in_panels = True
        release_file_pages(weight)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.in_panels:
            destination[prefix + "weight"] = self.weight_rows() if keep_vars else self.weight_rows().detach()

    def _load_from_state_dict(self, state_dict, prefix, *args):
        key = prefix + "weight"
        if self.in_panels and key in state_dict and state_dict[key].shape == (self.out_features, self.in_features):
            state_dict = {**state_dict, key: to_panels(state_dict[key])}
        super()._load_from_state_dict(state_dict, prefix, *args)


def holds_panels(linear, shared: set) -> bool:
    """Whether the kernels read this layer's weight in panels: a float, one piece of memory,
    outputs a multiple of 16, no bias, and not shared with another module (a tied embedding
    keeps its rows)."""
    if type(linear) is not KernelLinear or linear.in_panels or linear.bias is not None:
        return False
    weight = linear.weight
    return (weight.dim() == 2 and weight.dtype in FLOATS and weight.is_cpu and weight.is_contiguous()
            and linear.out_features % PANEL == 0 and id(weight) not in shared)


# What an integer layer computes (quant/layers.py): its activations rounded, then the product.
DEFINITION = ("quant.layers:quantized_linear", "quant.layers:quantized_activations", "quant.layers:float32_linear")


class IntegerKernel:
    """An integer layer on its kernel (kernel(ops, x)), where the operands allow; its own
    function otherwise. The same function either way, autocast or not."""

    def forward(self, x):
        floats = self.super_scales if getattr(self, "super_group_size", 0) else self.scales
        ops = operators_for(x, floats) if kernel_operands(self) is not None else None
        return super().forward(x) if ops is None else self.kernel(ops, x)


class KernelInt8Linear(IntegerKernel, Int8Linear):
    """Int8Linear on the integer kernel (rows held in sets of eight)."""

    layer = "int8 kernel"
    computes = DEFINITION + tuple(f"quant.layers:Int8Linear.{name}" for name in ("forward", "dequantize", "codes", "block_scales"))

    def kernel(self, ops, x):
        return ops.linear_int8(x, self.weight, self.scales)


class KernelInt4Linear(IntegerKernel, Int4Linear):
    """Int4Linear on the integer kernel."""

    layer = "int4 kernel"
    computes = DEFINITION + tuple(f"quant.layers:Int4Linear.{name}" for name in ("__init__", "forward", "dequantize", "codes",
                                                                                  "group_scales_and_offsets", "factored",
                                                                                  "symmetric_offsets"))

    def kernel(self, ops, x):
        if self.super_group_size:
            return ops.linear_int4(x, self.weight, self.scales, self.offsets, self.super_scales, self.super_offsets)
        return ops.linear_int4(x, self.weight, self.scales, None if self.symmetric else self.offsets)


class KernelMappedQ8_0Linear(IntegerKernel, MappedQ8_0Linear):
    """MappedQ8_0Linear on the Q8_0 kernel, which reads the file's rows where they are mapped."""

    layer = "Q8_0 kernel"
    computes = DEFINITION + tuple(f"quant.layers:Int8Linear.{name}" for name in ("forward", "dequantize")) + \
        ("quant.mapped_q8_0:q8_0_codes_and_scales", "quant.mapped_q8_0:MappedQ8_0Linear.codes",
         "quant.mapped_q8_0:MappedQ8_0Linear.block_scales")

    def kernel(self, ops, x):
        return ops.linear_q8_0(x, self.blocks)


class KQuantKernel:
    """A K-quant layer on the K-quant kernel, which reads the file's blocks where they are mapped
    (their factors are in the blocks: only x's dtype decides whether the kernel takes it)."""

    def forward(self, x):
        ops = operators_for(x, x) if kernel_operands(self) is not None else None
        return super().forward(x) if ops is None else ops.linear_k_quant(x, self.blocks)


K_QUANT_DEFINITION = DEFINITION + tuple(f"quant.k_quants:{name}" for name in ("KQuantLinear.forward", "KQuantLinear.dequantize", "half",
                                                                               "nibbles"))


class KernelQ5_KLinear(KQuantKernel, Q5_KLinear):
    layer = "Q5_K kernel"
    computes = K_QUANT_DEFINITION + tuple(f"quant.k_quants:{name}" for name in ("Q5_KLinear.weights", "q5_k_codes_and_factors",
                                                                                 "scales_and_mins"))


class KernelQ6_KLinear(KQuantKernel, Q6_KLinear):
    layer = "Q6_K kernel"
    computes = K_QUANT_DEFINITION + tuple(f"quant.k_quants:{name}" for name in ("Q6_KLinear.weights", "q6_k_codes_and_scales"))


# The kernel class each linear layer's class becomes under use_cpu_kernels.
LINEAR_KERNELS = {nn.Linear: KernelLinear, Int8Linear: KernelInt8Linear, Int4Linear: KernelInt4Linear,
                  MappedQ8_0Linear: KernelMappedQ8_0Linear, Q5_KLinear: KernelQ5_KLinear, Q6_KLinear: KernelQ6_KLinear}


def kernel_operands(linear):
    """(weight, scales, offsets, super_scales, super_offsets) of a linear layer as the kernels read
    them (None for those it has not; a file's Q8_0 rows and K-quant blocks are a uint8 weight alone), or None where they do not take it: other shapes, biases,
    dtypes, or tensors not laid out in one piece."""
    if isinstance(linear, MappedQ8_0Linear):
        operands = (linear.blocks, None, None, None, None)
    elif isinstance(linear, Int8Linear):
        operands = (linear.weight, linear.scales, None, None, None) if linear.rows_of_8 else None
    elif isinstance(linear, Int4Linear):
        supers = (linear.super_scales, linear.super_offsets) if linear.super_group_size else (None, None)
        offsets = None if linear.symmetric else linear.offsets
        operands = (linear.weight, linear.scales, offsets, *supers) if linear.rows_of_8 else None
    elif isinstance(linear, KQuantLinear):
        operands = (linear.blocks, None, None, None, None)
    elif isinstance(linear, nn.Linear) and linear.bias is None and linear.weight.dtype in FLOATS:
        operands = (linear.weight, None, None, None, None)
    else:
        return None
    return operands if operands and all(t is None or t.is_contiguous() for t in operands) else None
