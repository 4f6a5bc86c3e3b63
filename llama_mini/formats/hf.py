"""Hugging Face's Llama layout: a LlamaForCausalLM folder, config.json + model*.safetensors (one
file, or shards listed in model.safetensors.index.json) or pytorch_model*.bin.

What differs from Meta's layout (ours) lives here, each fact once with its inverse beside it:
the q/k row permutation and the config.json fields. The parameter names are names.py's.
"""

import dataclasses
import json
import typing
from pathlib import Path
from typing import Optional

from safetensors.torch import save_file

from ..model import ModelArgs
from ..support.files import atomic_write, brief
from .config_check import check_fields
from .reading import inside, read_json, read_safetensors, tensor_dict, torch_load
from .names import from_format, to_format
from .state_dict import check_fits_config

CONFIG, WEIGHTS = "config.json", "model.safetensors"  # our own folders use these names too (native.py)
INDEX = WEIGHTS + ".index.json"
# Hugging Face folders are written in safetensors files of at most this size: save_pretrained's
# default before transformers 5, and well under the Hub's 50 GB limit per file (a 70B model
# in bf16 is 138 GB).
MAX_SHARD_BYTES = 5 * 10**9


def permute_to_hf(w, n_heads: int):
    """Meta's rotary pairs are adjacent rows (0,1), (2,3), ... of each head; HF's
    rotate_half pairs row i with row i + head_dim/2. HF's converter therefore reorders
    the rows of wq and wk so that the same rotation lands on the same numbers."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w, n_heads: int):
    """Inverse of permute_to_hf."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _qk_permuted(key: str, w, args: ModelArgs, permute):
    """w with its rows put through permute (permute_to_hf or permute_from_hf) where key names
    a wq (n_heads heads) or a wk (n_kv_heads); any other tensor as it is."""
    if key.endswith("attention.wq.weight"):
        return permute(w, args.n_heads)
    if key.endswith("attention.wk.weight"):
        return permute(w, args.n_kv_heads)
    return w


def to_hf_state_dict(state_dict: dict, args: ModelArgs) -> dict:
    """Our state dict -> transformers' LlamaForCausalLM state dict (q/k rows permuted)."""
    tied_head = {"output.weight"} if args.tie_embeddings else set()  # HF stores a tied head once, as the embedding
    return {to_format(key, "hf"): _qk_permuted(key, w, args, permute_to_hf) for key, w in state_dict.items()
            if key not in tied_head}


def from_hf_state_dict(state_dict: dict, args: ModelArgs) -> dict:
    """transformers' LlamaForCausalLM state dict -> ours (q/k rows restored to Meta's order)."""
    return _from_hf_rows(_from_hf_names(state_dict), args)


def _from_hf_names(state_dict: dict) -> dict:
    """The same tensors under our names; KeyError for a name that is not a Llama parameter."""
    # Old transformers saved rotary_emb.inv_freq; we recompute it.
    return {from_format(key, "hf"): w for key, w in state_dict.items() if not key.endswith("rotary_emb.inv_freq")}


def _from_hf_rows(state: dict, args: ModelArgs) -> dict:
    """A state dict in our names with HF's q/k rows put back in Meta's order, and a tied head."""
    out = {key: _qk_permuted(key, w, args, permute_from_hf) for key, w in state.items()}
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# --- Reading and writing a folder ----------------------------------------------------------


def hf_args(path: Path) -> ModelArgs:
    """The ModelArgs of a Hugging Face Llama folder, from its config.json alone."""
    config = read_json(path / CONFIG)
    if config.get("model_type") != "llama":
        raise ValueError(f"{path / CONFIG} describes a {brief(config.get('model_type'))} model; only Llama (model_type 'llama') is supported")
    check_fields(config, CONFIG_TYPES, path / CONFIG)
    try:
        args = args_from_hf_config(config, source=path / CONFIG)
    except KeyError as e:
        raise ValueError(f"{path / CONFIG} lacks the field {e}") from None
    check_fields(dataclasses.asdict(args), typing.get_type_hints(ModelArgs), path / CONFIG)
    return args


def read_hf(path: Path):
    """(ModelArgs, state dict in our names) of a Hugging Face Llama folder."""
    args = hf_args(path)
    state = {}
    for file in _weight_files(path):
        state.update(read_safetensors(file) if file.suffix == ".safetensors" else tensor_dict(torch_load(file), file))
    try:
        state = _from_hf_names(state)
    except KeyError as e:
        raise ValueError(f"{path} holds tensor {e}, which is not part of a Llama model") from None
    check_fits_config(args, state, path, layout="hf")  # before the q/k rows are permuted, which needs their shapes
    return args, _from_hf_rows(state, args)


def _weight_files(path: Path) -> list[Path]:
    """The weight files of a Hugging Face folder: safetensors before .bin, an index first."""
    for single, index in ((WEIGHTS, INDEX), ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (path / index).is_file():
            weight_map = read_json(path / index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(
                    f"{path / index} has no weight_map naming the weight files (an object of tensor name: "
                    f"file name); download it again, or remove it if {path / single} holds all the weights"
                )
            return sorted({inside(path, name, path / index) for name in weight_map.values()})
        if (path / single).is_file():
            return [path / single]
    raise FileNotFoundError(f"{path} has a config.json but no {WEIGHTS}, sharded safetensors index or pytorch_model.bin")


def write_hf(model, path: Path, max_shard_bytes: int) -> None:
    state = {k: v.contiguous() for k, v in to_hf_state_dict(model.state_dict(), model.args).items()}
    files = shard_by_size(state, max_shard_bytes)
    names = [WEIGHTS] if len(files) == 1 else [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    for name, keys in zip(names, files):
        shard = {k: state[k] for k in keys}
        atomic_write(path / name, lambda tmp: save_file(shard, tmp, metadata={"format": "pt"}))
    if len(files) > 1:
        total = sum(v.numel() * v.element_size() for v in state.values())
        weight_map = {k: name for name, keys in zip(names, files) for k in keys}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write(path / INDEX, lambda tmp: tmp.write_text(json.dumps(index, indent=2)))
    else:
        (path / INDEX).unlink(missing_ok=True)  # a stale index would be read before the file
    for stale in set(path.glob("model*.safetensors")) - {path / name for name in names}:
        stale.unlink()  # left by an earlier write with another split
    config = hf_config_from_args(model.args)
    config["torch_dtype"] = str(model.output.weight.dtype).removeprefix("torch.")
    atomic_write(path / CONFIG, lambda tmp: tmp.write_text(json.dumps(config, indent=2)))


def shard_by_size(state: dict, max_bytes: int) -> list[list[str]]:
    """Tensor names grouped, in order, into files of at most max_bytes (a larger tensor gets
    a file of its own)."""
    files, size = [[]], 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


# The config.json fields args_from_hf_config reads, and their types (Optional: null means the
# default), for checking before any arithmetic on them.
CONFIG_TYPES = {
    "hidden_size": int, "intermediate_size": int, "num_hidden_layers": int, "num_attention_heads": int,
    "num_key_value_heads": Optional[int], "head_dim": Optional[int], "vocab_size": int, "max_position_embeddings": int,
    "rms_norm_eps": float, "rope_theta": float, "tie_word_embeddings": Optional[bool],
}


# HF's llama3 rope_scaling keys -> our ModelArgs fields.
_LLAMA3_ROPE_KEYS = {
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_seq_len",
}


def rope_args_from_hf_config(config: dict, source="config.json") -> dict:
    """The RoPE fields of ModelArgs from config.json: rope_parameters (transformers >= 5) or
    rope_scaling and rope_theta (earlier versions).

    A rope_type we do not implement (yarn, dynamic, longrope, linear, ...) is refused: loaded
    with plain RoPE, such a model would run and be wrong.
    """
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{source}: rope_scaling (rope_parameters) must be a JSON object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    fields = {"rope_theta": rope.get("rope_theta", config.get("rope_theta", 10000.0))}
    if rope_type == "default":
        return fields
    if rope_type != "llama3":
        raise ValueError(f"{source} asks for rope_type {rope_type!r}, which llama_mini does not implement (it has default and llama3)")
    missing = [key for key in _LLAMA3_ROPE_KEYS if rope.get(key) is None]
    if missing:
        raise ValueError(f"{source}: rope_type 'llama3' lacks {', '.join(missing)}; the model's published config.json states them")
    return {**fields, "use_scaled_rope": True, **{ours: rope[key] for key, ours in _LLAMA3_ROPE_KEYS.items()}}


def args_from_hf_config(config: dict, source="config.json") -> ModelArgs:
    """config.json of a Llama model -> ModelArgs. source names the file in error messages."""
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or dim // n_heads
    if head_dim != dim // n_heads:
        raise ValueError(f"{source}: head_dim {head_dim} != hidden_size / num_attention_heads; not a Llama layout")
    rope = rope_args_from_hf_config(config, source)
    try:
        return ModelArgs(
            dim=dim,
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            vocab_size=config["vocab_size"],
            hidden_dim=config["intermediate_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            max_seq_len=config.get("max_position_embeddings", 4096),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            **rope,
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def hf_config_from_args(args: ModelArgs) -> dict:
    """ModelArgs -> the config.json fields of transformers' LlamaConfig."""
    if args.norm != "rmsnorm":
        raise ValueError(f"transformers' Llama has RMSNorm only; this model uses {args.norm!r}")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
    }
    if args.use_scaled_rope:  # the key every transformers version reads (>= 5 converts it)
        config["rope_scaling"] = {"rope_type": "llama3", **{key: getattr(args, ours) for key, ours in _LLAMA3_ROPE_KEYS.items()}}
    return config
