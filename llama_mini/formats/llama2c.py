"""llama2.c's files, read as they are: the .bin export (versions 0, 1 and 2) and the training .pt.

llama2.c's model.py is Meta's architecture with Meta's parameter names and rotary
convention (adjacent pairs, theta 10000), RMSNorm eps 1e-5, and an output head always tied to
the token embedding. Its files differ only in how they store that model:

- The .bin files of export.py, read by run.c and runq.c. A header of 7 int32
  (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, max_seq_len), then the
  weights as flat arrays, each kind for all layers in turn (all wq, then all wk, ...).
  - v0 (legacy_export): the bare header; a negative vocab_size means the classifier is NOT
    shared (run.c: `shared_weights = vocab_size > 0`). Embedding, per-layer weights, final
    norm, then the RoPE cos and sin tables (max_seq_len x head_dim/2 each, skipped here: we
    compute our own), then the classifier if not shared. All fp32.
  - v1 (version1_export): a 256-byte header: magic "ak42", version, the 7 ints, a shared
    flag byte. Norms first, then the embedding and the matrices, then the classifier if not
    shared. All fp32.
  - v2 (version2_export): v1's header plus the int32 quantization group size. The norms in
    fp32, then each matrix in Q8_0: its int8 values, then one fp32 scale per group
    (value = int8 * scale). Read here as the fp32 weights those values give.
- The training checkpoint ckpt.pt of train.py: {"model": state_dict, "model_args": {...},
  "optimizer": ..., ...}, whose state dict keys may carry torch.compile's "_orig_mod." prefix.

Every size in a .bin header is checked against the file's size before anything is read.
"""

import struct
from pathlib import Path

import torch

from ..model import ModelArgs
from .config_check import check_fields, model_args
from .reading import tensor_dict, torch_load
from .state_dict import check_fits_config

MAGIC = 0x616B3432  # "ak42" as a little-endian uint32
HEADER = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len")
_VERSIONED_HEADER_BYTES = 256
_COMPILE_PREFIX = "_orig_mod."  # torch.compile's wrapper, left in state dicts saved through it


def is_bin(file: Path) -> bool:
    """Whether file starts as a llama2.c .bin: the versioned magic, or a plausible v0 header."""
    with open(file, "rb") as f:
        head = f.read(28)
    if len(head) < 28:
        return False
    if struct.unpack_from("<I", head)[0] == MAGIC:
        return True
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, max_seq_len = struct.unpack("<7i", head)
    sizes_positive = min(dim, hidden_dim, n_layers, n_heads, n_kv_heads, abs(vocab_size), max_seq_len) > 0
    return sizes_positive and dim % n_heads == 0 and n_heads % n_kv_heads == 0


def bin_args(file: Path) -> ModelArgs:
    """The ModelArgs of a llama2.c .bin, from its header alone."""
    _, header, shared, _, _ = _read_header(file)
    return model_args({**header, "tie_embeddings": shared}, file)


def read_bin(file: Path):
    """(ModelArgs, state dict) of a llama2.c .bin, checked. fp32 weights stay memory-mapped."""
    version, _, shared, group_size, offset = _read_header(file)
    args = bin_args(file)
    layout = _layout(args, version, shared)
    # v2 (group_size given) stores each matrix as int8 values and then one fp32 scale per group.
    if group_size and any(_numel(shape) % group_size for _, shape, _ in layout if len(shape) == 2):
        raise ValueError(f"{file}: group size {group_size} does not divide every weight matrix; the file is corrupt")
    expected = offset + sum(count * _nbytes(shape, group_size) for _, shape, count in layout)
    size = file.stat().st_size
    if size != expected:  # checked before any array is read or any name is listed
        raise ValueError(
            f"{file} is {size} bytes but its llama2.c v{version} header implies {expected}; "
            "the file is truncated or corrupt, download or export it again"
        )
    data = torch.from_file(str(file), shared=False, size=size, dtype=torch.uint8)  # mapped, read when used
    state, pos = {}, offset
    for template, shape, count in layout:
        for i in range(count):
            if template is not None:
                state[template.format(i)] = _array(data, pos, shape, group_size)
            pos += _nbytes(shape, group_size)
    check_fits_config(args, state, file)
    if shared:
        state["output.weight"] = state["tok_embeddings.weight"]
    return args, state


def _read_header(file: Path):
    """(version, the 7 header ints by name, shared classifier, v2's group size or None, weights offset)."""
    with open(file, "rb") as f:
        head = f.read(_VERSIONED_HEADER_BYTES)
    if len(head) < 4 * len(HEADER):
        raise ValueError(f"{file} is truncated: shorter than a llama2.c header")
    if struct.unpack_from("<I", head)[0] != MAGIC:  # v0: the sign of vocab_size is the flag
        header = dict(zip(HEADER, struct.unpack_from("<7i", head)))
        shared = header["vocab_size"] > 0
        header["vocab_size"] = abs(header["vocab_size"])
        return 0, header, shared, None, 4 * len(HEADER)
    if len(head) < _VERSIONED_HEADER_BYTES:
        raise ValueError(f"{file} is truncated: a llama2.c v1/v2 header is {_VERSIONED_HEADER_BYTES} bytes")
    version = struct.unpack_from("<i", head, 4)[0]
    if version not in (1, 2):
        raise ValueError(f"{file} is a llama2.c .bin of version {version}; llama_mini reads versions 0, 1 and 2")
    header = dict(zip(HEADER, struct.unpack_from("<7i", head, 8)))
    shared = head[36]
    if shared not in (0, 1):
        raise ValueError(f"{file}: its shared-classifier flag is {shared}, not 0 or 1; the file is corrupt")
    group_size = struct.unpack_from("<i", head, 37)[0] if version == 2 else None
    if version == 2:
        check_fields({"group_size": group_size}, {"group_size": int}, file)
    return version, header, bool(shared), group_size, _VERSIONED_HEADER_BYTES


def _layout(args, version: int, shared: bool) -> list:
    """The file's arrays in order, as (name, shape, count): count arrays named name.format(i)
    for i in range(count), one per layer; name None: an array skipped (v0's RoPE tables)."""
    d, hd, kv, L = args.dim, args.head_dim, args.n_kv_heads * args.head_dim, args.n_layers
    q = args.n_heads * hd
    attention_norms = [("layers.{}.attention_norm.weight", (d,), L)]
    ffn_norms = [("layers.{}.ffn_norm.weight", (d,), L)]
    final_norm = [("norm.weight", (d,), 1)]
    embedding = [("tok_embeddings.weight", (args.vocab_size, d), 1)]
    attention = [("layers.{}.attention.wq.weight", (q, d), L), ("layers.{}.attention.wk.weight", (kv, d), L),
                 ("layers.{}.attention.wv.weight", (kv, d), L), ("layers.{}.attention.wo.weight", (d, q), L)]
    ffn = [("layers.{}.feed_forward.w1.weight", (args.ffn_dim, d), L), ("layers.{}.feed_forward.w2.weight", (d, args.ffn_dim), L),
           ("layers.{}.feed_forward.w3.weight", (args.ffn_dim, d), L)]
    classifier = [] if shared else [("output.weight", (args.vocab_size, d), 1)]
    if version == 0:
        rope_tables = [(None, (args.max_seq_len, hd // 2), 2)]  # cos and sin; we compute our own
        return [*embedding, *attention_norms, *attention, *ffn_norms, *ffn, *final_norm, *rope_tables, *classifier]
    return [*attention_norms, *ffn_norms, *final_norm, *embedding, *attention, *ffn, *classifier]


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _nbytes(shape, group_size) -> int:
    """Bytes of one array: fp32, or (group_size given, a matrix) int8 values plus fp32 scales."""
    n = _numel(shape)
    return n + 4 * (n // group_size) if group_size and len(shape) == 2 else 4 * n


def _array(data, start: int, shape, group_size):
    """The array at byte offset start: a view of the mapped file, or a Q8_0 matrix dequantized."""
    if not (group_size and len(shape) == 2):
        return _fp32(data, start, 4 * _numel(shape)).view(shape)
    n = _numel(shape)
    values = data[start : start + n].view(torch.int8).view(-1, group_size)
    scales = _fp32(data, start + n, 4 * (n // group_size))
    return (values.float() * scales[:, None]).view(shape)


def _fp32(data, start: int, nbytes: int):
    """float32 values at a byte offset; copied where the offset is not 4-aligned (v2's scales)."""
    chunk = data[start : start + nbytes]
    return chunk.view(torch.float32) if start % 4 == 0 else chunk.clone().view(torch.float32)


def read_pt(file: Path):
    """(ModelArgs, state dict) of llama2.c's training checkpoint ckpt.pt, checked."""
    checkpoint = torch_load(file)
    if not isinstance(checkpoint, dict) or not {"model", "model_args"} <= checkpoint.keys():
        raise ValueError(
            f"{file} is a PyTorch file but not llama2.c's training checkpoint (a dict with model_args and model); "
            "for Meta's consolidated.NN.pth or a pytorch_model.bin, pass the folder that holds it"
        )
    fields = checkpoint["model_args"]
    if not isinstance(fields, dict):
        raise ValueError(f"{file}: model_args is a {type(fields).__name__}, not a dict of model settings")
    fields = {k: v for k, v in fields.items() if k != "dropout"}  # a training setting, not the model's
    state = tensor_dict(checkpoint["model"], file)
    state = {k.removeprefix(_COMPILE_PREFIX): v for k, v in state.items()}
    args = model_args(fields, file)
    check_fits_config(args, state, file)
    return args, state
