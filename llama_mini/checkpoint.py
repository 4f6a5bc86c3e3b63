"""Checkpoints: formats in, formats out.

Our own (native) checkpoint is a folder with config.json (the ModelArgs), model.safetensors
and, when known, the tokenizer.model it was trained with. A training run folder holds one
such folder per saved step and a `latest` file naming the newest complete one.
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .model import ModelArgs, Transformer

CONFIG, WEIGHTS, TOKENIZER, LATEST = "config.json", "model.safetensors", "tokenizer.model", "latest"


def atomic_write(path, write) -> None:
    """Call write(tmp_path), then move tmp_path onto path in one step.

    os.replace is atomic on POSIX, so a crash (or a full disk) at any moment leaves either
    the old file or the new one, never a torn mix.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(model: Transformer, path, format: str = "native", tokenizer_path=None) -> Path:
    """Write model to the folder path in the given format; returns the folder."""
    if format != "native":
        raise ValueError(f"unknown checkpoint format {format!r}; use native")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        del state["output.weight"]  # the same tensor as tok_embeddings.weight; stored once
    atomic_write(path / WEIGHTS, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    config = {"llama_mini": dataclasses.asdict(model.args)}
    atomic_write(path / CONFIG, lambda tmp: tmp.write_text(json.dumps(config, indent=2)))
    if tokenizer_path is not None and Path(tokenizer_path).resolve() != (path / TOKENIZER).resolve():
        atomic_write(path / TOKENIZER, lambda tmp: shutil.copyfile(tokenizer_path, tmp))
    return path


def resolve_run_folder(path) -> Path:
    """A training run folder -> its newest complete checkpoint; any other folder -> itself."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if (path / LATEST).is_file():
        return path / (path / LATEST).read_text().strip()
    return path


def load_checkpoint(path, device=None, dtype=None) -> Transformer:
    """Load a checkpoint folder. dtype=None keeps the stored dtype.

    The model is built on the meta device (no memory, no random init), and the weights,
    read lazily from disk, are assigned in place: peak memory is one copy of the weights.
    """
    path = resolve_run_folder(path)
    config_file = path / CONFIG
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} holds no {CONFIG}; not a llama_mini checkpoint")
    config = json.loads(config_file.read_text())
    args = ModelArgs(**config["llama_mini"])
    try:
        state = load_file(path / WEIGHTS, device=str(device or "cpu"))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path / WEIGHTS} is truncated or corrupt ({e})") from None
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return build_model(args, state, device=device, dtype=dtype)


def build_model(args: ModelArgs, state: dict, device=None, dtype=None) -> Transformer:
    """A Transformer holding exactly the tensors of state, checked by name and shape."""
    with torch.device("meta"):
        model = Transformer(args)
    expected = model.state_dict()
    missing = expected.keys() - state.keys()
    unexpected = state.keys() - expected.keys()
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the config: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)} but the config implies {tuple(expected[name].shape)}")
    model.load_state_dict(state, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # assign=True replaced the shared Parameter
    return model.to(device=device, dtype=dtype).eval()
