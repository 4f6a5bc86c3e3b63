"""Prompts and decoding steps on the CPU kernels, applied from outside: use_cpu_kernels(model).

Each linear layer becomes its kernel class (linear.py) and each transformer block the kernels
can run a KernelBlock (block.py), a block's forward in one call; each keeps its weights and
state-dict names, and computes the same function. A layer whose core code was edited since the
kernels were written for it (fingerprints.py) keeps that code, and one line says so.
"""

import collections
import logging

import torch
from torch import nn

from ..model import TransformerBlock
from .block import KernelBlock, block_refusal
from .linear import LINEAR_KERNELS, holds_panels
from .operators import operators, swap_classes

log = logging.getLogger(__name__)


def use_cpu_kernels(model: nn.Module) -> nn.Module:
    """Run model's linear layers and transformer blocks on the CPU kernels; returns model.

    Each nn.Linear, Int8Linear and Int4Linear of model, and each TransformerBlock the kernels
    can run (block_refusal), gets its kernel class as its class: the module keeps its
    parameters, buffers and state-dict names, and gains the kernels' fast path. A block they
    cannot run keeps the model's own code, and one line says which and why. Builds or loads the
    kernels now (a first build says so), not at the first token; where they cannot run, model
    is left as it is.
    """
    if operators() is None:
        return model
    swap_classes(model, LINEAR_KERNELS)
    refused = swap_classes(model, {TransformerBlock: KernelBlock}, lambda block: block_refusal(block, _compute_dtype(block)))
    counts = collections.Counter(id(t) for _, t in model.named_parameters(remove_duplicate=False))
    shared = {key for key, count in counts.items() if count > 1}
    for module in model.modules():
        if holds_panels(module, shared):
            module.hold_panels()
    if refused:
        log.warning("llama_mini: %s", _describe_refusals(model, refused))
    return model


def on_kernels(model: nn.Module) -> bool:
    """Whether use_cpu_kernels put every transformer block of model (or model, a block) on the kernels."""
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
