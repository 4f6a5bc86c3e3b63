"""A GGUF file's blocks converted into the integer layers by the CPU kernels' library
(csrc/gguf_blocks_op.cpp): each set of eight rows decoded and packed while it sits in cache, on
every thread, where torch's converters (quant/gguf_blocks.py, the definition) make a pass over
memory per operation. The same bytes, in a fraction of the load time.

The converter is written for those converters and the layout they pack (quant/layout.py), and
names them in COMPUTES: where one was edited it steps aside with one line, and torch's run.
"""

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from ..quant.gguf_blocks import EXACT_INT4
from .fingerprints import changed, notice_changed
from .operators import operators

COMPUTES = tuple(f"quant.gguf_blocks:{name}" for name in ("_q5_0", "_q4_0", "_q4_1", "_q4_k", "_blocks")) + \
    tuple(f"quant.k_quants:{name}" for name in ("scales_and_mins", "nibbles", "half")) + \
    tuple(f"quant.layout:{name}" for name in ("pack_int8", "pack_int4", "_int4_runs", "as_words", "_bytes", "interleave_rows")) + \
    ("quant.layers:Int8Linear.store_rows", "quant.layers:Int4Linear.store_rows")
KINDS = (T.Q5_0, *EXACT_INT4)  # the types converted into a layer (Q8_0, Q5_K and Q6_K are read where mapped): csrc's


def gguf_converter():
    """The kernels' converter for quant.gguf_blocks.layer_from_blocks, or None where the kernels
    do not run or a function it was written for changed (said once)."""
    if operators() is None:
        return None
    if name := changed(COMPUTES):
        notice_changed("kernels' GGUF block converter", name)
        return None
    return convert


def convert(kind: T, blocks: np.ndarray, layer) -> bool:
    """Fill layer with the matrix of blocks (uint8 (rows, bytes per row), a view of the mapped
    file) where the converter takes its type and the layer holds sets of eight rows; whether it did."""
    if kind not in KINDS or not layer.rows_of_8:  # rows not in sets of eight take torch's int8 (layer_from_blocks)
        return False
    buffers = [buffer for _, buffer in layer.named_buffers()]  # the layer's order, the codes first
    torch.ops.llama_mini.gguf_blocks(torch.from_numpy(np.ascontiguousarray(blocks)), int(kind), buffers)
    return True
