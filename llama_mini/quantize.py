"""Weight-only quantization: linear layers that store int8 or int4 weights, and the model surgery.

Decoding one token reads every weight once, so on a CPU tokens/s is bounded by memory
bandwidth / weight bytes: fewer bytes per weight is the speed-up. Activations stay in the
model's dtype; only the weights are stored as integers with floating-point scales.

- int8: symmetric, one scale per output row: w ~= q * scale, q in [-127, 127]. Rows of a
  trained Llama differ in range far more than the values within one row do, so one scale per
  row loses little (the quality tests bound it), and it is what torch's _weight_int8pack_mm reads.
- int4: groups of `group_size` consecutive inputs of a row (default 32, llama.cpp's Q4_0 block),
  asymmetric: w ~= (q - 8) * scale + zero, q in [0, 15], where zero is the value code 8 stands
  for. Sixteen levels are few, so spanning each group's [min, max] (rather than a symmetric
  [-absmax, absmax], which wastes a level or a half range on lopsided groups) matters; it is also
  the convention of torch's _weight_int4pack_mm_for_cpu, so no conversion is needed.

The token embedding stays in the model's dtype: a decoding step reads one of its rows, so
quantizing it saves memory but no time. The output head is int8 under both methods: it is the
largest matrix of a small model and the one whose errors reach the logits undamped (llama.cpp
likewise keeps the head at higher precision in its Q4 files).

Each layer has a reference path (dequantize, then F.linear) that the tests use as the known
answer, and that runs where torch's kernel is missing or the shape does not fit it.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .model import Transformer

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
_INT4_KERNEL_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu needs out_features divisible by this


def _kernel(name):
    """torch's CPU operator `name`, or None on a build without it (the reference path runs)."""
    return getattr(torch, name, None)


class Int8Linear(nn.Module):
    """y = x W^T with W stored as int8 rows and one scale per row (scales in the model's dtype)."""

    def __init__(self, in_features: int, out_features: int, dtype=torch.float32, device=None, impl: str = "auto"):
        super().__init__()
        self.in_features, self.out_features, self.impl = in_features, out_features, impl
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.empty(out_features, dtype=dtype, device=device))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, impl: str = "auto") -> "Int8Linear":
        layer = cls(weight.shape[1], weight.shape[0], weight.dtype, weight.device, impl)
        layer.weight, layer.scales = quantize_int8(weight)
        return layer

    def dequantize(self) -> torch.Tensor:
        return (self.weight.float() * self.scales.float()[:, None]).to(self.scales.dtype)

    def forward(self, x):
        mm = _kernel("_weight_int8pack_mm")
        if self.impl == "reference" or mm is None or x.dtype != self.scales.dtype or x.device.type != "cpu":
            return F.linear(x, self.dequantize().to(x.dtype))
        return mm(x.reshape(-1, x.shape[-1]), self.weight, self.scales).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


class Int4Linear(nn.Module):
    """y = x W^T with W stored as 4-bit codes in groups along the input, each with a scale and a zero.

    `weight` (saved) holds two codes per byte, the even input in the low nibble: a layout of our
    own, the same on every machine. torch's kernel wants its own layout, which depends on the
    CPU's instruction set, so prepare() derives `packed` from `weight` at load and then drops
    `weight`, keeping one copy of the weights in memory; state_dict() rebuilds it from `packed`.
    Likewise the kernel reads scales and zeros interleaved (`scales_and_zeros`), built once
    rather than on every call.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int = DEFAULT_GROUP_SIZE,
                 dtype=torch.float32, device=None, impl: str = "auto"):
        super().__init__()
        check_int4_shape(in_features, group_size)
        self.in_features, self.out_features, self.group_size, self.impl = in_features, out_features, group_size, impl
        groups = in_features // group_size
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("zeros", torch.empty(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("packed", None, persistent=False)  # the kernel's layout, set by prepare()
        self.register_buffer("scales_and_zeros", None, persistent=False)  # (groups, out_features, 2), likewise
        self.register_state_dict_post_hook(_save_codes)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, impl: str = "auto") -> "Int4Linear":
        layer = cls(weight.shape[1], weight.shape[0], group_size, weight.dtype, weight.device, impl)
        codes, layer.scales, layer.zeros = quantize_int4(weight, group_size)
        layer.weight = pack_nibbles(codes)
        return layer.prepare()

    def prepare(self) -> "Int4Linear":
        """Repack the codes for torch's kernel where it exists and the shape fits it."""
        convert = _kernel("_convert_weight_to_int4pack_for_cpu")
        usable = self.impl != "reference" and convert is not None and _kernel("_weight_int4pack_mm_for_cpu") is not None
        if usable and self.out_features % _INT4_KERNEL_N_MULTIPLE == 0 and self.weight.device.type == "cpu":
            self.packed = convert(unpack_nibbles(self.weight).to(torch.int32), 2)
            self.scales_and_zeros = torch.stack((self.scales.t(), self.zeros.t()), dim=-1).contiguous()
            self.weight = self.scales = self.zeros = None
        return self

    def group_scales_and_zeros(self):
        """(scales, zeros), each (out_features, groups), from whichever layout is held."""
        if self.scales is not None:
            return self.scales, self.zeros
        return self.scales_and_zeros[..., 0].t(), self.scales_and_zeros[..., 1].t()

    def codes(self) -> torch.Tensor:
        """The codes 0..15 as uint8 (out_features, in_features), from whichever layout is held."""
        return unpack_nibbles(self.weight) if self.weight is not None else self._codes_from_kernel()

    @torch.no_grad()
    def _codes_from_kernel(self, rows: int = 256) -> torch.Tensor:
        """Read the codes back out of the kernel's layout, exactly: with every scale 1 and every
        zero 8 the kernel computes (q - 8) * 1 + 8 = q, so unit vectors in give the codes out."""
        groups = self.in_features // self.group_size
        scale_one_zero_eight = torch.tensor([1.0, 8.0]).expand(groups, self.out_features, 2).contiguous()
        columns = []
        for start in range(0, self.in_features, rows):
            n = min(rows, self.in_features - start)
            unit = torch.zeros(n, self.in_features)
            unit[torch.arange(n), torch.arange(start, start + n)] = 1.0
            columns.append(torch._weight_int4pack_mm_for_cpu(unit, self.packed, self.group_size, scale_one_zero_eight))
        return torch.cat(columns).t().round().to(torch.uint8)

    def dequantize(self) -> torch.Tensor:
        scales, zeros = self.group_scales_and_zeros()
        codes = self.codes().float().unflatten(-1, (-1, self.group_size))
        w = (codes - 8) * scales.float()[..., None] + zeros.float()[..., None]
        return w.flatten(-2).to(scales.dtype)

    def forward(self, x):
        if self.packed is None:
            return F.linear(x, self.dequantize().to(x.dtype))
        scales_and_zeros = self.scales_and_zeros.to(x.dtype)  # a no-op unless the model's dtype changed since
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), self.packed, self.group_size, scales_and_zeros)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group_size}"


def _save_codes(module: Int4Linear, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: a prepared layer holds only the kernel's layouts; save ours."""
    if module.weight is None:
        state_dict[prefix + "weight"] = pack_nibbles(module.codes())
        state_dict[prefix + "scales"], state_dict[prefix + "zeros"] = (t.contiguous() for t in module.group_scales_and_zeros())


def check_int4_shape(in_features: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"int4 needs every input size divisible by the group size {group_size}; {in_features} is not (use --group-size 32)")


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


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 (..., n) -> (..., n // 2) bytes: even index in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


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
    model.quantization = {"method": method, "group_size": group_size}
    return model


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


def prepare_quantized(model: Transformer) -> Transformer:
    """After the stored tensors were assigned: derive the kernels' layouts."""
    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.prepare()
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
    return {"method": record["method"], "group_size": group_size}
