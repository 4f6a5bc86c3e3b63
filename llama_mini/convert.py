"""Convert a checkpoint between formats: python -m llama_mini.convert SRC DST --to native|meta|hf

    python -m llama_mini.convert out/run llama-hf --to hf          # a model trained here, for transformers
    python -m llama_mini.convert llama-2-13b llama-2-13b-hf --to hf  # Meta's 2 shards -> one HF folder
    python -m llama_mini.convert llama-2-7b-hf llama-2-7b --to meta --shards 2
    python -m llama_mini.convert out/run out/run-int8 --to native --quantize int8

The tokenizer.model found with SRC (in it or its parent) is copied into DST.
"""

import argparse
import sys
from pathlib import Path

from .checkpoint import DTYPES, FORMATS, HF_MAX_SHARD_BYTES, find_tokenizer, load_checkpoint, save_checkpoint
from .quantize import QUANTIZATIONS


def convert(src, dst, to: str, shards: int = 1, dtype=None, tokenizer_path=None, max_seq_len=None,
            max_shard_bytes: int = HF_MAX_SHARD_BYTES, quantize=None) -> Path:
    """Load src (any format) and write it to the new folder dst in format `to`, its linear
    layers quantized to int8 or int4 when asked (native format only)."""
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst} already exists and is not an empty folder; choose a new destination")
    tokenizer_path = tokenizer_path or find_tokenizer(src)
    model = load_checkpoint(src, dtype=dtype, max_seq_len=max_seq_len, tokenizer_path=tokenizer_path, quantize=quantize)
    return save_checkpoint(model, dst, format=to, tokenizer_path=tokenizer_path, shards=shards, max_shard_bytes=max_shard_bytes)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m llama_mini.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="checkpoint folder: llama_mini run or checkpoint, Meta, or Hugging Face")
    p.add_argument("dst", help="new folder to write")
    p.add_argument("--to", required=True, choices=FORMATS)
    p.add_argument("--shards", type=int, default=1, help="model-parallel files for --to meta (13B: 2, 70B: 8)")
    p.add_argument("--max-shard-gb", type=float, default=HF_MAX_SHARD_BYTES / 1e9, help="largest safetensors file for --to hf (default: %(default)g)")
    p.add_argument("--dtype", choices=DTYPES, help="default: the stored dtype")
    p.add_argument("--quantize", choices=QUANTIZATIONS, help="store the linear layers' weights as int8 or int4 (--to native)")
    p.add_argument("--tokenizer", help="tokenizer.model (default: the one in SRC or its parent)")
    p.add_argument("--max-seq-len", type=int, help="context length to record (default: SRC's, or 4096)")
    args = p.parse_args(argv)
    if args.shards < 1:
        p.error(f"--shards must be >= 1, got {args.shards}")
    if args.shards > 1 and args.to != "meta":
        p.error("--shards applies to --to meta only")
    if args.max_shard_gb <= 0:
        p.error(f"--max-shard-gb must be > 0, got {args.max_shard_gb}")
    out = convert(args.src, args.dst, args.to, args.shards, DTYPES.get(args.dtype), args.tokenizer, args.max_seq_len,
                  max(1, int(args.max_shard_gb * 1e9)), args.quantize)
    print(f"wrote {args.to} checkpoint to {out}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
