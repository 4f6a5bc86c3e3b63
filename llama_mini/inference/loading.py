"""A checkpoint of any format made ready to run: the flags and the loading that generate.py
and `python -m llama_mini.evaluate` share, so both read every format, --dtype, --quantize and
--kernels alike."""

import sys
import time

import torch

from ..support.cli import KERNELS
from ..support.device import DTYPES, bfloat16_notice, pick_device
from ..formats.checkpoint import (checkpoint_tokenizer, detect_format, find_tokenizer, load_checkpoint, read_args,
                                  resolve_run_folder)
from ..generation import NGRAM
from ..kernels import on_kernels, use_fused_rmsnorm, use_cpu_kernels
from ..quant import QUANTIZATIONS, hold_plain_rows, parameter_count, quantized_notice
from ..tokenizers import check_vocab_size, open_tokenizer


def add_model_arguments(p) -> None:
    p.add_argument("--ckpt", required=True, help="checkpoint: a llama_mini run, Meta or Hugging Face folder, a GGUF file, or a llama2.c .bin/.pt file")
    p.add_argument("--tokenizer", help="tokenizer.model, tokenizer.bin or tokenizer.json (default: the checkpoint's own; a GGUF file's is inside it)")
    p.add_argument("--dtype", choices=DTYPES, help="default: the stored dtype")
    p.add_argument("--quantize", choices=QUANTIZATIONS, help="store the linear layers' weights as int8 or int4 once loaded")
    p.add_argument("--device", help="default: cuda, else mps, else cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (slow start, faster tokens)")
    p.add_argument("--kernels", choices=KERNELS, default="auto",
                   help="auto (default): on a CPU, the linear layers and whole blocks on llama_mini's kernels, each "
                        "where it computes model.py as it is; off: model.py's own code everywhere")


def open_checkpoint(args):
    """(the checkpoint's path, its format, its tokenizer): what is found before any weight is read."""
    ckpt = resolve_run_folder(args.ckpt)
    return ckpt, detect_format(ckpt), open_tokenizer(checkpoint_tokenizer(ckpt, args.tokenizer))


def open_draft(args, ckpt, tokenizer):
    """--draft as (its path, its format), or "ngram", checked against the model's checkpoint
    before any weight of either is read: the same tokenizer, the same vocabulary, fewer
    parameters. None without --draft."""
    if args.draft in (None, NGRAM):
        return args.draft
    try:
        draft = resolve_run_folder(args.draft)
        fmt = detect_format(draft)
        check_shares_tokenizer(draft, tokenizer, "a draft")
        draft_args, model_args = read_args(draft, tokenizer.model_path), read_args(ckpt, tokenizer.model_path)
        if draft_args.vocab_size != model_args.vocab_size:
            raise ValueError(f"its vocabulary has {draft_args.vocab_size} tokens and the model's {model_args.vocab_size}: a "
                             "draft must share the model's tokenizer")
        if draft_args.n_parameters >= model_args.n_parameters:
            raise ValueError(f"it has {draft_args.n_parameters / 1e6:,.1f}M parameters, not fewer than the model's "
                             f"{model_args.n_parameters / 1e6:,.1f}M: it would cost more than it saves")
    except (ValueError, OSError) as e:
        raise ValueError(f"--draft {args.draft}: {e}") from None
    return draft, fmt


def check_shares_tokenizer(path, tokenizer, what: str) -> None:
    """Refuse a second checkpoint (a draft, a base) whose own tokenizer is not the model's."""
    own = find_tokenizer(path)
    if own and not same_tokenizer(open_tokenizer(own), tokenizer):
        raise ValueError(f"its tokenizer ({own}) is not the model's ({tokenizer.model_path}): {what} must share the "
                         "model's tokenizer")


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers give every id the same text and the same special ids."""
    return (a.n_words, a.bos_id, a.eos_id, a.stop_ids) == (b.n_words, b.bos_id, b.eos_id, b.stop_ids) and \
        a.token_bytes() == b.token_bytes()


def load_model(args, ckpt, fmt, tokenizer, max_seq_len=None, kv_cache=None):
    """The model, on its device, on the CPU kernels where they run (or compiled), with a line
    on stderr saying what was loaded and the notices of a slow path. Its KV cache's dtype is
    kv_cache (a DTYPES name), else float16 for a GGUF file (llama.cpp's), else the model's."""
    device = pick_device(args.device)
    kernels = device.type == "cpu" and args.kernels == "auto" and not args.compile
    converter = None
    if kernels and fmt == "gguf":
        from ..kernels.gguf_blocks import gguf_converter  # the gguf package, imported when a GGUF file is read

        converter = gguf_converter()  # a GGUF file's blocks converted by the kernels: the same bytes, sooner
    start = time.perf_counter()
    model = load_checkpoint(ckpt, device=device, dtype=DTYPES.get(args.dtype), max_seq_len=max_seq_len,
                            tokenizer_path=tokenizer.model_path, quantize=args.quantize, converter=converter)
    check_vocab_size(tokenizer, model.args.vocab_size, ckpt)
    model.cache_dtype = DTYPES[kv_cache] if kv_cache else torch.float16 if fmt == "gguf" else None
    quantization = getattr(model, "quantization", None)
    quantized = f" with {quantization.get('held', quantization['method'] + ' weights')}" if quantization else ""
    cache = f", a {str(model.cache_dtype).removeprefix('torch.')} KV cache" if model.cache_dtype else ""
    print(
        f"loaded {fmt} checkpoint {ckpt}: {parameter_count(model) / 1e6:.1f}M parameters, "
        f"{next(model.parameters()).dtype}{quantized}{cache}, {device}, in {time.perf_counter() - start:.1f}s",
        file=sys.stderr,
    )
    if kernels:
        use_cpu_kernels(use_fused_rmsnorm(model))  # the CPU kernels: the same numbers, faster
    if quantization and not on_kernels(model):
        hold_plain_rows(model)
    if args.compile:
        model.compile(dynamic=True)
    if not on_kernels(model) and (notice := bfloat16_notice(device, next(model.parameters()).dtype, "--dtype")):
        print(notice, file=sys.stderr)  # on the kernels, bf16 layers multiply in float32 tiles
    flag = None if quantization and quantization["method"] == "gguf" else "--quantize"
    if quantization and not on_kernels(model) and (notice := quantized_notice(model, flag, compiled=args.compile)):
        print(notice, file=sys.stderr)
    return model
