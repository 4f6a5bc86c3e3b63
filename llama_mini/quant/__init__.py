"""Weight-only quantization, applied to a model from outside: quantize(model, "int8" | "int4").

The surgery swaps each nn.Linear of a model for an int8 or int4 layer (layers.py) in place, as
gpt-fast's quantize.py does; model.py knows nothing of it. The token embedding stays in the
model's dtype: a decoding step reads one of its rows, so quantizing it saves memory but no time.
The output head is int8 under both methods: it is the largest matrix of a small model and the
one whose errors reach the logits undamped (llama.cpp likewise keeps the head at higher
precision in its Q4 files).

A quantized checkpoint stores the layers' buffers as they are held (layout.py), with a record
in config.json that says how (quantization_record); empty_quantized_model builds the layers
to load them into without ever holding full-precision weights. Which layout a checkpoint's
buffers are in is the format record's to say (llama_mini/formats/record.py).
"""

from typing import Optional

import torch
from torch import nn

from ..support.device import fastest_time
from ..support.memory import return_freed_memory
from .held import empty_held_model, is_layer_record
from .k_quants import KQuantLinear
from .layers import DEFAULT_GROUP_SIZE, INT4_GROUP_SIZES, Int4Linear, Int8Linear, QuantizedEmbedding
from .mapped_q8_0 import MappedQ8_0Linear

QUANTIZATIONS = ("int8", "int4")
INTEGER_LAYERS = (Int8Linear, Int4Linear, KQuantLinear)


def quantize(model: nn.Module, method: str, group_size: int = DEFAULT_GROUP_SIZE, weights: Optional[dict] = None,
             dtype=None, device=None) -> nn.Module:
    """Replace model's linear layers by quantized ones, in place and one at a time, each a chunk of
    rows at a time (so beyond the quantized layers at most one float matrix is alive, and a few
    megabytes of temporaries); returns model. The head is int8 either way.

    weights, where given, is a checkpoint's state ({name: tensor}, mapped from its files): each
    layer's matrix is taken from it (and dropped from it) instead of from the layer, which may be
    on the meta device, so that a model is quantized as it is loaded without ever being held in
    floats. dtype and device are the layers' (default: each weight's)."""
    check_method(method)
    for name, (parent, attribute, linear) in _linears(model).items():
        if weights is None:
            weight = linear.state_dict()["weight"]  # its rows, as saved, whatever layout a kernel holds it in
        else:  # a tied head is the embedding's table, which stays in the state for the embedding
            weight = weights.pop(name + ".weight") if name + ".weight" in weights else weights["tok_embeddings.weight"]
        if method == "int8" or linear is model.output:
            setattr(parent, attribute, Int8Linear.from_weight(weight, dtype, device))
        else:
            setattr(parent, attribute, Int4Linear.from_weight(weight, group_size, dtype, device))
        return_freed_memory()
    # The head is now a matrix of its own, no longer the embedding table: say so, so that the
    # config saved with these tensors describes them.
    model.args.tie_embeddings = False
    model.quantization = quantization_record(method, group_size)
    return model


def dequantize(model: nn.Module) -> nn.Module:
    """The inverse of quantize: each quantized layer becomes an nn.Linear holding its dequantized
    weight, in its float_dtype (its scales'), in place; returns model. The weights are the quantized
    ones, not the full-precision weights they came from. An embedding held as an integer layer's
    rows (a GGUF file's) becomes an nn.Embedding of them, still the head's where the two are tied."""
    embedding = getattr(model, "tok_embeddings", None)
    if isinstance(embedding, QuantizedEmbedding):
        model.tok_embeddings = nn.Embedding.from_pretrained(embedding.table.dequantize(), freeze=False)
        if model.output is embedding.table:
            model.output = nn.Linear(embedding.table.in_features, embedding.table.out_features, bias=False, device="meta")
            model.output.weight = model.tok_embeddings.weight
    for parent, name, layer in _linears(model, INTEGER_LAYERS).values():
        linear = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(layer.dequantize())
        setattr(parent, name, linear)
    model.quantization = None
    return model


def empty_quantized_model(model: nn.Module, quantization: dict) -> nn.Module:
    """model (built on the meta device, for load_state_dict(assign=True)) with quantized layers
    of the right shapes in place of its linear layers: the full-precision weights never exist."""
    if quantization["method"] == "gguf":
        empty_held_model(model, quantization["layers"])
        model.quantization = dict(quantization)
        return model
    method, group_size = quantization["method"], quantization["group_size"]
    for parent, name, linear in _linears(model).values():
        if method == "int8" or linear is model.output:
            setattr(parent, name, Int8Linear(linear.in_features, linear.out_features))
        else:
            setattr(parent, name, Int4Linear(linear.in_features, linear.out_features, group_size))
    model.quantization = dict(quantization)
    return model


def hold_plain_rows(model: nn.Module) -> nn.Module:
    """Each integer layer of model the CPU kernels do not run holds its rows plainly, the layout
    torch.compile's loops read fastest (layers.py); returns model. Its state_dict keeps the stored
    layout, but a factored int4 layer's (a GGUF file's Q4_K) then holds its scales multiplied out."""
    for layer in model.modules():
        if type(layer) in (Int8Linear, Int4Linear, MappedQ8_0Linear):
            layer.hold_plain_rows()
    return model


def _linears(model: nn.Module, kind=nn.Linear) -> dict:
    """{qualified name: (parent, attribute name, layer)} of every layer of that kind in model,
    listed before any is replaced."""
    return {f"{prefix}.{name}".lstrip("."): (parent, name, child) for prefix, parent in model.named_modules()
            for name, child in parent.named_children() if isinstance(child, kind)}


# Torch's CPU code whose compiled decoding step reads the codes as fast as float ones, or faster;
# with its plain code they run slower (layers.one_row; docs/generate_speed.md has the measurements).
FAST_COMPILED_CPU_CODE = ("AVX512", "AVX2")


def quantized_notice(model: nn.Module, flag: Optional[str] = "--quantize", compiled: bool = False) -> Optional[str]:
    """One line where model's integer layers compute slower than the float layers they stand
    for, on this device, as they run, and that they save memory rather than time; None where
    they cost nothing or model holds none. Eagerly (off the CPU kernels, each call dequantizes
    its weight) the cost is measured here. Compiled, a decoding step reads the codes in one pass
    (layers.py), as fast as float with torch's AVX-512 and AVX2 code, slower with its plain code."""
    layer = next((m for m in model.modules() if isinstance(m, INTEGER_LAYERS)), None)
    if layer is None:
        return None
    method = layer_method(layer)
    # flag None: the layers hold a GGUF file's own blocks, which --dtype float32 would dequantize
    saves = f"{flag} {method} saves memory, not time" if flag else \
        f"the file's {method} blocks save memory, not time (--dtype float32 spends the memory instead)"
    isa = torch.backends.cpu.get_cpu_capability()
    one_row = isinstance(layer, (Int8Linear, Int4Linear))  # compiled, one pass over the codes; Q5_K and Q6_K dequantize
    fast_compiled = one_row and (layer.scales.device.type != "cpu" or isa in FAST_COMPILED_CPU_CODE)
    if compiled:
        if fast_compiled:
            return None
        if not one_row:
            return f"note: compiled, {method} layers still dequantize their weights each step: {saves}"
        return (f"note: compiled with torch's {isa} CPU code, {method} layers decode slower than float ones "
                f"(docs/generate_speed.md has the speeds measured): {saves}")
    if (slowdown := quantized_slowdown(layer)) < 1.5:
        return None
    return (f"note: here {method} layers take {slowdown:.0f}x the time of float ones in a decoding step (off the CPU "
            f"kernels each step dequantizes them): {saves}"
            + (", unless you add --compile" if fast_compiled else ""))


def quantized_slowdown(layer: nn.Module) -> float:
    """How many times longer `layer` takes than a float layer of its weights (its dequantized
    weight, in its scales' dtype) for one row, on its device: measured, a few milliseconds."""
    x = torch.randn(1, 1, layer.in_features, device=next(layer.buffers()).device, dtype=layer.float_dtype)
    with torch.inference_mode():
        weight = layer.dequantize()
        return fastest_time(lambda: layer(x), x.device) / fastest_time(lambda: torch.nn.functional.linear(x, weight), x.device)


def parameter_count(model: nn.Module) -> int:
    """The model's parameters, counting each quantized weight once (they are buffers, not parameters)."""
    quantized = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, INTEGER_LAYERS))
    return quantized + sum(p.numel() for p in model.parameters())


def layer_method(layer: nn.Module) -> str:
    """"int8", "int4", "Q5_K" or "Q6_K": what an integer layer holds."""
    if isinstance(layer, KQuantLinear):
        return layer.KIND
    return "int8" if isinstance(layer, Int8Linear) else "int4"


def check_method(method: str) -> None:
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(QUANTIZATIONS)}")


def read_quantization(record, source) -> dict:
    """The quantization record of a config.json, checked: {"method": ..., "group_size": ...}, or a
    GGUF file's layers as held ({"method": "gguf", "layers": ...}, held.py)."""
    if isinstance(record, dict) and record.get("method") == "gguf":
        layers = record.get("layers")
        if not (isinstance(layers, dict) and all(isinstance(name, str) and is_layer_record(r) for name, r in layers.items())):
            raise ValueError(f"{source} has a record of a GGUF file's layers that llama_mini does not know; convert the file again")
        held = record.get("held")
        return {"method": "gguf", "held": held if isinstance(held, str) else "a GGUF file's blocks", "layers": layers}
    if not isinstance(record, dict) or record.get("method") not in QUANTIZATIONS or "group_size" not in record:
        raise ValueError(f"{source} has a quantization record llama_mini does not know ({record!r}); convert the checkpoint again")
    group_size = record["group_size"]
    if record["method"] == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{source}: int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    return quantization_record(record["method"], group_size)


def quantization_record(method: str, group_size: int) -> dict:
    """What config.json says of a quantized checkpoint (the layout is the format record's, formats/record.py)."""
    return {"method": method, "group_size": group_size}
