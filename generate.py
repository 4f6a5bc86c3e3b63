"""Sample text from a Llama checkpoint: our run folders, Meta's downloads or Hugging Face folders.

    python generate.py --ckpt llama-2-7b --prompt "The capital of France is"
    python generate.py --ckpt llama-2-7b-chat --chat --system "Answer in one sentence."

Text is printed token by token as it is generated. --chat reads one user turn per line
from stdin and keeps the conversation, in Meta's chat format, as the context of the next.
"""

import argparse
import itertools
import sys
import time


from llama_mini import load_checkpoint
from llama_mini.checkpoint import DTYPES, detect_format, find_tokenizer, resolve_run_folder
from llama_mini.device import pick_device
from llama_mini.quantize import QUANTIZATIONS, parameter_count
from llama_mini.generation import check_sampling_args, generate_stream, stream_text
from llama_mini.tokenizer import Tokenizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint folder (llama_mini run, Meta or Hugging Face)")
    p.add_argument("--tokenizer", help="tokenizer.model (default: the one in the checkpoint folder or its parent)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text to continue")
    source.add_argument("--prompt-file", help="file whose text to continue")
    source.add_argument("--chat", action="store_true", help="interactive multi-turn chat on stdin")
    p.add_argument("--system", help="system prompt; the prompt is then sent as a user turn in Meta's chat format")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.6, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    p.add_argument("--seed", type=int, help="sample i uses seed + i; unset draws a random seed")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--dtype", choices=DTYPES, help="default: the stored dtype")
    p.add_argument("--quantize", choices=QUANTIZATIONS, help="store the linear layers' weights as int8 or int4 once loaded")
    p.add_argument("--device", help="default: cuda, else mps, else cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (slow start, faster tokens)")
    p.add_argument("--max-seq-len", type=int, help="context length (default: the checkpoint's, or 4096)")
    args = p.parse_args(argv)
    try:
        check_sampling_args(args.temperature, args.top_p, args.top_k)
    except ValueError as e:
        raise ValueError(str(e).replace("top_p", "--top-p").replace("top_k", "--top-k").replace("temperature", "--temperature")) from None
    for flag in ("max_new_tokens", "num_samples", "max_seq_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    return args


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
        model, [prompt_ids], max_new, args.temperature, args.top_p, args.top_k or None, tokenizer.eos_id, seed
    )
    print(echo, end="", flush=True)
    pieces = []
    context_id = prompt_ids[-1] if continues_prompt else tokenizer.bos_id
    for piece in stream_text(tokenizer, (step[0] for step in steps), context_id=context_id):
        print(piece, end="", flush=True)
        pieces.append(piece)
    print(flush=True)
    return "".join(pieces)


def chat(model, tokenizer, args) -> None:
    """Multi-turn chat: the whole dialog so far is the prompt of each answer."""
    dialog = [{"role": "system", "content": args.system}] if args.system else []
    for turn in itertools.count():
        try:
            user = input("> ")
        except EOFError:
            print()
            return
        if not user.strip():
            continue
        dialog.append({"role": "user", "content": user})
        seed = None if args.seed is None else args.seed + turn
        answer = complete(model, tokenizer, tokenizer.encode_dialog(dialog), args, seed, continues_prompt=False)
        dialog.append({"role": "assistant", "content": answer})


def main(argv=None) -> None:
    args = parse_args(argv)
    device = pick_device(args.device)
    ckpt = resolve_run_folder(args.ckpt)
    fmt = detect_format(ckpt)
    tokenizer_path = args.tokenizer or find_tokenizer(ckpt)
    if tokenizer_path is None:
        raise FileNotFoundError(f"no tokenizer.model in {ckpt} or its parent; pass --tokenizer PATH")
    tokenizer = Tokenizer(tokenizer_path)
    start = time.perf_counter()
    model = load_checkpoint(ckpt, device=device, dtype=DTYPES.get(args.dtype), max_seq_len=args.max_seq_len, tokenizer_path=tokenizer_path,
                            quantize=args.quantize)
    if tokenizer.n_words != model.args.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer_path} has {tokenizer.n_words} tokens but the model's vocabulary has "
            f"{model.args.vocab_size}; pass the tokenizer.model that belongs to this checkpoint (--tokenizer)"
        )
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

    if args.chat:
        return chat(model, tokenizer, args)
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    else:
        text = args.prompt
    if args.system is not None:
        prompt_ids = tokenizer.encode_dialog([{"role": "system", "content": args.system}, {"role": "user", "content": text}])
    else:
        prompt_ids = tokenizer.encode(text, bos=True)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1}/{args.num_samples}", flush=True)
        seed = None if args.seed is None else args.seed + i
        complete(model, tokenizer, prompt_ids, args, seed, echo=text if args.system is None else "")


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
