"""Checkpoints: formats in, formats out.

Five formats, told apart by detect_format:
- native: our own folder, config.json ({"llama_mini": ModelArgs}) + model.safetensors and,
  when known, the tokenizer.model it was trained with. A training run folder holds one such
  folder per saved step and a `latest` file naming the newest complete one.
- meta: Meta's download, params.json + consolidated.NN.pth, one file per model-parallel rank
  (merged and split in llama_mini/meta_shards.py).
- hf: a Hugging Face LlamaForCausalLM folder, config.json + model*.safetensors (one file, or
  shards listed in model.safetensors.index.json) or pytorch_model*.bin.
- llama2c-bin, llama2c-pt: llama2.c's exported .bin and its training ckpt.pt, single files
  (llama_mini/llama2c.py).

Loading never holds two copies of the weights: the model is built on the meta device, the
files are memory-mapped (torch.load(mmap=True), safetensors' lazy reading), and the mapped
tensors become the parameters through load_state_dict(assign=True). Pages are read from disk
when first used, so peak memory is about the size of the files. Nothing a file says is
trusted before it is checked (llama_mini/checkpoint_files.py, llama_mini/config_check.py).
"""

import dataclasses
import json
import shutil
import typing
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from . import llama2c
from .checkpoint_files import inside, is_torch_file, read_json, read_safetensors, tensor_dict, torch_load
from .config_check import brief, check_fields, model_args
from .files import atomic_write
from .hf import CONFIG_TYPES, args_from_hf_config, from_hf_state_dict, hf_config_from_args, to_hf_state_dict
from .meta_shards import merge_meta_shards, split_meta_shards
from .model import ModelArgs, Transformer, ffn_hidden_dim
from .state_dict import build_model, check_layer_count, check_shape, tie_equal_heads
from .quantize import quantize_model, read_quantization
from .tokenizer import Tokenizer

CONFIG, WEIGHTS, TOKENIZER, LATEST = "config.json", "model.safetensors", "tokenizer.model", "latest"
HF_INDEX = WEIGHTS + ".index.json"
# Hugging Face folders are written in safetensors files of at most this size: save_pretrained's
# default before transformers 5, and well under the Hub's 50 GB limit per file (a 70B model
# in bf16 is 138 GB).
HF_MAX_SHARD_BYTES = 5 * 10**9
META_PARAMS = "params.json"
FORMATS = ("native", "meta", "hf")  # the formats save_checkpoint writes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # for --dtype


# --- Reading -------------------------------------------------------------------------------


def resolve_run_folder(path) -> Path:
    """A training run folder -> its newest complete checkpoint; any other folder or file -> itself."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.is_dir() and (path / LATEST).is_file():
        with open(path / LATEST, "rb") as f:
            name = f.read(256).decode(errors="replace").strip()
        step = inside(path, name, path / LATEST)
        if not step.is_dir():
            raise FileNotFoundError(
                f"{path / LATEST} names {name!r}, which is not in {path}; pass one of the run's step folders instead"
            )
        return step
    return path


def detect_format(path) -> str:
    """The format of a checkpoint folder or file (see the module docstring): the one place that decides."""
    path = Path(path)
    if path.is_file():
        if is_torch_file(path):
            return "llama2c-pt"
        if llama2c.is_bin(path):
            return "llama2c-bin"
        raise ValueError(
            f"{path} is a file in no format llama_mini reads; pass the checkpoint folder that holds it "
            f"({path.parent}), or a llama2.c .bin or .pt file"
        )
    if (path / META_PARAMS).is_file():
        return "meta"
    if (path / CONFIG).is_file():
        return "native" if "llama_mini" in read_json(path / CONFIG) else "hf"
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
    tokenizer beside the llama-2-7b/, llama-2-13b/ ... folders); for a llama2.c file, in the
    folder that holds it; None if there is none."""
    path = resolve_run_folder(path)
    for folder in (path.parent,) if path.is_file() else (path, path.parent):
        for name in TOKENIZER_NAMES:
            if (folder / name).is_file():
                return folder / name
    return None


def load_checkpoint(path, device=None, dtype=None, max_seq_len=None, tokenizer_path=None, quantize=None) -> Transformer:
    """Load a checkpoint folder of any supported format, or a llama2.c file. dtype=None keeps
    the stored dtype (one dtype for all: the embedding's, where the file mixes them).

    max_seq_len overrides the context length (4096, Llama-2's, where the checkpoint does not
    state one). tokenizer_path is needed only for a Meta params.json with vocab_size -1, and
    is looked for next to the checkpoint when not given. quantize ("int8" or "int4", see
    llama_mini/quantize.py) stores the linear layers' weights as integers once loaded; a
    checkpoint saved quantized loads quantized without it.
    """
    path = resolve_run_folder(path)
    fmt = detect_format(path)
    readers = {"native": _read_native, "meta": partial(_read_meta, tokenizer_path=tokenizer_path), "hf": _read_hf,
               "llama2c-bin": llama2c.read_bin, "llama2c-pt": llama2c.read_pt}
    args, state = readers[fmt](path)
    if fmt in ("meta", "llama2c-pt") and tie_equal_heads(state):  # formats that store a tied head twice
        args.tie_embeddings = True
    if max_seq_len is not None:
        args.max_seq_len = max_seq_len
    config = read_json(path / CONFIG) if fmt == "native" else {}
    stored = read_quantization(config["quantization"], path / CONFIG) if "quantization" in config else None
    if stored is not None and quantize not in (None, stored["method"]):
        raise ValueError(f"{path} is already quantized to {stored['method']}; load it without quantize, "
                         f"or quantize its full-precision source to {quantize}")
    model = build_model(args, state, device=device, dtype=dtype, quantization=stored)
    return quantize_model(model, quantize) if quantize is not None and stored is None else model


def _read_native(path: Path):
    fields = read_json(path / CONFIG)
    config = fields["llama_mini"]
    if not isinstance(config, dict):
        raise ValueError(f"{path / CONFIG}: its llama_mini field is not an object of ModelArgs fields")
    # norm_impl: how RMSNorm runs, saved by older versions; now chosen when a model is built.
    args = model_args({k: v for k, v in config.items() if k != "norm_impl"}, path / CONFIG)
    state = read_safetensors(path / WEIGHTS, quantized="quantization" in fields)
    if args.tie_embeddings and "tok_embeddings.weight" in state:
        state["output.weight"] = state["tok_embeddings.weight"]
    return args, state


def _read_meta(path: Path, tokenizer_path=None):
    params = read_json(path / META_PARAMS)
    if params.get("vocab_size", -1) == -1:  # Llama-2's params.json says -1: the tokenizer decides
        tokenizer_path = tokenizer_path or find_tokenizer(path)
        if tokenizer_path is None:
            raise FileNotFoundError(
                f"{path / META_PARAMS} says vocab_size -1, which the tokenizer decides, but no "
                f"{TOKENIZER} is in {path} or its parent; pass its path (--tokenizer)"
            )
        params["vocab_size"] = Tokenizer(tokenizer_path).n_words
    args = model_args(params, path / META_PARAMS)
    if args.use_scaled_rope and "rope_scaling_factor" not in params:  # Llama-3.x's files state no factor
        args.rope_scaling_factor = meta_rope_scaling_factor(params)
    files = sorted(path.glob("consolidated.*.pth"))
    if not files or [f.name for f in files] != [f"consolidated.{i:02d}.pth" for i in range(len(files))]:
        names = ", ".join(f.name for f in files) or "none"
        raise FileNotFoundError(f"{path} needs consolidated.00.pth, consolidated.01.pth, ... (one per model-parallel rank); found {names}")
    return args, merge_meta_shards([tensor_dict(torch_load(f), f) for f in files])


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


def _read_hf(path: Path):
    config = read_json(path / CONFIG)
    if config.get("model_type") != "llama":
        raise ValueError(f"{path / CONFIG} describes a {brief(config.get('model_type'))} model; only Llama (model_type 'llama') is supported")
    check_fields(config, CONFIG_TYPES, path / CONFIG)
    try:
        args = args_from_hf_config(config, source=path / CONFIG)
    except KeyError as e:
        raise ValueError(f"{path / CONFIG} lacks the field {e}") from None
    check_fields(dataclasses.asdict(args), typing.get_type_hints(ModelArgs), path / CONFIG)
    state = {}
    for file in _hf_weight_files(path):
        state.update(read_safetensors(file) if file.suffix == ".safetensors" else tensor_dict(torch_load(file), file))
    _check_hf_names_and_shapes(args, state)
    try:
        return args, from_hf_state_dict(state, args)
    except KeyError as e:
        raise ValueError(f"{path} holds tensor {e}, which is not part of a Llama model") from None


def _check_hf_names_and_shapes(args: ModelArgs, state: dict) -> None:
    """Every tensor the config implies is there with its shape, checked in the file's own
    names: the q/k rows are permuted by head when renamed, which needs the right shapes."""
    check_layer_count(args, state)
    with torch.device("meta"):
        ours = Transformer(args).state_dict()
    expected = {hf_name: (name, t) for name in ours for hf_name, t in to_hf_state_dict({name: ours[name]}, args).items()}
    missing = expected.keys() - state.keys()
    if missing:
        raise ValueError(f"checkpoint does not fit the config: missing {sorted(missing)[:3]}")
    for hf_name, tensor in state.items():
        if hf_name in expected:
            check_shape(expected[hf_name][0], tensor, expected[hf_name][1])


def _hf_weight_files(path: Path) -> list[Path]:
    """The weight files of a Hugging Face folder: safetensors before .bin, an index first."""
    for single, index in ((WEIGHTS, HF_INDEX), ("pytorch_model.bin", "pytorch_model.bin.index.json")):
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
    check_writable(model.args, format, shards, max_shard_bytes)  # before anything is created
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
        _write(path / TOKENIZER, lambda tmp: shutil.copyfile(tokenizer_path, tmp))
    return path


def check_writable(args: ModelArgs, format: str, shards: int = 1, max_shard_bytes: int = HF_MAX_SHARD_BYTES) -> None:
    """Refuse, before anything is written, a model the format cannot hold or a split it cannot make."""
    if format not in FORMATS:
        raise ValueError(f"unknown checkpoint format {format!r}; use one of {', '.join(FORMATS)}")
    if shards != 1 and format != "meta":
        raise ValueError(f"only the meta format is split into model-parallel shards, not {format!r}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    if format == "hf":
        hf_config_from_args(args)  # refuses what transformers' Llama cannot hold
    if format == "meta" and args.norm != "rmsnorm":
        raise ValueError(f"Meta's format has RMSNorm only; this model uses {args.norm!r}")
    sizes = (("n_kv_heads", args.n_kv_heads), ("dim", args.dim), ("vocab_size", args.vocab_size), ("ffn dim", args.ffn_dim))
    for what, size in sizes if format == "meta" else ():
        if size % shards:
            raise ValueError(f"cannot split into {shards} model-parallel shards: {what} {size} is not divisible by {shards}")


def _write(file: Path, write) -> None:
    """atomic_write, with a failed write reported as the OSError it is: torch's zip writer
    raises RuntimeError and safetensors SafetensorError where Python raises OSError (a full
    disk, a file-size limit)."""
    try:
        atomic_write(file, write)
    except (RuntimeError, SafetensorError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OSError(f"cannot write {file} ({reason}); is the disk full?") from None


def _write_native(model: Transformer, path: Path) -> None:
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        del state["output.weight"]  # the same tensor as tok_embeddings.weight; stored once
    _write(path / WEIGHTS, lambda tmp: save_file(state, tmp, metadata={"format": "pt"}))
    config = {"llama_mini": dataclasses.asdict(model.args)}
    if getattr(model, "quantization", None):
        config["quantization"] = model.quantization
    _write(path / CONFIG, lambda tmp: tmp.write_text(json.dumps(config, indent=2)))


def _write_meta(model: Transformer, path: Path, shards: int) -> None:
    args = model.args
    _write(path / META_PARAMS, lambda tmp: tmp.write_text(json.dumps(meta_params(args), indent=2)))
    # A tied output head is stored twice: Meta's format has no tying.
    for rank, shard in enumerate(split_meta_shards(model.state_dict(), shards)):
        _write(path / f"consolidated.{rank:02d}.pth", lambda tmp: torch.save(shard, tmp))


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
        _write(path / name, lambda tmp: save_file(shard, tmp, metadata={"format": "pt"}))
    if len(files) > 1:
        total = sum(v.numel() * v.element_size() for v in state.values())
        weight_map = {k: name for name, keys in zip(names, files) for k in keys}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write(path / HF_INDEX, lambda tmp: tmp.write_text(json.dumps(index, indent=2)))
    else:
        (path / HF_INDEX).unlink(missing_ok=True)  # a stale index would be read before the file
    for stale in set(path.glob("model*.safetensors")) - {path / name for name in names}:
        stale.unlink()  # left by an earlier write with another split
    config = hf_config_from_args(model.args)
    config["torch_dtype"] = str(model.output.weight.dtype).removeprefix("torch.")
    _write(path / CONFIG, lambda tmp: tmp.write_text(json.dumps(config, indent=2)))


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
