"""Meta's layout: params.json + consolidated.NN.pth, one file per model-parallel rank.

Meta's parameter names are ours. Its 13B ships as 2 files and its 70B as 8, each holding every
rank's slice of each matrix (names.meta_split_dim says along which dimension): loading merges
them into one state dict, and writing with shards > 1 splits one the same way.
"""

import json
from pathlib import Path

import torch

from ..model import ModelArgs, ffn_hidden_dim
from .config_check import model_args
from ..support.files import atomic_write, torch_save
from .reading import read_json, tensor_dict, torch_load
from .names import meta_split_dim
from .state_dict import check_fits_config

META_PARAMS = "params.json"


def is_meta(path: Path) -> bool:
    return (path / META_PARAMS).is_file()


def meta_args(path: Path, tokenizer_vocab_size) -> ModelArgs:
    """The ModelArgs of Meta's folder, from params.json alone. tokenizer_vocab_size() gives the
    vocabulary size where params.json says -1 (Llama-2's does: the tokenizer decides)."""
    params = read_json(path / META_PARAMS)
    if params.get("vocab_size", -1) == -1:
        params["vocab_size"] = tokenizer_vocab_size()
    args = model_args(params, path / META_PARAMS)
    if args.use_scaled_rope and "rope_scaling_factor" not in params:  # Llama-3.x's files state no factor
        args.rope_scaling_factor = meta_rope_scaling_factor(params)
    return args


def read_meta(path: Path, tokenizer_vocab_size):
    """(ModelArgs, state dict) of Meta's folder, checked (tokenizer_vocab_size: see meta_args)."""
    args = meta_args(path, tokenizer_vocab_size)
    files = sorted(path.glob("consolidated.*.pth"))
    if not files or [f.name for f in files] != [f"consolidated.{i:02d}.pth" for i in range(len(files))]:
        names = ", ".join(f.name for f in files) or "none"
        raise FileNotFoundError(f"{path} needs consolidated.00.pth, consolidated.01.pth, ... (one per model-parallel rank); found {names}")
    state = merge_meta_shards([tensor_dict(torch_load(f), f) for f in files])
    check_fits_config(args, state, path)
    return args, state


# Meta's params.json for Llama-3.x says only "use_scaled_rope": its reference code
# (meta-llama/llama-models, models/llama3/model.py, apply_scaling) hard-codes a factor of 8.
# Llama-3.2 1B and 3B were trained with 32, as their Hugging Face config.json states and
# Meta's maintainers confirmed (llama-models issues #166 and #241), so those two models, known
# by the shapes in llama-models' models/sku_list.py, get 32. Llama-4's params.json names the
# factor rope_scaling_factor (models/llama4/args.py); meta_params writes it under that name.
LLAMA32_SMALL_SHAPES = {(2048, 16, 32, 8), (3072, 28, 24, 8)}  # (dim, n_layers, n_heads, n_kv_heads)


def meta_rope_scaling_factor(params: dict) -> float:
    shape = tuple(params.get(k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads"))
    return 32.0 if shape in LLAMA32_SMALL_SHAPES else 8.0


def write_meta(model, path: Path, shards: int) -> None:
    atomic_write(path / META_PARAMS, lambda tmp: tmp.write_text(json.dumps(meta_params(model.args), indent=2)))
    # A tied output head is stored twice: Meta's format has no tying.
    for rank, shard in enumerate(split_meta_shards(model.state_dict(), shards)):
        atomic_write(path / f"consolidated.{rank:02d}.pth", lambda tmp: torch_save(shard, tmp))


def meta_params(args: ModelArgs) -> dict:
    """ModelArgs -> Meta's params.json: only fields Meta's own ModelArgs knows, and the RoPE
    scaling parameters, which Meta's Llama-3 code ignores (see meta_rope_scaling_factor).

    A SwiGLU size stated outright (hidden_dim, from an HF config) that Meta's rule does not
    give from multiple_of is written as multiple_of = that size: the rule then rounds
    int(8 * dim / 3), scaled below it by ffn_dim_multiplier where needed, up to exactly it.
    """
    params = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
              "vocab_size": args.vocab_size, "multiple_of": args.multiple_of, "norm_eps": args.norm_eps}
    multiplier = args.ffn_dim_multiplier
    if ffn_hidden_dim(args.dim, args.multiple_of, multiplier) != args.ffn_dim:
        base = ffn_hidden_dim(args.dim, multiple_of=1)  # Meta's rule before scaling and rounding
        params["multiple_of"] = args.ffn_dim
        multiplier = args.ffn_dim / base if base > args.ffn_dim else None
    if multiplier is not None:
        params["ffn_dim_multiplier"] = multiplier
    if args.rope_theta != 10000.0:
        params["rope_theta"] = args.rope_theta
    if args.use_scaled_rope:
        params.update(use_scaled_rope=True, rope_scaling_factor=args.rope_scaling_factor,
                      rope_low_freq_factor=args.rope_low_freq_factor, rope_high_freq_factor=args.rope_high_freq_factor,
                      rope_original_max_seq_len=args.rope_original_max_seq_len)
    return params


def merge_meta_shards(shards: list[dict]) -> dict:
    """Meta's model-parallel shards -> one state dict; rope.freqs is dropped (we recompute it).

    A single shard is returned as it is, so its memory-mapped tensors are never copied.
    """
    for rank, shard in enumerate(shards[1:], start=1):
        if shard.keys() != shards[0].keys():
            extra = sorted(shard.keys() ^ shards[0].keys())[:3]
            raise ValueError(f"model-parallel shards 00 and {rank:02d} hold different tensors ({extra}); download them again")
    merged = {}
    for key, first in shards[0].items():
        if key == "rope.freqs":
            continue
        parts = [shard[key] for shard in shards]
        if len(shards) > 1 and any(p.shape != first.shape for p in parts):
            shapes = ", ".join(str(tuple(p.shape)) for p in parts)
            raise ValueError(f"tensor {key} has different shapes in the model-parallel shards ({shapes}); download them again")
        if len(shards) == 1 or first.dim() == 1:
            merged[key] = first
        elif first.dim() == 2:
            merged[key] = torch.cat(parts, dim=_split_dim(key))
        else:
            raise ValueError(f"tensor {key} has {first.dim()} dimensions; a Meta Llama checkpoint holds matrices and vectors")
    return merged


def split_meta_shards(state: dict, n: int) -> list[dict]:
    """Inverse of merge_meta_shards: the state dict of each of n model-parallel ranks."""
    return [
        {key: (t if t.dim() == 1 else t.chunk(n, dim=_split_dim(key))[rank]).clone() for key, t in state.items()}
        for rank in range(n)
    ]


def _split_dim(key: str) -> int:
    try:
        return meta_split_dim(key)
    except KeyError:
        raise ValueError(f"tensor {key} is not part of a Meta Llama checkpoint") from None
