"""Convert a checkpoint between formats: python -m llama_mini.formats.convert SRC DST --to native|meta|hf|gguf

    python -m llama_mini.formats.convert out/run llama-hf --to hf          # a model trained here, for transformers
    python -m llama_mini.formats.convert llama-2-13b llama-2-13b-hf --to hf  # Meta's 2 shards -> one HF folder
    python -m llama_mini.formats.convert llama-2-7b-hf llama-2-7b --to meta --shards 2
    python -m llama_mini.formats.convert stories15M.bin stories15M-hf --to hf  # llama2.c's export
    python -m llama_mini.formats.convert out/run out/run-int8 --to native --quantize int8
    python -m llama_mini.formats.convert out/run model-q8_0.gguf --to gguf --type q8_0   # for llama.cpp
    python -m llama_mini.formats.convert model-Q4_K_M.gguf model-q4 --to native  # a GGUF file, at its own precision
    python -m llama_mini.formats.convert model-Q4_K_M.gguf model-hf --to hf   # a GGUF file, dequantized

The tokenizer.model found with SRC (in it or its parent) is copied into DST; a GGUF file's
vocabulary becomes DST's tokenizer.model (a vocabulary-only GGUF file).
"""

import argparse
import sys
from pathlib import Path

from ..support.cli import check_context, check_number, run_main
from ..support.device import DTYPES
from ..support.files import atomic_folder, check_new_folder
from ..quant import QUANTIZATIONS
from ..tokenizers import check_vocab_size, open_tokenizer
from .checkpoint import FORMATS, check_writable, checkpoint_tokenizer, find_tokenizer, load_checkpoint, save_checkpoint
from .hf import MAX_SHARD_BYTES

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")  # gguf.py's, without importing the gguf package


def convert(src, dst, to: str, shards: int = 1, dtype=None, tokenizer_path=None, max_seq_len=None,
            max_shard_bytes: int = MAX_SHARD_BYTES, quantize=None, gguf_type: str = "f16") -> Path:
    """Load src (any format) and write it to the new folder dst in format `to` (or, for "gguf",
    the new file dst), its linear layers quantized to int8 or int4 when asked (native only).

    dst must not exist or be an empty folder; missing folders above it are created. The
    checkpoint is written into a hidden sibling folder and renamed to dst only once complete,
    so a refusal, a full disk or a kill never leaves a partial dst that would block the next
    try. The tokenizer copied along is tokenizer_path, which must have the model's vocabulary
    (as generate.py demands of it), else the one found with src.
    """
    dst = Path(dst)
    if to == "gguf":
        return convert_to_gguf(src, dst, gguf_type, dtype, tokenizer_path, max_seq_len)
    check_new_folder(dst, "choose a new destination")
    tokenizer_path = tokenizer_path or find_tokenizer(src)
    # Opened, and so checked, before it is copied: a bad --tokenizer or a damaged vocabulary fails first.
    tokenizer = open_tokenizer(tokenizer_path) if tokenizer_path is not None else None
    # A GGUF file's blocks stay as held in a native checkpoint; the float formats take their values.
    model = load_checkpoint(src, dtype=dtype, max_seq_len=max_seq_len, tokenizer_path=tokenizer_path, quantize=quantize,
                            keep_blocks=to == "native")
    if tokenizer is not None:
        check_vocab_size(tokenizer, model.args.vocab_size, src)
    check_writable(model.args, to, shards, max_shard_bytes)  # a refusal creates nothing
    atomic_folder(dst, lambda tmp: save_checkpoint(model, tmp, format=to, tokenizer_path=tokenizer_path, shards=shards,
                                                   max_shard_bytes=max_shard_bytes))
    return dst


def convert_to_gguf(src, dst: Path, gguf_type: str, dtype=None, tokenizer_path=None, max_seq_len=None) -> Path:
    """src (any format) -> the new GGUF file dst, for llama.cpp (see gguf.py)."""
    if dst.exists() or dst.is_symlink():
        raise ValueError(f"{dst} already exists; choose a new file name for the GGUF export")
    try:
        from .gguf import export_gguf
    except ModuleNotFoundError as e:
        raise ValueError(f"GGUF export needs the {e.name} package (llama.cpp's writer): pip install gguf") from None
    tokenizer = open_tokenizer(checkpoint_tokenizer(src, tokenizer_path))  # llama.cpp reads the vocabulary from it
    model = load_checkpoint(src, dtype=dtype, max_seq_len=max_seq_len, tokenizer_path=tokenizer.model_path, keep_blocks=False)
    check_vocab_size(tokenizer, model.args.vocab_size, src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    return export_gguf(model, dst, tokenizer.model_path, gguf_type)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m llama_mini.formats.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="checkpoint: llama_mini run or checkpoint, Meta or Hugging Face folder, GGUF file, llama2.c .bin or .pt")
    p.add_argument("dst", help="new folder to write")
    p.add_argument("--to", required=True, choices=FORMATS + ("gguf",))
    p.add_argument("--type", choices=GGUF_TYPES, default="f16", help="tensor type for --to gguf (default: %(default)s)")
    p.add_argument("--shards", type=int, default=1, help="model-parallel files for --to meta (13B: 2, 70B: 8)")
    p.add_argument("--max-shard-gb", type=float, default=MAX_SHARD_BYTES / 1e9, help="largest safetensors file for --to hf (default: %(default)g)")
    p.add_argument("--dtype", choices=DTYPES, help="default: the stored dtype")
    p.add_argument("--quantize", choices=QUANTIZATIONS, help="store the linear layers' weights as int8 or int4 (--to native)")
    p.add_argument("--tokenizer", help="tokenizer.model (default: the one in SRC or its parent)")
    p.add_argument("--max-seq-len", type=int, help="context length to record (default: SRC's, or 4096)")
    args = p.parse_args(argv)
    check_number("--shards", args.shards, 1)
    check_number("--max-shard-gb", args.max_shard_gb, 0, 10**6, low_open=True, note=" (a million GB: one file)")
    check_context("--max-seq-len", args.max_seq_len)
    if args.shards > 1 and args.to != "meta":
        raise ValueError("--shards applies to --to meta only")
    if args.quantize and args.to != "native":
        raise ValueError("--quantize writes a native checkpoint (--to native); for llama.cpp use --to gguf --type q8_0 or q4_0")
    out = convert(args.src, args.dst, args.to, args.shards, DTYPES.get(args.dtype), args.tokenizer, args.max_seq_len,
                  max(1, int(args.max_shard_gb * 1e9)), args.quantize, args.type)
    print(f"wrote {args.to} {'file' if args.to == 'gguf' else 'checkpoint'} to {out}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(run_main(main))
