"""Our own checkpoint: a folder of config.json (the format record, {"llama_mini": ModelArgs
fields}, and a "quantization" record for int8/int4 weights), model.safetensors and, when
known, the tokenizer.model it was trained with. A training run folder holds one per saved
step, named step-N, and a `latest` file naming the newest complete one.
"""

import dataclasses
import json
import re
from pathlib import Path
from typing import Optional

from safetensors.torch import save_file

from ..support.files import atomic_write
from ..quant import read_quantization
from .config_check import model_args
from .hf import CONFIG, WEIGHTS
from .reading import read_json, read_safetensors
from .record import check_config, format_record, format_version, offsets_from_zeros
from .state_dict import check_fits_config

TOKENIZER, LATEST = "tokenizer.model", "latest"
CHECKPOINT_NAME = re.compile(r"step-([0-9]+)")


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(name: str) -> int:
    """The step number of a checkpoint name: step-1000000 comes after step-999998."""
    return int(CHECKPOINT_NAME.fullmatch(name)[1])


def read_latest(run_folder: Path) -> Optional[Path]:
    """The checkpoint a run folder's `latest` names, or None where there is no `latest`. Only one
    of the folder's own step-N folders is taken: the name is read from a file, and a name that
    leaves the folder is refused."""
    pointer = run_folder / LATEST
    if not pointer.is_file():
        return None
    with open(pointer, "rb") as f:
        name = f.read(256).decode(errors="replace").strip()  # a checkpoint's name is short
    if not CHECKPOINT_NAME.fullmatch(name):
        raise ValueError(f"{pointer} names {name[:80]!r}, not a step-N checkpoint of this run")
    if not (run_folder / name).is_dir():
        raise ValueError(f"{pointer} names {name}, which is missing from {run_folder}; pass one of its step folders instead")
    return run_folder / name


def is_native(path: Path) -> bool:
    return (path / CONFIG).is_file() and "llama_mini" in read_json(path / CONFIG)


def native_args(path: Path):
    """(ModelArgs, quantization record or None) of our checkpoint folder, from its config alone."""
    fields = read_json(path / CONFIG)
    check_config(fields, path / CONFIG)  # an older layout is refused before any of it is read
    config = fields["llama_mini"]
    if not isinstance(config, dict):
        raise ValueError(f"{path / CONFIG}: its llama_mini field is not an object of ModelArgs fields")
    quantization = read_quantization(fields["quantization"], path / CONFIG) if "quantization" in fields else None
    return model_args(config, path / CONFIG), quantization


def read_native(path: Path):
    """(ModelArgs, state dict, quantization record or None) of our checkpoint folder, checked."""
    args, quantization = native_args(path)
    state = read_safetensors(path / WEIGHTS, quantized=quantization is not None)
    if quantization and quantization["method"] == "int4" and format_version(read_json(path / CONFIG), path) == 2:
        state = offsets_from_zeros(state)
    check_fits_config(args, state, path, quantization=quantization)
    if args.tie_embeddings:  # the head is the embedding's table (its layer's tensors, where a GGUF file's)
        table = "tok_embeddings.table." if any(name.startswith("tok_embeddings.table.") for name in state) else "tok_embeddings."
        state.update({"output." + name.removeprefix(table): tensor for name, tensor in state.items() if name.startswith(table)})
    return args, state, quantization


def write_native(model, path: Path) -> None:
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:  # the same tensors as the embedding's; stored once
        state = {name: tensor for name, tensor in state.items() if not name.startswith("output.")}
    atomic_write(path / WEIGHTS, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    config = {**format_record(), "llama_mini": dataclasses.asdict(model.args)}
    if getattr(model, "quantization", None):
        config["quantization"] = model.quantization
    atomic_write(path / CONFIG, lambda tmp: tmp.write_text(json.dumps(config, indent=2)))
