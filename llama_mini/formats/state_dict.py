"""A state dict made a model: checked against its config by name and shape (check_fits_config, the
one check every reader makes), then assigned (build_model).

The check runs before anything large is built or read, so a config that disagrees with its
weights (or claims ten million layers) is one line of error, not minutes of building.
"""

import itertools
import re

import torch
from torch.overrides import TorchFunctionMode

from ..model import ModelArgs, Transformer
from .. import quant
from .names import to_format

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.")
MISFIT = "the config was not written for these weights: restore the one that came with them, or download or convert the checkpoint again"


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


def check_fits_config(args: ModelArgs, tensors: dict, source, layout: str = "ours", quantization=None) -> Transformer:
    """Refuse, in one line naming source, tensors (by our names; anything with a shape) that are
    not exactly the model args describes, quantized as the record says: every name and shape.
    Returns that model, empty (empty_model's), for a reader that fills it itself.

    Every reader runs this once per checkpoint, on the tensors as the files map them, before
    it permutes or dequantizes any. layout ("hf", "gguf") names the tensors in messages as
    the file does. A tied head may be absent: it is the embedding.
    """
    named = (lambda name: name) if layout == "ours" else (lambda name: to_format(name, layout))
    _check_layer_count(args, tensors, source)  # before building: a config may claim millions of layers
    try:
        model = empty_model(args, quantization)
    except ValueError as e:  # a quantization record that does not fit the config
        raise ValueError(f"{source}: {e}; {MISFIT}") from None
    expected = model.state_dict()
    missing = {name for name in expected.keys() - tensors.keys() if not (args.tie_embeddings and name.startswith("output."))}
    unexpected = tensors.keys() - expected.keys()
    if missing or unexpected:
        found = {"missing": sorted(map(named, missing))[:3], "unexpected": sorted(map(named, unexpected))[:3]}
        raise ValueError(f"{source} does not fit the config: {_listed(found)}; {MISFIT}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{source}: tensor {named(name)} has shape {tuple(tensor.shape)} but the config implies "
                             f"{tuple(expected[name].shape)}; {MISFIT}")
    return model


def _check_layer_count(args: ModelArgs, names, source) -> None:
    """The tensor names hold layers 0 .. n_layers-1: checked before any model is built, since
    building costs time and memory per layer the config claims, and the names are bounded by
    what the files hold."""
    found = {int(m.group(1)) for name in names if (m := _LAYER_INDEX.search(name))}
    if len(found) == args.n_layers and max(found, default=-1) == args.n_layers - 1:
        return
    missing = itertools.islice((f"layers.{i}.*" for i in range(args.n_layers) if i not in found), 3)
    unexpected = [f"layers.{i}.*" for i in sorted(i for i in found if i >= args.n_layers)[:3]]
    raise ValueError(f"{source} does not fit the config: {_listed({'missing': list(missing), 'unexpected': unexpected})} "
                     f"(the config says {args.n_layers} layers; the weights hold {len(found)}); {MISFIT}")


def _listed(names: dict) -> str:
    """missing [...], unexpected [...]: the kinds that have names."""
    return ", ".join(f"{kind} {listed}" for kind, listed in names.items() if listed)


def build_model(args: ModelArgs, state: dict, device=None, dtype=None, quantization=None, quantize=None) -> Transformer:
    """A Transformer holding the tensors of state themselves, not copies (load_state_dict's
    assign), on the meta device until then. state is a reader's, checked by check_fits_config, or
    a live model's; quantization (a stored record) builds the quantized layers it holds; quantize
    ("int8" or "int4") quantizes each linear matrix as it is taken from state, so the float model
    is never held (quant.quantize)."""
    model = empty_model(args, quantization)
    dtypes = {tensor.dtype for tensor in state.values() if tensor.is_floating_point()}
    if dtype is None and quantization is None and len(dtypes) > 1:  # one dtype for all, as transformers' torch_dtype gives
        dtype = state["tok_embeddings.weight"].dtype
    if quantize is not None:
        quant.quantize(model, quantize, weights=state, dtype=dtype, device=device)
    model.load_state_dict(state, assign=True, strict=quantize is None)  # quantized: the rest of state, checked by the reader
    # assign=True replaced the shared Parameter; a GGUF file's tied head is its embedding's layer, still one module
    if args.tie_embeddings and not isinstance(model.tok_embeddings, quant.QuantizedEmbedding):
        model.output.weight = model.tok_embeddings.weight
    return model.to(device=device, dtype=dtype).eval()


def empty_model(args: ModelArgs, quantization=None) -> Transformer:
    """The model args describes on the meta device (no memory), with quantized layers where the record says."""
    with torch.device("meta"), _NoDrawsOnMeta():
        model = Transformer(args)
        return model if quantization is None else quant.empty_quantized_model(model, quantization)


class _NoDrawsOnMeta(TorchFunctionMode):
    """Skips the random draws of a model's initial weights on the meta device: they set no value
    there, and torch's first normal_ on a meta tensor imports its Python decompositions, 800-odd
    modules, which cost every load about a second and 70 MB."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in ("normal_", "uniform_"):
            tensor = args[0] if args else kwargs["tensor"]
            if tensor.is_meta:
                return tensor
        return func(*args, **kwargs)
