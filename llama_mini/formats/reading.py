"""The files a checkpoint is made of, read trusting nothing in them (files.atomic_write writes them).

Every reader bounds what it reads before it believes a size written in the file, and turns a
damaged, foreign or hostile file into one ValueError or OSError that names the file:
- JSON (config.json, params.json, index files) is read only up to a size no config reaches.
- safetensors files are memory-mapped; the library refuses a header longer than its limit,
  and each tensor's dtype is checked before its data is touched.
- PyTorch files (.pth, .bin, .pt) are unpickled with weights_only=True, so a file carrying
  code is refused unrun, and memory-mapped where their layout allows it (see torch_load).
- Names written inside our files (an index's file names, a run's `latest`) are taken only
  when they stay inside the folder the user named.
"""

import json
import os
import pickle
import zipfile
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError, safe_open

from ..support.files import brief, first_line

# The dtypes a model can compute in; integer or 8-bit float tensors are not Llama weights.
FLOAT_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_SAFETENSORS_FLOATS = {"F16", "BF16", "F32", "F64"}
_SAFETENSORS_CODES = {"I8", "U8"}  # a quantized checkpoint's integer weights (llama_mini/quant/)
# A Llama config or shard index is a few kB (the index of a 405B model about 100 kB).
MAX_JSON_BYTES = 16 * 2**20
# torch.save's legacy (pre-1.6, non-zip) format starts with a pickled magic number.
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
_ZIP_MAGIC = b"PK\x03\x04"



def is_torch_file(file: Path) -> bool:
    """Whether file starts as torch.save writes: a zip archive, or the legacy pickle format."""
    with open(file, "rb") as f:
        head = f.read(len(_LEGACY_TORCH_MAGIC))
    return head.startswith(_ZIP_MAGIC) or head == _LEGACY_TORCH_MAGIC


def read_json(file: Path) -> dict:
    """A JSON object from file, read only if the file is small enough to be a config."""
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found")
    size = file.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{file} is {size} bytes, too large for a config or index file (at most {MAX_JSON_BYTES})")
    try:
        value = json.loads(file.read_bytes())
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, huge integers, deep nesting
        raise ValueError(f"{file} is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} holds a JSON {type(value).__name__}, not an object of named fields")
    return value


def inside(folder: Path, name, source: Path) -> Path:
    """folder / name, for a name read from the file `source`, refused where it would leave folder.

    Only the name is judged, never where it resolves: a symlink the user put in the folder
    is theirs to make, but a name like `../x` or `/etc/passwd` inside our files is not.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{source} names {brief(name)} where a file name belongs; download or convert it again")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name or "\0" in name:
        raise ValueError(f"{source} names {brief(name, limit=300)}, which is outside {folder}; refusing to read it")
    return folder / name


def read_safetensors(file: Path, quantized: bool = False) -> dict:
    """All tensors of a safetensors file, memory-mapped (read from disk when first used).
    Weights are floats, or also int8/uint8 codes where the config says the model is quantized."""
    allowed = _SAFETENSORS_FLOATS | (_SAFETENSORS_CODES if quantized else set())
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found")
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                dtype = f.get_slice(key).get_dtype()
                if dtype not in allowed:
                    raise ValueError(f"{file} stores tensor {key} as {dtype}; Llama weights are F16, BF16, F32 or F64")
            return {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file} is truncated or corrupt ({first_line(e)}); download or convert it again") from None


def torch_load(file: Path):
    """What torch.save wrote to file, with tensors memory-mapped where the layout allows.

    weights_only=True unpickles tensors and plain containers only, so a file carrying code
    (a pickle __reduce__ payload) is refused unrun. Memory-mapping needs the tensors stored
    as they are in memory: a zip whose entries are compressed (legal: any zip tool can
    rewrite one with deflate) or the legacy non-zip format is read into memory instead,
    never mapped, since mapping compressed bytes would read them as weights.
    """
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found")
    if not is_torch_file(file):
        raise ValueError(f"{file} is truncated or corrupt (not a file torch.save writes); download or convert it again")
    mmap = zipfile.is_zipfile(file) and _stored_uncompressed(file)
    try:
        return torch.load(file, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{file} holds pickled objects other than tensors (possibly code); refusing to load it") from None
    except Exception as e:  # torch raises RuntimeError, EOFError, ValueError ... for torn or foreign files
        raise ValueError(f"{file} is truncated or corrupt ({first_line(e)}); download or convert it again") from None


def _stored_uncompressed(file: Path) -> bool:
    """Whether every entry of the zip is stored as is; for a compressed one, also check that
    its unpacked size fits in this machine's memory before anything is unpacked."""
    try:
        with zipfile.ZipFile(file) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise ValueError(f"{file} is truncated or corrupt ({first_line(e)}); download or convert it again") from None
    if all(entry.compress_type == zipfile.ZIP_STORED for entry in entries):
        return True
    unpacked = sum(entry.file_size for entry in entries)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if unpacked > memory:
        raise ValueError(
            f"{file} is compressed and would unpack to {unpacked / 2**30:.1f} GiB, more than this machine's "
            f"memory; save it again with torch.save, which stores tensors uncompressed"
        )
    return False


def tensor_dict(value, file: Path) -> dict:
    """value, checked to be a state dict: tensor names to floating-point tensors."""
    if not isinstance(value, dict):
        raise ValueError(f"{file} holds a {type(value).__name__}, not a state dict of named tensors")
    for key, tensor in value.items():
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{file} holds {type(tensor).__name__} {brief(key)} where a state dict holds named tensors")
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{file} stores tensor {key} as {tensor.dtype}; Llama weights are float16, bfloat16, float32 or float64")
    return value
