"""The CPU operators, loaded once and checked, and the one class swap every kernel layer uses.

operators() builds (once per machine) and loads the library of csrc/ into torch.ops.llama_mini,
and holds it to known answers before any layer uses it. swap_classes gives a module the class
of its kernel layer, a subclass that keeps every weight and state-dict name, only where that
layer computes the core as it is loaded (fingerprints.py): a layer written for code that has
since changed steps aside, with one line, and the module runs its own code.
"""

import functools
import logging
from typing import Callable, Optional

import torch
from torch import nn

from ..quant.layers import quantized_activations
from ..quant.k_quants import Q5_KLinear, Q6_KLinear
from ..quant.layout import interleave_rows, pack_int4, pack_int8
from . import build
from .fingerprints import changed, notice_changed

log = logging.getLogger(__name__)

FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes the kernels read (and an integer layer's scales)
PANEL = 16  # outputs per panel of a weight held in panels (csrc/)


@functools.cache
def operators():
    """torch.ops.llama_mini with the operators loaded and checked, or None (said once)."""
    ops, why = build.checked(_checked_operators)
    if why is not None:
        log.warning("llama_mini: CPU kernels unavailable (%s); using torch's", why)
    return ops


def _checked_operators():
    with torch.inference_mode():
        ops = torch.ops.llama_mini
        if not ops.matvec_available():
            log.debug("llama_mini: no vector kernels for this CPU (they need AVX2 and FMA)")
            return None
        _self_check(ops)
    return ops


def swap_classes(model: nn.Module, kernel_classes: dict, refusal: Callable[[nn.Module], Optional[str]] = lambda m: None) -> dict:
    """Give each module of model whose class is a key of kernel_classes that key's kernel class,
    where the core functions the kernel class computes (its `computes`) are the code it was
    written for, and refusal(module) gives no reason against; returns {module: reason} for the
    modules refusal kept on their own code. A kernel class whose core code changed is said once
    (fingerprints.notice_changed) and applied to none."""
    stale = {}  # kernel class -> the first changed function it computes, found once per call
    refused = {}
    for module in model.modules():
        kernel_class = kernel_classes.get(type(module))
        if kernel_class is None:
            continue
        if kernel_class not in stale:
            stale[kernel_class] = changed(kernel_class.computes)
            if stale[kernel_class]:
                notice_changed(kernel_class.layer, stale[kernel_class])
        if stale[kernel_class]:
            continue
        if why := refusal(module):
            refused[module] = why
            continue
        module.__class__ = kernel_class
    return refused


def on_the_cpu(model: nn.Module) -> bool:
    """Whether model's weights are on the CPU (a model without any: no)."""
    weight = next(model.parameters(), None)
    return weight is not None and weight.device.type == "cpu"


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (out / 16, in, 16): each panel's sixteen outputs side by side, input by input."""
    return weight.unflatten(0, (-1, PANEL)).transpose(1, 2).contiguous()


def q8_0_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 codes (n, k) and float16 scales (n, k / 32) -> the rows of a GGUF file's Q8_0 blocks,
    uint8 (n, k / 32 * 34): each block's scale, then its 32 codes."""
    n, blocks = scales.shape
    return torch.cat((scales.view(torch.uint8).view(n, blocks, 2), codes.view(torch.uint8).view(n, blocks, 32)), -1).view(n, -1)


def _self_check(ops) -> None:
    """Refuse kernels that compiled but compute something else: each linear operator, every
    dtype pair, shapes with tails (rows, tiles and inputs not a multiple of the blocks), against
    float64; the integer ones where quant/layers.py's activations are the ones they were
    written for (edited, the integer layers step aside: linear.py)."""
    g = torch.Generator().manual_seed(0)
    integers = changed(("quant.layers:quantized_activations",)) is None  # the check's own known answer uses it
    for dtype in FLOATS:
        x = torch.randn(7, 320, generator=g).to(dtype)
        w, w16 = torch.randn(7, 320, generator=g).to(dtype), torch.randn(32, 320, generator=g)
        checks = [
            (ops.linear_dense(x, w), x.double() @ w.double().t()),
            (ops.linear_dense(x, to_panels(w16)), x.double() @ w16.double().t()),
            (ops.linear_dense(x, to_panels(w16.to(dtype))), x.double() @ w16.to(dtype).double().t()),
        ]
        if integers:
            xq = quantized_activations(x).double()
            codes = torch.randint(-127, 128, (24, 320), generator=g, dtype=torch.int8)
            scales = (torch.rand(24, 10, generator=g) + 0.5).to(dtype)
            nibbles = torch.randint(0, 16, (24, 320), generator=g, dtype=torch.uint8)
            group_scales, offsets = (torch.rand(24, 5, generator=g) + 0.5).to(dtype), torch.randn(24, 5, generator=g).to(dtype)
            factors = torch.randint(0, 64, (2, 24, 10), generator=g, dtype=torch.uint8)
            supers = torch.randn(2, 24, 2, generator=g)  # super-groups of 160 inputs, groups of 32
            int8 = codes.double() * scales.double().repeat_interleave(32, dim=1)
            int4 = (nibbles.double().unflatten(-1, (5, 64)) * group_scales.double()[..., None]
                    + offsets.double()[..., None]).flatten(-2)
            scale_factors, offset_factors = supers.double().repeat_interleave(5, dim=-1) * factors.double()
            factored = (nibbles.double().unflatten(-1, (10, 32)) * scale_factors[..., None]
                        + offset_factors[..., None]).flatten(-2)
            halves = (torch.rand(24, 10, generator=g) + 0.5).half()  # 16-bit float scales, as GGUF's Q8_0 holds them
            x6 = torch.randn(20, 512, generator=g).to(dtype)  # Q5_K, Q6_K: super-blocks of 256 inputs; a prompt's rows, and fewer
            q6_k = torch.randint(0, 256, (28, 2, 210), generator=g, dtype=torch.uint8)  # three sets of eight rows, and four
            q6_k[..., 208:] = (torch.rand(28, 2, 1, generator=g) / 1024).half().view(torch.uint8)
            q5_k = torch.randint(0, 256, (28, 2, 176), generator=g, dtype=torch.uint8)
            q5_k[..., :4] = (torch.rand(28, 2, 2, generator=g) / 1024).half().view(torch.uint8)  # d and dmin
            k_quants = [(blocks, layer(blocks, 512).dequantize().double()) for blocks, layer in ((q6_k, Q6_KLinear), (q5_k, Q5_KLinear))]
            codes8, halves8 = torch.randint(-128, 128, (24, 512), generator=g, dtype=torch.int8), (torch.rand(24, 16, generator=g) + 0.5).half()
            q8_0 = q8_0_rows(codes8, halves8)
            int8_of_q8_0 = codes8.double() * halves8.double().repeat_interleave(32, dim=1)
            checks += [
                (ops.linear_int8(x, pack_int8(codes), interleave_rows(scales)), xq @ int8.t()),
                (ops.linear_int8(x, pack_int8(codes), interleave_rows(halves)),
                 xq @ (codes.double() * halves.double().repeat_interleave(32, dim=1)).t()),
                (ops.linear_int4(x, pack_int4(nibbles), interleave_rows(group_scales), interleave_rows(offsets)), xq @ int4.t()),
                (ops.linear_int4(x, pack_int4(nibbles), *map(interleave_rows, (*factors, *supers))),
                 quantized_activations(x, 160).double() @ factored.t()),  # factored: activations per super-group
                (ops.linear_int4(x, pack_int4(nibbles), interleave_rows(group_scales), None),  # symmetric: offsets -8 scales
                 xq @ ((nibbles.double() - 8).unflatten(-1, (5, 64)) * group_scales.double()[..., None]).flatten(-2).t()),
                *((ops.linear_k_quant(rows, blocks), quantized_activations(rows, 256).double() @ w.t())
                  for blocks, w in k_quants for rows in (x6, x6[:3])),
                (ops.linear_q8_0(x6, q8_0), quantized_activations(x6).double() @ int8_of_q8_0.t()),
                (ops.linear_q8_0(x6[:3], q8_0), quantized_activations(x6[:3]).double() @ int8_of_q8_0.t()),
            ]
        for got, expected in checks:
            if got.dtype != dtype or not torch.allclose(got.double(), expected, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-3):
                raise RuntimeError("the compiled linear kernels disagree with the reference")
