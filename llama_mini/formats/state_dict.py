"""A state dict made a model: checked against its config by name and shape, then assigned.

The checks run before anything large is built or read, so a config that disagrees with its
weights (or claims ten million layers) is one line of error, not minutes of building.
"""

import itertools
import re

import torch

from ..model import ModelArgs, Transformer
from ..quant import empty_quantized_model, upgrade_int8_layout

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.")  # ours and Hugging Face's names


def tie_equal_heads(state: dict) -> bool:
    """Make output.weight the embedding tensor itself when the two hold the same values.

    Meta's format has no tying flag: its reference Transformer always builds a separate
    output layer, so Llama-3.2 1B/3B, trained with tied weights (their Hugging Face configs say
    tie_word_embeddings: true), store the head twice in consolidated.00.pth; llama2.c's ckpt.pt
    holds both names of its always-tied head. Equal values are
    the only sign, and the test llama2.c's export.py uses to decide whether its classifier is
    shared (`shared_classifier = torch.equal(...)`). The first rows are compared first, so an
    untied model costs one row, not a pass over both.
    """
    embedding, head = state.get("tok_embeddings.weight"), state.get("output.weight")
    if embedding is None or head is None or embedding.shape != head.shape or embedding.dtype != head.dtype:
        return False
    if not (torch.equal(embedding[:1], head[:1]) and torch.equal(embedding, head)):
        return False
    state["output.weight"] = embedding
    return True


def build_model(args: ModelArgs, state: dict, device=None, dtype=None, quantization=None) -> Transformer:
    """A Transformer holding exactly the tensors of state, checked by name and shape.
    quantization (a stored record) builds the quantized layers the state holds instead."""
    check_layer_count(args, state)  # before building: a config may claim millions of layers
    with torch.device("meta"):
        model = Transformer(args)
        if quantization is not None:
            empty_quantized_model(model, quantization)
    expected = model.state_dict()
    if quantization is not None:
        upgrade_int8_layout(state, expected)
    missing = expected.keys() - state.keys()
    unexpected = state.keys() - expected.keys()
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the config: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    for name, tensor in state.items():
        check_shape(name, tensor, expected[name])
    dtypes = {tensor.dtype for tensor in state.values() if tensor.is_floating_point()}
    if dtype is None and len(dtypes) > 1:  # one dtype for all, as transformers' torch_dtype gives
        dtype = state["tok_embeddings.weight"].dtype
    model.load_state_dict(state, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # assign=True replaced the shared Parameter
    model = model.to(device=device, dtype=dtype).eval()
    return model


def check_layer_count(args: ModelArgs, names) -> None:
    """The tensor names hold layers 0 .. n_layers-1: checked before any model is built, since
    building costs time and memory per layer the config claims, and the names are bounded by
    what the files hold."""
    found = {int(m.group(1)) for name in names if (m := _LAYER_INDEX.search(name))}
    if len(found) == args.n_layers and max(found, default=-1) == args.n_layers - 1:
        return
    missing = itertools.islice((f"layers.{i}.*" for i in range(args.n_layers) if i not in found), 3)
    unexpected = [f"layers.{i}.*" for i in sorted(i for i in found if i >= args.n_layers)[:3]]
    raise ValueError(
        f"checkpoint does not fit the config: missing {list(missing)}, unexpected {unexpected} "
        f"(the config says {args.n_layers} layers; the weights hold {len(found)})"
    )


def check_shape(name: str, tensor, expected) -> None:
    if tensor.shape != expected.shape:
        raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)} but the config implies {tuple(expected.shape)}")
