"""The format record: the layout of llama_mini's own files, and what this version does with each.

A native checkpoint's config.json and a training run's run.json record the format they were
written in and the llama_mini that wrote them:

    "format_version": 2, "llama_mini_version": "0.1.0"

config.json's record speaks for its checkpoint folder (model.safetensors, and a run's
train_state.pt), run.json's for its run folder; FORMAT_VERSION changes with the layout of any
of these files. What an older layout gets is decided here, from the record alone: tensors are
never inspected to guess which layout they are in.

- Format 1, no record: written by a llama_mini older than 0.1.0.
  Read: full-precision checkpoints, and run folders that have a run.json. Their layout is
  today's.
  Refused: quantized checkpoints (several int8 and int4 layouts were written under one
  quantization record, so the file cannot say which it holds: quantize again from the
  source); a config.json naming norm_impl (which RMSNorm code ran; delete the field); a
  run folder without run.json (start a new run from its newest checkpoint).
- Format 2, from 0.1.0 to 0.2.0: read. Its int4 layers store `zeros`, the value code 8 stands
  for; they are read as today's `offsets`, the value code 0 stands for (zero - 8 scale, computed
  in float32 and rounded to the scales' dtype once).
- Format 3, from 0.3.0: read. Its quantization record may instead name each matrix's layer, as a
  GGUF file's blocks are held (quant/held.py). A record naming an "int6" or "int5" layer (Q6_K or
  Q5_K converted, before they were held as the file's blocks) is refused: convert the GGUF file again.
- A newer format: refused (upgrade llama_mini).
"""

import re
from pathlib import Path
from typing import Optional

from .. import __version__
from ..support.files import brief
from ..quant import QUANTIZATIONS

FORMAT_VERSION = 3
FIRST_RECORDED = "0.1.0"  # the first llama_mini to write the record: files without one are older
_VERSION = re.compile(r"[0-9][0-9A-Za-z.+-]{0,39}")  # a version as a message shows it plainly


def format_record() -> dict:
    """The fields that say which layout a file is in, written at the top of config.json and run.json."""
    return {"format_version": FORMAT_VERSION, "llama_mini_version": __version__}


def format_version(fields: dict, source) -> int:
    """The format a config.json or run.json (its fields) was written in: 1 where it has no
    record. A newer format, or a record that is not a format number, is refused."""
    if "format_version" not in fields:
        return 1
    version = fields["format_version"]
    if type(version) is not int or version < 1:
        raise ValueError(f"{source}: format_version is {brief(version)}, not a format llama_mini writes (a whole number "
                         "from 1); the file is damaged: write it again with llama_mini")
    if version > FORMAT_VERSION:
        writer = fields.get("llama_mini_version")
        writer = writer if isinstance(writer, str) and _VERSION.fullmatch(writer) else brief(writer)
        raise ValueError(f"{source} was written by llama_mini {writer} in format {version}; this is llama_mini "
                         f"{__version__}, which reads formats up to {FORMAT_VERSION}: upgrade llama_mini")
    return version


def check_config(fields: dict, source) -> None:
    """Refuse a native config.json (its fields) whose layout this version does not read."""
    if format_version(fields, source) > 1:
        return
    if "quantization" in fields:
        record = fields["quantization"]
        method = record["method"] if isinstance(record, dict) and record.get("method") in QUANTIZATIONS else "int8 (or int4)"
        raise _older(source, "and holds quantized weights in a layout it does not name", "quantize again from the "
                     f"full-precision checkpoint: python -m llama_mini.formats.convert SOURCE NEW_FOLDER --to native --quantize {method}")
    config = fields.get("llama_mini")
    if isinstance(config, dict) and "norm_impl" in config:
        raise _older(source, "and names norm_impl, which said which RMSNorm code ran and is no longer stored",
                     "delete that field from it (the weights need no change)")


def offsets_from_zeros(state: dict) -> dict:
    """A format-2 int4 checkpoint's state dict with each layer's zeros turned into offsets."""
    for name in [name for name in state if name.endswith(".zeros")]:
        layer = name[: -len("zeros")]
        zeros, scales = state.pop(name), state[layer + "scales"]
        state[layer + "offsets"] = (zeros.float() - 8 * scales.float()).to(scales.dtype)
    return state


def check_run_record(fields: Optional[dict], file: Path, latest: Path) -> None:
    """Refuse a run folder whose layout this version does not resume: fields are those of its
    run.json, file, None where it has none; latest is its newest checkpoint."""
    if fields is None:
        raise _older(file.parent, f"and has no {file.name}, the list of the checkpoints a run may prune",
                     f"go on from its newest checkpoint in a new run: --init-from {latest} --out NEW_FOLDER")
    format_version(fields, file)


def _older(source, what: str, fix: str) -> ValueError:
    return ValueError(f"{source} was written by a llama_mini older than {FIRST_RECORDED} (it has no format record) {what}; {fix}")
