"""Weight-only quantization: linear layers that store int8 or int4 weights, and the model surgery.

Decoding one token reads every weight once, so on a CPU tokens/s is bounded by memory
bandwidth / weight bytes: fewer bytes per weight is the speed-up. Activations stay in the
model's dtype; only the weights are stored as integers with floating-point scales.

- int8: symmetric, one scale per output row: w ~= q * scale, q in [-127, 127]. Rows of a
  trained Llama differ in range far more than the values within one row do, so one scale per
  row loses little (the quality tests bound it).
- int4: groups of `group_size` consecutive inputs of a row (default 32, llama.cpp's Q4_0 block),
  asymmetric: w ~= (q - 8) * scale + zero, q in [0, 15], where zero is the value code 8 stands
  for. Sixteen levels are few, so spanning each group's [min, max] (rather than a symmetric
  [-absmax, absmax], which wastes a level or a half range on lopsided groups) matters.

Codes, scales and zeros are held, and saved, in the layout the kernels read (kernels/matvec.py:
rows in interleaved sets of eight), so loading is a plain read. int8 rows saved plain (before
that layout) are put in it as they load (upgrade_int8_layout).

The token embedding stays in the model's dtype: a decoding step reads one of its rows, so
quantizing it saves memory but no time. The output head is int8 under both methods: it is the
largest matrix of a small model and the one whose errors reach the logits undamped (llama.cpp
likewise keeps the head at higher precision in its Q4 files).

A decoding step (a few rows of activations) runs the kernels of kernels/matvec.py, which round
the activations to int8 in blocks of 32 and multiply integers, as llama.cpp does. Longer inputs
run torch's int8 kernel, or dequantize; `impl="reference"` always dequantizes, then F.linear:
the known answer the tests hold the kernels to.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .kernels.matvec import (ROW_SET, deinterleave_rows, interleave_rows, operators_for, pack_int4, pack_int8, unpack_int4,
                             unpack_int8)
from .model import Transformer

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
INT4_LAYOUT = "rows-of-8"  # recorded with int4 checkpoints: how codes, scales and zeros are laid out


class Int8Linear(nn.Module):
    """y = x W^T with W stored as int8 rows and one scale per row (scales in the model's dtype).

    Rows are held, and saved, in the kernel's layout (interleaved sets of eight) where the
    kernel takes the shape: out_features % 8 == 0 and in_features % 32 == 0, every matrix of a
    Llama. Other shapes keep plain rows and run torch's kernels.
    """

    def __init__(self, in_features: int, out_features: int, dtype=torch.float32, device=None, impl: str = "auto"):
        super().__init__()
        self.in_features, self.out_features, self.impl = in_features, out_features, impl
        self.rows_of_8 = out_features % ROW_SET == 0 and in_features % 32 == 0
        shape = (out_features // ROW_SET, ROW_SET * in_features) if self.rows_of_8 else (out_features, in_features)
        self.register_buffer("weight", torch.empty(shape, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, dtype=dtype, device=device))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, impl: str = "auto") -> "Int8Linear":
        layer = cls(weight.shape[1], weight.shape[0], weight.dtype, weight.device, impl)
        codes, layer.scales = quantize_int8(weight)
        layer.weight = pack_int8(codes) if layer.rows_of_8 else codes
        return layer

    def codes(self) -> torch.Tensor:
        """The codes as int8 (out_features, in_features)."""
        return unpack_int8(self.weight) if self.rows_of_8 else self.weight

    def dequantize(self) -> torch.Tensor:
        return (self.codes().float() * self.scales.float()[:, None]).to(self.scales.dtype)

    def forward(self, x):
        if self.impl != "reference":
            ops = operators_for(x, self.scales) if self.rows_of_8 else None
            if ops is not None:
                return ops.matvec_int8(x, self.weight, self.scales)
            mm = getattr(torch, "_weight_int8pack_mm", None)  # torch's, for longer inputs
            if mm is not None and x.dtype == self.scales.dtype and x.device.type == "cpu":
                return mm(x.reshape(-1, x.shape[-1]), self.codes(), self.scales).view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantize().to(x.dtype))

    def kernel_operands(self):
        """(weight, scales, zeros) as kernels.matvec.decode_layer passes them, or None."""
        return (self.weight, self.scales, None) if self.impl != "reference" and self.rows_of_8 else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


class Int4Linear(nn.Module):
    """y = x W^T with W stored as 4-bit codes in groups along the input, each with a scale and a zero."""

    def __init__(self, in_features: int, out_features: int, group_size: int = DEFAULT_GROUP_SIZE,
                 dtype=torch.float32, device=None, impl: str = "auto"):
        super().__init__()
        check_int4_shape(in_features, out_features, group_size)
        self.in_features, self.out_features, self.group_size, self.impl = in_features, out_features, group_size, impl
        sets, groups = out_features // ROW_SET, in_features // group_size
        self.register_buffer("weight", torch.empty(sets, 4 * in_features, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(sets, groups * ROW_SET, dtype=dtype, device=device))
        self.register_buffer("zeros", torch.empty(sets, groups * ROW_SET, dtype=dtype, device=device))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, impl: str = "auto") -> "Int4Linear":
        layer = cls(weight.shape[1], weight.shape[0], group_size, weight.dtype, weight.device, impl)
        codes, scales, zeros = quantize_int4(weight, group_size)
        layer.weight, layer.scales, layer.zeros = pack_int4(codes), interleave_rows(scales), interleave_rows(zeros)
        return layer

    def codes(self) -> torch.Tensor:
        """The codes 0..15 as uint8 (out_features, in_features)."""
        return unpack_int4(self.weight)

    def group_scales_and_zeros(self):
        """(scales, zeros), each (out_features, groups)."""
        return deinterleave_rows(self.scales), deinterleave_rows(self.zeros)

    def dequantize(self) -> torch.Tensor:
        scales, zeros = self.group_scales_and_zeros()
        codes = self.codes().float().unflatten(-1, (-1, self.group_size))
        w = (codes - 8) * scales.float()[..., None] + zeros.float()[..., None]
        return w.flatten(-2).to(scales.dtype)

    def forward(self, x):
        ops = operators_for(x, self.scales) if self.impl != "reference" else None
        if ops is None:
            return F.linear(x, self.dequantize().to(x.dtype))
        return ops.matvec_int4(x, self.weight, self.scales, self.zeros)

    def kernel_operands(self):
        """(weight, scales, zeros) as kernels.matvec.decode_layer passes them, or None."""
        return None if self.impl == "reference" else (self.weight, self.scales, self.zeros)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group_size}"


def check_int4_shape(in_features: int, out_features: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {group_size}")
    if in_features % group_size:
        fix = "use int8" if in_features % DEFAULT_GROUP_SIZE else f"use group size {DEFAULT_GROUP_SIZE}"
        raise ValueError(f"int4 needs every input size divisible by the group size {group_size}; {in_features} is not ({fix})")
    if out_features % ROW_SET:
        raise ValueError(f"int4 needs every output size divisible by {ROW_SET}; {out_features} is not (use int8)")


# --- Quantizers (float weights -> codes and scales) --------------------------------------


def quantize_int8(weight: torch.Tensor):
    """(int8 codes, scales in weight's dtype). The codes are computed with the scales as stored,
    so dequantizing gives each weight to within half a (stored) scale."""
    absmax = weight.float().abs().amax(dim=1)
    scales = (absmax / 127).clamp(min=torch.finfo(torch.float32).tiny).to(weight.dtype)
    codes = torch.round(weight.float() / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def quantize_int4(weight: torch.Tensor, group_size: int):
    """(codes 0..15 as uint8 (out, in), scales, zeros (out, in // group_size) in weight's dtype)."""
    groups = weight.float().unflatten(-1, (-1, group_size))
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(weight.dtype)
    zeros = (low + 8 * scales.float()).to(weight.dtype)
    codes = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None]) + 8
    return codes.clamp(0, 15).to(torch.uint8).flatten(-2), scales, zeros




# --- The model -----------------------------------------------------------------------------


def quantized_linears(model: Transformer):
    """(parent module, attribute name, is the output head) of every linear layer that is quantized."""
    for layer in model.layers:
        for parent in (layer.attention, layer.feed_forward):
            for name in ("wq", "wk", "wv", "wo") if parent is layer.attention else ("w1", "w2", "w3"):
                yield parent, name, False
    yield model, "output", True


def quantize_model(model: Transformer, method: str, group_size: int = DEFAULT_GROUP_SIZE, impl: str = "auto") -> Transformer:
    """Replace model's linear layers by quantized ones, in place and one at a time (so at most one
    float matrix beyond the quantized ones is alive); returns model. The head is int8 either way."""
    check_method(method)
    for parent, name, is_head in quantized_linears(model):
        weight = getattr(parent, name).weight.detach()
        if method == "int8" or is_head:
            setattr(parent, name, Int8Linear.from_weight(weight, impl))
        else:
            setattr(parent, name, Int4Linear.from_weight(weight, group_size, impl))
    # The head is now a matrix of its own, no longer the embedding table: say so, so that the
    # config saved with these tensors describes them.
    model.args.tie_embeddings = False
    model.quantization = quantization_record(method, group_size)
    return model


def upgrade_int8_layout(state: dict, expected: dict) -> None:
    """Put int8 rows that state holds plain, (out, in), in the kernel's layout where expected
    (an empty model's state dict) has it, (out / 8, 8 in); in place, one matrix at a time."""
    for name, tensor in state.items():
        want = expected.get(name)
        if want is not None and tensor.dtype == want.dtype == torch.int8 and want.dim() == 2:
            if tuple(tensor.shape) == (want.shape[0] * ROW_SET, want.shape[1] // ROW_SET):
                state[name] = pack_int8(tensor)


def empty_quantized_model(args, quantization: dict, impl: str = "auto") -> Transformer:
    """A Transformer with quantized layers of the right shapes, built on the current (meta)
    device for load_state_dict(assign=True): the full-precision weights never exist."""
    method, group_size = quantization["method"], quantization["group_size"]
    model = Transformer(args)
    for parent, name, is_head in quantized_linears(model):
        linear = getattr(parent, name)
        if method == "int8" or is_head:
            setattr(parent, name, Int8Linear(linear.in_features, linear.out_features, impl=impl))
        else:
            setattr(parent, name, Int4Linear(linear.in_features, linear.out_features, group_size, impl=impl))
    model.quantization = dict(quantization)
    return model


def parameter_count(model: nn.Module) -> int:
    """The model's parameters, counting each quantized weight once (they are buffers, not parameters)."""
    quantized = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear)))
    return quantized + sum(p.numel() for p in model.parameters())


def check_method(method: str) -> None:
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(QUANTIZATIONS)}")


def read_quantization(record, source) -> dict:
    """The quantization record of a config.json, checked: {"method": ..., "group_size": ...}."""
    if not isinstance(record, dict) or record.get("method") not in QUANTIZATIONS:
        raise ValueError(f"{source} has a quantization record llama_mini does not know ({record!r}); convert the checkpoint again")
    group_size = record.get("group_size", DEFAULT_GROUP_SIZE)
    if record["method"] == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{source}: int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    if record["method"] == "int4" and record.get("layout") != INT4_LAYOUT:
        raise ValueError(f"{source} holds int4 codes in an older layout; convert the checkpoint again from its source")
    return quantization_record(record["method"], group_size)


def quantization_record(method: str, group_size: int) -> dict:
    """What config.json says of a quantized checkpoint."""
    record = {"method": method, "group_size": group_size}
    return record | {"layout": INT4_LAYOUT} if method == "int4" else record
