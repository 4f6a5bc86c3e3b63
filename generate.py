"""Sample text from a Llama checkpoint: our run folders, Meta's and Hugging Face's folders, llama2.c files.

    python generate.py --ckpt llama-2-7b --prompt "The capital of France is"
    python generate.py --ckpt Llama-3.2-1B-Instruct --chat --system "Answer in one sentence."

Text is printed token by token as it is generated, until the tokenizer's stop ids (Llama-3
ends a chat turn with <|eot_id|>) or --max-new-tokens. --chat reads one user turn per line
from stdin and keeps the conversation, in the model family's chat format, as the context of
the next.
"""

import argparse
import itertools
import sys
import time
from pathlib import Path

from llama_mini.cli import flag, run_main
from llama_mini.device import DTYPES, bfloat16_notice, pick_device
from llama_mini.formats.checkpoint import checkpoint_tokenizer, detect_format, load_checkpoint, resolve_run_folder
from llama_mini.generation import SEED_LIMIT, check_sampling_args, generate_stream, stream_text
from llama_mini.kernels import on_kernels, use_fused_rmsnorm, use_matvec
from llama_mini.quant import QUANTIZATIONS, parameter_count
from llama_mini.tokenizers import check_vocab_size, open_tokenizer

# RoPE positions are float32, exact integers up to 2**24; a context beyond that (Llama-3.1's
# is 131,072 tokens) is a typo, not a wish.
MAX_CONTEXT = 1 << 24


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint: a llama_mini run, Meta or Hugging Face folder, or a llama2.c .bin/.pt file")
    p.add_argument("--tokenizer", help="tokenizer.model, tokenizer.bin or tokenizer.json (default: the checkpoint's own)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text to continue")
    source.add_argument("--prompt-file", help="file whose text to continue")
    source.add_argument("--chat", action="store_true", help="interactive multi-turn chat on stdin")
    p.add_argument("--system", help="system prompt; the prompt is then sent as a user turn in the model's chat format")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.6, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    p.add_argument("--seed", type=int, help="sample i (chat turn i) uses seed + i; unset draws a random seed")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--dtype", choices=DTYPES, help="default: the stored dtype")
    p.add_argument("--quantize", choices=QUANTIZATIONS, help="store the linear layers' weights as int8 or int4 once loaded")
    p.add_argument("--device", help="default: cuda, else mps, else cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (slow start, faster tokens)")
    p.add_argument("--max-seq-len", type=int, help="context length (default: the checkpoint's, or 4096)")
    args = p.parse_args(argv)
    try:
        check_sampling_args(args.temperature, args.top_p, args.top_k, args.seed)
    except ValueError as e:  # the library names its arguments (top_p); here they are flags (--top-p)
        name, rest = str(e).split(" ", 1)
        raise ValueError(f"{flag(name)} {rest}") from None
    for name in ("max_new_tokens", "num_samples", "max_seq_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"{flag(name)} must be >= 1, got {value}")
    if args.max_seq_len is not None and args.max_seq_len > MAX_CONTEXT:
        raise ValueError(f"--max-seq-len must be at most {MAX_CONTEXT} tokens, got {args.max_seq_len}")
    for name in ("prompt", "system"):
        if getattr(args, name) is not None:
            setattr(args, name, utf8_text(getattr(args, name), flag(name)))
    return args


def utf8_text(raw, source: str) -> str:
    """raw as text, or one line naming source. raw is bytes, or a str as Python reads argv and
    stdin, where bytes that are not UTF-8 become lone surrogates that no tokenizer can encode."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogateescape")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{source} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); pass UTF-8") from None


def nth_seed(args, i: int):
    """Sample i's seed: --seed + i, wrapping within the seeds torch takes."""
    return None if args.seed is None else (args.seed + i) % SEED_LIMIT


def complete(model, tokenizer, prompt_ids, args, seed, echo="", continues_prompt=True) -> str:
    """Generate after prompt_ids, printing echo and then the new text as it comes; returns the new text.

    A continuation is spaced as the prompt's continuation ("Once upon a" + " time"); a chat
    answer (continues_prompt=False) as text of its own, as Meta's chat_completion decodes it.
    """
    context = model.args.max_seq_len
    if len(prompt_ids) >= context:
        raise ValueError(
            f"the prompt is {len(prompt_ids)} tokens but the context is {context} tokens; "
            "shorten it (or raise --max-seq-len)"
        )
    max_new = min(args.max_new_tokens, context - len(prompt_ids))
    steps = generate_stream(
        model, [prompt_ids], max_new, args.temperature, args.top_p, args.top_k or None, tokenizer.stop_ids, seed
    )
    print(echo, end="", flush=True)
    pieces = []
    context_id = prompt_ids[-1] if continues_prompt else tokenizer.bos_id
    # one row: its step is None only at the end, for the stop id that is not part of the text
    new_ids = (step[0] for step in steps if step[0] is not None)
    for piece in stream_text(tokenizer, new_ids, context_id=context_id):
        print(piece, end="", flush=True)
        pieces.append(piece)
    print(flush=True)
    return "".join(pieces)


def chat(model, tokenizer, args) -> None:
    """Multi-turn chat: the whole dialog so far is the prompt of each answer."""
    dialog = [{"role": "system", "content": args.system}] if args.system else []
    lines = (utf8_text(line.rstrip(b"\r\n"), f"line {n} of the chat input") for n, line in enumerate(sys.stdin.buffer, 1))
    for turn in itertools.count():
        print("> ", end="", flush=True)
        user = next(lines, None)
        if user is None:
            print()
            return
        if not user.strip():
            continue
        dialog.append({"role": "user", "content": user})
        answer = complete(model, tokenizer, tokenizer.encode_dialog(dialog), args, nth_seed(args, turn), continues_prompt=False)
        dialog.append({"role": "assistant", "content": answer})


def main(argv=None) -> None:
    args = parse_args(argv)
    text = args.prompt
    if args.prompt_file is not None:  # read before the model: a bad file fails fast
        text = utf8_text(Path(args.prompt_file).read_bytes(), args.prompt_file)
    device = pick_device(args.device)
    ckpt = resolve_run_folder(args.ckpt)
    fmt = detect_format(ckpt)
    tokenizer = open_tokenizer(checkpoint_tokenizer(ckpt, args.tokenizer))
    start = time.perf_counter()
    model = load_checkpoint(ckpt, device=device, dtype=DTYPES.get(args.dtype), max_seq_len=args.max_seq_len,
                            tokenizer_path=tokenizer.model_path, quantize=args.quantize)
    check_vocab_size(tokenizer, model.args.vocab_size, ckpt)
    n_params = parameter_count(model)
    quantization = getattr(model, "quantization", None)
    quantized = f" with {quantization['method']} weights" if quantization else ""
    print(
        f"loaded {fmt} checkpoint {ckpt}: {n_params / 1e6:.1f}M parameters, "
        f"{model.tok_embeddings.weight.dtype}{quantized}, {device}, in {time.perf_counter() - start:.1f}s",
        file=sys.stderr,
    )
    if args.compile:
        model.compile(dynamic=True)
    elif device.type == "cpu":
        use_matvec(use_fused_rmsnorm(model))  # the CPU kernels: the same numbers, faster
    if not on_kernels(model) and (notice := bfloat16_notice(device, model.tok_embeddings.weight.dtype, "--dtype")):
        print(notice, file=sys.stderr)  # on the kernels, bf16 layers multiply in float32 tiles

    if args.chat:
        return chat(model, tokenizer, args)
    if args.system is not None:
        prompt_ids = tokenizer.encode_dialog([{"role": "system", "content": args.system}, {"role": "user", "content": text}])
    else:
        prompt_ids = tokenizer.encode(text, bos=True)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1}/{args.num_samples}", flush=True)
        complete(model, tokenizer, prompt_ids, args, nth_seed(args, i), echo=text if args.system is None else "")


if __name__ == "__main__":
    sys.exit(run_main(main))
