"""A checkpoint of any format made ready to run: the flags and the loading that generate.py
and `python -m llama_mini.evaluate` share, so both read every format, --dtype, --quantize and
--kernels alike."""

import sys
import time

from ..support.cli import KERNELS
from ..support.device import DTYPES, bfloat16_notice, pick_device
from ..formats.checkpoint import checkpoint_tokenizer, detect_format, load_checkpoint, resolve_run_folder
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


def load_model(args, ckpt, fmt, tokenizer, max_seq_len=None):
    """The model, on its device, on the CPU kernels where they run (or compiled), with a line
    on stderr saying what was loaded and the notices of a slow path."""
    device = pick_device(args.device)
    start = time.perf_counter()
    model = load_checkpoint(ckpt, device=device, dtype=DTYPES.get(args.dtype), max_seq_len=max_seq_len,
                            tokenizer_path=tokenizer.model_path, quantize=args.quantize)
    check_vocab_size(tokenizer, model.args.vocab_size, ckpt)
    quantization = getattr(model, "quantization", None)
    quantized = f" with {quantization['method']} weights" if quantization else ""
    print(
        f"loaded {fmt} checkpoint {ckpt}: {parameter_count(model) / 1e6:.1f}M parameters, "
        f"{model.tok_embeddings.weight.dtype}{quantized}, {device}, in {time.perf_counter() - start:.1f}s",
        file=sys.stderr,
    )
    if device.type == "cpu" and args.kernels == "auto" and not args.compile:
        use_cpu_kernels(use_fused_rmsnorm(model))  # the CPU kernels: the same numbers, faster
    if quantization and not on_kernels(model):
        hold_plain_rows(model)
    if args.compile:
        model.compile(dynamic=True)
    if not on_kernels(model) and (notice := bfloat16_notice(device, model.tok_embeddings.weight.dtype, "--dtype")):
        print(notice, file=sys.stderr)  # on the kernels, bf16 layers multiply in float32 tiles
    if quantization and not on_kernels(model) and (notice := quantized_notice(model, compiled=args.compile)):
        print(notice, file=sys.stderr)
    return model
