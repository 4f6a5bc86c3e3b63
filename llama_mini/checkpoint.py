"""Checkpoints: formats in, formats out.

Three formats, told apart by detect_format:
- native: our own folder, config.json ({"llama_mini": ModelArgs}) + model.safetensors and,
  when known, the tokenizer.model it was trained with. A training run folder holds one such
  folder per saved step and a `latest` file naming the newest complete one.
- meta: Meta's download, params.json + consolidated.NN.pth, one file per model-parallel rank.
- hf: a Hugging Face LlamaForCausalLM folder, config.json + model*.safetensors (one file, or
  shards listed in model.safetensors.index.json) or pytorch_model*.bin.

Loading never holds two copies of the weights: the model is built on the meta device, the
files are memory-mapped (torch.load(mmap=True), safetensors' lazy reading), and the mapped
tensors become the parameters through load_state_dict(assign=True). Pages are read from disk
when first used, so peak memory is about the size of the files.
"""

import dataclasses
import json
import pickle
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .files import atomic_write
from .hf import args_from_hf_config, from_hf_state_dict, hf_config_from_args, to_hf_state_dict
from .model import ModelArgs, Transformer, ffn_hidden_dim
from .quantize import empty_quantized_model, prepare_quantized, quantize_model, read_quantization
from .tokenizer import Tokenizer

CONFIG, WEIGHTS, TOKENIZER, LATEST = "config.json", "model.safetensors", "tokenizer.model", "latest"
HF_INDEX = WEIGHTS + ".index.json"
# Hugging Face folders are written in safetensors files of at most this size: save_pretrained's
# default before transformers 5, and well under the Hub's 50 GB limit per file (a 70B model
# in bf16 is 138 GB).
HF_MAX_SHARD_BYTES = 5 * 10**9
META_PARAMS = "params.json"
FORMATS = ("native", "meta", "hf")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # for --dtype

# Meta's model-parallel layers: ColumnParallelLinear splits its output features (dim 0),
# RowParallelLinear and ParallelEmbedding split their input / embedding features (dim 1).
# 1-D tensors (the norm weights) are replicated on every rank.
_META_SHARD_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1, "tok_embeddings": 1}


# --- Reading -------------------------------------------------------------------------------


def resolve_run_folder(path) -> Path:
    """A training run folder -> its newest complete checkpoint; any other folder -> itself."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.is_file():
        raise ValueError(f"{path} is a file; pass the checkpoint folder that holds it ({path.parent})")
    if (path / LATEST).is_file():
        return path / (path / LATEST).read_text().strip()
    return path


def detect_format(path) -> str:
    """"native", "meta" or "hf" for a checkpoint folder: the one place that decides."""
    path = Path(path)
    if (path / META_PARAMS).is_file():
        return "meta"
    if (path / CONFIG).is_file():
        return "native" if "llama_mini" in _read_json(path / CONFIG) else "hf"
    raise ValueError(
        f"{path} is not a checkpoint folder of a known format: it holds neither config.json "
        "(llama_mini or Hugging Face) nor params.json (Meta)"
    )


# Where a checkpoint's tokenizer lives: ours and Meta's beside the weights; Meta's HF repos
# of Llama-3 keep Meta's tiktoken file in original/; llama2.c's is tokenizer.bin; failing
# those, Hugging Face's own tokenizer.json.
TOKENIZER_NAMES = (TOKENIZER, "original/" + TOKENIZER, "tokenizer.bin", "tokenizer.json")


def find_tokenizer(path):
    """The tokenizer in the checkpoint folder, or in its parent (Meta's downloads keep one
    tokenizer beside the llama-2-7b/, llama-2-13b/ ... folders); None if neither has one."""
    path = resolve_run_folder(path)
    for folder in (path, path.parent):
        for name in TOKENIZER_NAMES:
            if (folder / name).is_file():
                return folder / name
    return None


def load_checkpoint(path, device=None, dtype=None, max_seq_len=None, tokenizer_path=None, quantize=None) -> Transformer:
    """Load a checkpoint folder of any supported format. dtype=None keeps the stored dtype.

    max_seq_len overrides the context length (4096, Llama-2's, where the checkpoint does not
    state one). tokenizer_path is needed only for a Meta params.json with vocab_size -1, and
    is looked for next to the checkpoint when not given. quantize ("int8" or "int4", see
    llama_mini/quantize.py) stores the linear layers' weights as integers once loaded; a
    checkpoint saved quantized loads quantized without it.
    """
    path = resolve_run_folder(path)
    fmt = detect_format(path)
    read = {"native": _read_native, "meta": _read_meta, "hf": _read_hf}[fmt]
    args, state = read(path, tokenizer_path)
    if max_seq_len is not None:
        args.max_seq_len = max_seq_len
    config = _read_json(path / CONFIG) if fmt == "native" else {}
    stored = read_quantization(config["quantization"], path / CONFIG) if "quantization" in config else None
    if stored is not None and quantize not in (None, stored["method"]):
        raise ValueError(f"{path} is already quantized to {stored['method']}; load it without quantize, "
                         f"or quantize its full-precision source to {quantize}")
    model = build_model(args, state, device=device, dtype=dtype, quantization=stored)
    return quantize_model(model, quantize) if quantize is not None and stored is None else model


def build_model(args: ModelArgs, state: dict, device=None, dtype=None, quantization=None) -> Transformer:
    """A Transformer holding exactly the tensors of state, checked by name and shape.
    quantization (a stored record) builds the quantized layers the state holds instead."""
    with torch.device("meta"):
        model = Transformer(args) if quantization is None else empty_quantized_model(args, quantization)
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
    model = model.to(device=device, dtype=dtype).eval()
    return model if quantization is None else prepare_quantized(model)


def _read_native(path: Path, tokenizer_path=None):
    try:
        fields = _read_json(path / CONFIG)["llama_mini"]
        # norm_impl: how RMSNorm runs, saved by older versions; now chosen when a model is built.
        args = ModelArgs(**{k: v for k, v in fields.items() if k != "norm_impl"})
    except (TypeError, AttributeError) as e:  # a field this version does not know, or one it needs missing
        raise ValueError(f"{path / CONFIG} does not describe a llama_mini model ({e})") from None
    state = _read_safetensors(path / WEIGHTS)
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return args, state


def _read_meta(path: Path, tokenizer_path=None):
    params = _read_json(path / META_PARAMS)
    unknown = params.keys() - {f.name for f in dataclasses.fields(ModelArgs)}
    if unknown:
        raise ValueError(f"{path / META_PARAMS} has fields llama_mini does not know: {sorted(unknown)}")
    files = sorted(path.glob("consolidated.*.pth"))
    if not files or [f.name for f in files] != [f"consolidated.{i:02d}.pth" for i in range(len(files))]:
        names = ", ".join(f.name for f in files) or "none"
        raise FileNotFoundError(f"{path} needs consolidated.00.pth, consolidated.01.pth, ... (one per model-parallel rank); found {names}")
    state = merge_meta_shards([_torch_load(f) for f in files])
    if params.get("vocab_size", -1) <= 0:  # Llama-2's params.json says -1: the tokenizer decides
        tokenizer_path = tokenizer_path or find_tokenizer(path)
        if tokenizer_path is None:
            raise FileNotFoundError(
                f"{path / META_PARAMS} says vocab_size -1, which the tokenizer decides, but no "
                f"{TOKENIZER} is in {path} or its parent; pass its path (--tokenizer)"
            )
        params["vocab_size"] = Tokenizer(tokenizer_path).n_words
    if params.get("use_scaled_rope") and "rope_scaling_factor" not in params:
        params["rope_scaling_factor"] = meta_rope_scaling_factor(params)
    return ModelArgs(**params), state


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


def _read_hf(path: Path, tokenizer_path=None):
    config = _read_json(path / CONFIG)
    if config.get("model_type") != "llama":
        raise ValueError(f"{path / CONFIG} describes a {config.get('model_type')!r} model; only Llama (model_type 'llama') is supported")
    try:
        args = args_from_hf_config(config, source=path / CONFIG)
    except KeyError as e:
        raise ValueError(f"{path / CONFIG} lacks the field {e}") from None
    state = {}
    for file in _hf_weight_files(path):
        state.update(_read_safetensors(file) if file.suffix == ".safetensors" else _torch_load(file))
    try:
        return args, from_hf_state_dict(state, args)
    except KeyError as e:
        raise ValueError(f"{path} holds tensor {e}, which is not part of a Llama model") from None


def _hf_weight_files(path: Path) -> list[Path]:
    """The weight files of a Hugging Face folder: safetensors before .bin, an index first."""
    for single, index in ((WEIGHTS, HF_INDEX), ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (path / index).is_file():
            weight_map = _read_json(path / index).get("weight_map", {})
            return [path / name for name in sorted(set(weight_map.values()))]
        if (path / single).is_file():
            return [path / single]
    raise FileNotFoundError(f"{path} has a config.json but no {WEIGHTS}, sharded safetensors index or pytorch_model.bin")


def merge_meta_shards(shards: list[dict]) -> dict:
    """Meta's model-parallel shards -> one state dict; rope.freqs is dropped (we recompute it).

    A single shard is returned as it is, so its memory-mapped tensors are never copied.
    """
    merged = {}
    for key, first in shards[0].items():
        if key == "rope.freqs":
            continue
        parts = [shard.get(key) for shard in shards]
        if any(p is None for p in parts):
            raise ValueError(f"tensor {key} is missing from model-parallel shard {parts.index(None):02d}")
        if len(shards) == 1 or first.dim() == 1:
            merged[key] = first
        else:
            merged[key] = torch.cat(parts, dim=_meta_shard_dim(key))
    return merged


def split_meta_shards(state: dict, n: int) -> list[dict]:
    """Inverse of merge_meta_shards: the state dict of each of n model-parallel ranks."""
    return [
        {key: (t if t.dim() == 1 else t.chunk(n, dim=_meta_shard_dim(key))[rank]).clone() for key, t in state.items()}
        for rank in range(n)
    ]


def _meta_shard_dim(key: str) -> int:
    name = key.split(".")[-2]  # layers.0.attention.wq.weight -> wq; output.weight -> output
    if name not in _META_SHARD_DIM:
        raise ValueError(f"tensor {key} is not part of a Meta Llama checkpoint")
    return _META_SHARD_DIM[name]


def _read_json(file: Path) -> dict:
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None


def _read_safetensors(file: Path) -> dict:
    """All tensors of a safetensors file, memory-mapped (read from disk when first used)."""
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found")
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file} is truncated or corrupt ({e}); download or convert it again") from None


def _torch_load(file: Path) -> dict:
    """A .pth/.bin state dict, memory-mapped. weights_only=True unpickles tensors and plain
    containers only, so a file carrying code (a pickle __reduce__ payload) is refused unrun."""
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found")
    try:
        return torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{file} holds pickled objects other than tensors (possibly code); refusing to load it") from None
    except Exception as e:  # torch raises RuntimeError, EOFError, ValueError ... for torn or foreign files
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{file} is truncated or corrupt ({reason}); download or convert it again") from None


# --- Writing -------------------------------------------------------------------------------


def save_checkpoint(model: Transformer, path, format: str = "native", tokenizer_path=None, shards: int = 1,
                    max_shard_bytes: int = HF_MAX_SHARD_BYTES) -> Path:
    """Write model to the folder path in the given format; returns the folder.

    format is "native", "meta" (params.json + consolidated.NN.pth, split into `shards`
    model-parallel files as Meta's 13B (2) and 70B (8) are) or "hf" (opens with
    transformers' LlamaForCausalLM.from_pretrained; split into safetensors files of at most
    max_shard_bytes, listed in model.safetensors.index.json, as save_pretrained does).
    tokenizer_path, when given, is copied into the folder as tokenizer.model.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown checkpoint format {format!r}; use one of {', '.join(FORMATS)}")
    if shards != 1 and format != "meta":
        raise ValueError(f"only the meta format is split into model-parallel shards, not {format!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    if getattr(model, "quantization", None) and format != "native":
        raise ValueError(f"a quantized model is saved in the native format only, not {format!r}; convert its full-precision source")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if format == "native":
        _write_native(model, path)
    elif format == "meta":
        _write_meta(model, path, shards)
    else:
        _write_hf(model, path, max_shard_bytes)
    if tokenizer_path is not None and Path(tokenizer_path).resolve() != (path / TOKENIZER).resolve():
        atomic_write(path / TOKENIZER, lambda tmp: shutil.copyfile(tokenizer_path, tmp))
    return path


def _write_native(model: Transformer, path: Path) -> None:
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        del state["output.weight"]  # the same tensor as tok_embeddings.weight; stored once
    atomic_write(path / WEIGHTS, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    config = {"llama_mini": dataclasses.asdict(model.args)}
    if getattr(model, "quantization", None):
        config["quantization"] = model.quantization
    atomic_write(path / CONFIG, lambda tmp: tmp.write_text(json.dumps(config, indent=2)))


def _write_meta(model: Transformer, path: Path, shards: int) -> None:
    args = model.args
    if args.norm != "rmsnorm":
        raise ValueError(f"Meta's format has RMSNorm only; this model uses {args.norm!r}")
    for what, size in (("n_kv_heads", args.n_kv_heads), ("dim", args.dim), ("vocab_size", args.vocab_size), ("ffn dim", args.ffn_dim)):
        if size % shards:
            raise ValueError(f"cannot split into {shards} model-parallel shards: {what} {size} is not divisible by {shards}")
    atomic_write(path / META_PARAMS, lambda tmp: tmp.write_text(json.dumps(meta_params(args), indent=2)))
    # A tied output head is stored twice: Meta's format has no tying.
    for rank, shard in enumerate(split_meta_shards(model.state_dict(), shards)):
        atomic_write(path / f"consolidated.{rank:02d}.pth", lambda tmp: torch.save(shard, tmp))


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
        base = int(2 * (4 * args.dim) / 3)
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


def _write_hf(model: Transformer, path: Path, max_shard_bytes: int) -> None:
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
        atomic_write(path / HF_INDEX, lambda tmp: tmp.write_text(json.dumps(index, indent=2)))
    else:
        (path / HF_INDEX).unlink(missing_ok=True)  # a stale index would be read before the file
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
