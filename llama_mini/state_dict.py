"""A state dict made a model: checked against its config by name and shape, then assigned.

The checks run before anything large is built or read, so a config that disagrees with its
weights (or claims ten million layers) is one line of error, not minutes of building.
"""

import itertools
import re

import torch

from .model import ModelArgs, Transformer

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.")  # ours and Hugging Face's names


def build_model(args: ModelArgs, state: dict, device=None, dtype=None) -> Transformer:
    """A Transformer holding exactly the tensors of state, checked by name and shape."""
    check_layer_count(args, state)  # before building: a config may claim millions of layers
    with torch.device("meta"):
        model = Transformer(args)
    expected = model.state_dict()
    missing = expected.keys() - state.keys()
    unexpected = state.keys() - expected.keys()
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the config: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    for name, tensor in state.items():
        check_shape(name, tensor, expected[name])
    dtypes = {tensor.dtype for tensor in state.values()}
    if dtype is None and len(dtypes) > 1:  # one dtype for all, as transformers' torch_dtype gives
        dtype = state["tok_embeddings.weight"].dtype
    model.load_state_dict(state, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # assign=True replaced the shared Parameter
    model.init_rope()  # the RoPE tables are still on the meta device, where nothing can copy them from
    return model.to(device=device, dtype=dtype).eval()


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
