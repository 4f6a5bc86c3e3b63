"""A GGUF file's layers as held, in a native checkpoint: what config.json says of each, and the
empty layers that record builds to load them into.

A GGUF file is held at its own precision as layers of several kinds at once (Q8_0 as int8 with
float16 scales, Q4_K as factored int4, Q5_K and Q6_K as their own blocks, and so on, gguf_blocks.py), so one method
and group size cannot describe it. Its checkpoint's record names the layer each matrix is held
in, and the few numbers that fix its buffers' shapes and dtypes:

    "quantization": {"method": "gguf", "layers": {"layers.0.attention.wq": {"layer": "int4",
        "dtype": "float32", "group_size": 32, "super_group_size": 256, "symmetric": false}, ...}}

Matrices it does not name are float, as the file held them.
"""

import torch
from torch import nn

from .k_quants import KQuantLinear, Q5_KLinear, Q6_KLinear
from .layers import INT4_GROUP_SIZES, Int4Linear, Int8Linear, QuantizedEmbedding

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
SUPER_GROUP_SIZES = (0, 256)  # none, or llama.cpp's K-quants'
EMBEDDING = "tok_embeddings"
K_QUANTS = {"q5_k": Q5_KLinear, "q6_k": Q6_KLinear}  # held as the file's blocks


def layer_record(layer: nn.Module) -> dict:
    """What the record says of one integer layer."""
    if isinstance(layer, KQuantLinear):
        return {"layer": layer.KIND.lower()}
    floats = layer.super_scales if getattr(layer, "super_group_size", 0) else layer.scales
    record = {"layer": "int8" if isinstance(layer, Int8Linear) else "int4", "dtype": str(floats.dtype).removeprefix("torch.")}
    if isinstance(layer, Int4Linear):
        record.update(group_size=layer.group_size, super_group_size=layer.super_group_size, symmetric=layer.symmetric)
    return record


def is_layer_record(record) -> bool:
    """Whether a record read from a file is one layer_record writes (its values, not yet its shapes)."""
    if not isinstance(record, dict):
        return False
    kind = record.get("layer")
    if kind in K_QUANTS:
        return record.keys() == {"layer"}
    dtype_known = isinstance(record.get("dtype"), str) and record["dtype"] in DTYPES
    if kind == "int8":
        return record.keys() == {"layer", "dtype"} and dtype_known
    sizes = record.get("group_size"), record.get("super_group_size")
    return (kind == "int4" and record.keys() == {"layer", "dtype", "group_size", "super_group_size", "symmetric"} and dtype_known
            and all(type(size) is int for size in sizes) and sizes[0] in INT4_GROUP_SIZES and sizes[1] in SUPER_GROUP_SIZES
            and type(record["symmetric"]) is bool and not (record["symmetric"] and sizes[1]))


def empty_layer(record: dict, in_features: int, out_features: int) -> nn.Module:
    """The layer a record describes, of that shape (on the current default device)."""
    kind = record["layer"]
    if kind == "int8":
        return Int8Linear(in_features, out_features, DTYPES[record["dtype"]])
    if kind == "int4":
        return Int4Linear(in_features, out_features, record["group_size"], DTYPES[record["dtype"]],
                          super_group_size=record["super_group_size"], symmetric=record["symmetric"])
    return K_QUANTS[kind].empty(in_features, out_features)


def empty_held_model(model: nn.Module, layers: dict) -> nn.Module:
    """model (on the meta device) with the layers the record names in place of its matrices; the
    embedding's rows are looked up from its layer (QuantizedEmbedding), which is the head too
    where the two are tied."""
    modules = dict(model.named_modules())
    for name, record in layers.items():
        old = modules.get(name)
        if name == EMBEDDING and isinstance(old, nn.Embedding):
            layer = QuantizedEmbedding(empty_layer(record, old.embedding_dim, old.num_embeddings))
        elif isinstance(old, nn.Linear) and name != EMBEDDING:
            layer = empty_layer(record, old.in_features, old.out_features)
        else:
            raise ValueError(f"its quantization record names {name[:80]!r}, which is not a matrix of this model")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    if model.args.tie_embeddings and isinstance(model.tok_embeddings, QuantizedEmbedding):
        model.output = model.tok_embeddings.table
    return model
