"""Checkpoints in and out: every format told apart in one place, loaded into a model, saved from one.

Formats (detect_format):
- native: our own folder (native.py); a training run folder resolves to its newest checkpoint.
- meta: Meta's download, params.json + consolidated.NN.pth (meta.py).
- hf: a Hugging Face LlamaForCausalLM folder (hf.py).
- llama2c-bin, llama2c-pt: llama2.c's exported .bin and its training ckpt.pt, single files (llama2c.py).
- gguf: a llama.cpp GGUF file of the llama architecture, its vocabulary inside (gguf.py).

Loading never holds two copies of the weights: the model is built on the meta device, the
files are memory-mapped (torch.load(mmap=True), safetensors' lazy reading), and the mapped
tensors become the parameters through load_state_dict(assign=True). Pages are read from disk
when first used, so peak memory is about the size of the files (for a quantized GGUF file,
the size of its dequantized weights). Nothing a file says is trusted before it is checked
(reading.py, config_check.py); each reader checks its tensors against the config once
(state_dict.check_fits_config), and our own files' layout by their format record (record.py).
"""

from pathlib import Path

from ..model import ModelArgs, Transformer
from ..support.files import atomic_write, is_gguf
from ..tokenizers import copy_tokenizer
from . import llama2c
from .reading import is_torch_file
from .hf import MAX_SHARD_BYTES, hf_args, hf_config_from_args, read_hf, write_hf
from .meta import is_meta, meta_args, read_meta, write_meta
from .native import CONFIG, TOKENIZER, is_native, native_args, read_latest, read_native, write_native
from .state_dict import build_model, tie_equal_heads

FORMATS = ("native", "meta", "hf")  # the formats save_checkpoint writes
# Where a checkpoint's tokenizer lives: ours and Meta's beside the weights; Meta's HF repos
# of Llama-3 keep Meta's tiktoken file in original/; llama2.c's is tokenizer.bin; failing
# those, Hugging Face's own tokenizer.json.
TOKENIZER_NAMES = (TOKENIZER, "original/" + TOKENIZER, "tokenizer.bin", "tokenizer.json")


# --- Reading -------------------------------------------------------------------------------


def resolve_run_folder(path) -> Path:
    """A training run folder -> its newest complete checkpoint; any other folder or file -> itself."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    return (read_latest(path) if path.is_dir() else None) or path


def detect_format(path) -> str:
    """The format of a checkpoint folder or file (see the module docstring): the one place that decides."""
    path = Path(path)
    if path.is_file():
        if is_gguf(path):
            return "gguf"
        if is_torch_file(path):
            return "llama2c-pt"
        if llama2c.is_bin(path):
            return "llama2c-bin"
        raise ValueError(
            f"{path} is a file in no format llama_mini reads; pass the checkpoint folder that holds it "
            f"({path.parent}), a GGUF file, or a llama2.c .bin or .pt file"
        )
    if is_meta(path):
        return "meta"
    if (path / CONFIG).is_file():
        return "native" if is_native(path) else "hf"
    raise ValueError(
        f"{path} is not a checkpoint folder of a known format: it holds neither config.json "
        "(llama_mini or Hugging Face) nor params.json (Meta)"
    )


def find_tokenizer(path):
    """The tokenizer in the checkpoint folder, or in its parent (Meta's downloads keep one
    tokenizer beside the llama-2-7b/, llama-2-13b/ ... folders); for a llama2.c file, in the
    folder that holds it; a GGUF file holds its own; None if there is none."""
    path = resolve_run_folder(path)
    if path.is_file() and is_gguf(path):
        return path
    for folder in (path.parent,) if path.is_file() else (path, path.parent):
        for name in TOKENIZER_NAMES:
            if (folder / name).is_file():
                return folder / name
    return None


def checkpoint_tokenizer(path, tokenizer_path=None) -> Path:
    """tokenizer_path if given, else the checkpoint's own tokenizer; one line saying where it was
    looked for when there is none."""
    found = tokenizer_path or find_tokenizer(path)
    if found is None:
        raise FileNotFoundError(
            f"no tokenizer for {path}: neither it nor its parent holds {', '.join(TOKENIZER_NAMES)}; pass --tokenizer PATH"
        )
    return Path(found)


def read_args(path, tokenizer_path=None) -> ModelArgs:
    """The ModelArgs of a checkpoint of any format, from its config, params or header alone:
    what can be checked about a model before any of its weights is read."""
    path = resolve_run_folder(path)
    fmt = detect_format(path)
    if fmt == "native":
        return native_args(path)[0]
    if fmt == "meta":
        return meta_args(path, lambda: _vocab_size(checkpoint_tokenizer(path, tokenizer_path)))
    if fmt == "hf":
        return hf_args(path)
    if fmt == "gguf":
        from .gguf import gguf_args

        return gguf_args(path)
    return llama2c.bin_args(path) if fmt == "llama2c-bin" else llama2c.read_pt(path)[0]  # a .pt's tensors stay mapped


def load_checkpoint(path, device=None, dtype=None, max_seq_len=None, tokenizer_path=None, quantize=None,
                    keep_blocks: bool = True, converter=None) -> Transformer:
    """Load a checkpoint folder of any supported format, or a GGUF or llama2.c file. dtype=None
    keeps the stored dtype (one dtype for all: the embedding's, where the file mixes them). A
    GGUF file's quantized tensors keep the file's precision as int8, int4, Q5_K and Q6_K layers
    (gguf.load_gguf_blocks) unless dtype, quantize or keep_blocks=False asks for floats: they
    are then dequantized, to float32 where dtype is None. converter converts their blocks
    (quant.gguf_blocks.layer_from_blocks; kernels.gguf_converter(), where the kernels run).

    max_seq_len overrides the context length (4096, Llama-2's, where the checkpoint does not
    state one). tokenizer_path is needed only for a Meta params.json with vocab_size -1, and
    is looked for next to the checkpoint when not given. quantize ("int8" or "int4", see
    llama_mini/quant/) stores the linear layers' weights as integers once loaded; a checkpoint
    saved quantized loads quantized without it.
    """
    path = resolve_run_folder(path)
    fmt = detect_format(path)
    quantization = None
    if fmt == "native":
        args, state, quantization = read_native(path)
    elif fmt == "meta":
        args, state = read_meta(path, lambda: _vocab_size(checkpoint_tokenizer(path, tokenizer_path)))
    elif fmt == "hf":
        args, state = read_hf(path)
    elif fmt == "gguf":
        from .gguf import load_gguf_blocks, read_gguf  # the gguf package, imported when a GGUF file is read

        if keep_blocks and dtype is None and quantize is None and (model := load_gguf_blocks(path, converter)) is not None:
            if max_seq_len is not None:
                model.args.max_seq_len = max_seq_len
            return model.to(device)
        args, state = read_gguf(path, dtype)
    else:
        args, state = (llama2c.read_bin if fmt == "llama2c-bin" else llama2c.read_pt)(path)
    if fmt in ("meta", "llama2c-pt", "gguf") and tie_equal_heads(state):  # formats that store a tied head twice
        args.tie_embeddings = True
    if max_seq_len is not None:
        args.max_seq_len = max_seq_len
    if quantization is not None and quantize not in (None, quantization["method"]):
        raise ValueError(f"{path} is already quantized to {quantization['method']}; load it without quantize, "
                         f"or quantize its full-precision source to {quantize}")
    return build_model(args, state, device=device, dtype=dtype, quantization=quantization,
                       quantize=quantize if quantization is None else None)


def _vocab_size(tokenizer_path) -> int:
    from ..tokenizers import open_tokenizer

    return open_tokenizer(tokenizer_path).n_words


# --- Writing -------------------------------------------------------------------------------


def save_checkpoint(model: Transformer, path, format: str = "native", tokenizer_path=None, shards: int = 1,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write model to the folder path in the given format; returns the folder.

    format is "native", "meta" (params.json + consolidated.NN.pth, split into `shards`
    model-parallel files as Meta's 13B (2) and 70B (8) are) or "hf" (opens with
    transformers' LlamaForCausalLM.from_pretrained; split into safetensors files of at most
    max_shard_bytes, listed in model.safetensors.index.json, as save_pretrained does).
    tokenizer_path, when given, is copied into the folder as tokenizer.model (copy_tokenizer).
    """
    check_writable(model.args, format, shards, max_shard_bytes)  # before anything is created
    if getattr(model, "quantization", None) and format != "native":
        raise ValueError(f"a quantized model is saved in the native format only, not {format!r}; convert its full-precision source")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if format == "native":
        write_native(model, path)
    elif format == "meta":
        write_meta(model, path, shards)
    else:
        write_hf(model, path, max_shard_bytes)
    if tokenizer_path is not None and Path(tokenizer_path).resolve() != (path / TOKENIZER).resolve():
        atomic_write(path / TOKENIZER, lambda tmp: copy_tokenizer(tokenizer_path, tmp))
    return path


def check_writable(args, format: str, shards: int = 1, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
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
