"""Sample text from a Llama checkpoint: our run folders, Meta's and Hugging Face's folders, GGUF and llama2.c files.

    python generate.py --ckpt llama-2-7b --prompt "The capital of France is"
    python generate.py --ckpt Llama-3.2-1B-Instruct --chat --system "Answer in one sentence."

Text is printed token by token as it is generated, until the tokenizer's stop ids (Llama-3
ends a chat turn with <|eot_id|>) or --max-new-tokens, then a line on stderr with the speed of
the prompt and of the answer. --chat reads one user turn per line from stdin, in the model
family's chat format (llama_mini/inference/chat.py). --draft decodes speculatively.
"""

import argparse
import sys

from llama_mini.support.cli import check_context, check_number, flag, run_main, utf8_text
from llama_mini.inference.chat import MAX_PROMPT_BYTES, chat, complete, nth_seed
from llama_mini.inference.loading import add_model_arguments, load_model, open_checkpoint, open_draft
from llama_mini.generation import LOOKAHEAD, MAX_LOOKAHEAD, TEMPERATURE, TOP_P, check_sampling_args
from llama_mini.support.device import DTYPES
from llama_mini.support.memory import check_free_memory, kv_cache_bytes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text to continue")
    source.add_argument("--prompt-file", help="file whose text to continue")
    source.add_argument("--chat", action="store_true", help="interactive multi-turn chat on stdin")
    p.add_argument("--system", help="system prompt; the prompt is then sent as a user turn in the model's chat format")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=TEMPERATURE, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=TOP_P)
    p.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    p.add_argument("--seed", type=int, help="sample i (chat turn i) uses seed + i; unset draws a random seed")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--max-seq-len", type=int, help="context length (default: the checkpoint's, or 4096)")
    p.add_argument("--kv-cache", choices=DTYPES, help="the KV cache's dtype (default: float16 for a GGUF file, as "
                                                      "llama.cpp keeps it; else the model's)")
    p.add_argument("--draft", help="speculative decoding: a smaller checkpoint of the same tokenizer proposes tokens that "
                                   "the model checks several at a time, or ngram: tokens copied from the text so far "
                                   "(prompt lookup); the same text, sooner")
    p.add_argument("--lookahead", type=int, default=LOOKAHEAD, help=f"tokens the draft proposes at a time (1-{MAX_LOOKAHEAD})")
    args = p.parse_args(argv)
    check_sampling_args(args.temperature, args.top_p, args.top_k, args.seed, name=flag)
    check_number("--max-new-tokens", args.max_new_tokens, 1)
    check_number("--num-samples", args.num_samples, 1)
    check_number("--lookahead", args.lookahead, 1, MAX_LOOKAHEAD)
    check_context("--max-seq-len", args.max_seq_len)
    for name in ("prompt", "system"):
        if getattr(args, name) is not None:
            setattr(args, name, utf8_text(getattr(args, name), flag(name)))
    return args


def read_prompt_file(path) -> str:
    """The text of the file at path, read only as far as a prompt can reach: no Llama context
    holds more than MAX_PROMPT_BYTES, and a stream such as /dev/zero never ends."""
    with open(path, "rb") as f:
        raw = f.read(MAX_PROMPT_BYTES + 1)
    if len(raw) > MAX_PROMPT_BYTES:
        raise ValueError(f"--prompt-file {path} is longer than {MAX_PROMPT_BYTES // 2**20} MiB, more text than "
                         "any Llama context holds; pass a shorter prompt")
    return utf8_text(raw, path)


def check_cache_fits(model, positions: int, device) -> None:
    """Refuse, in one line, a KV cache of positions that cannot fit the device's free memory."""
    needed = kv_cache_bytes(model.args, 1, positions, model.kv_dtype())
    check_free_memory(needed, f"a KV cache of {positions} positions", device, "lower --max-seq-len or --max-new-tokens")


def main(argv=None) -> None:
    args = parse_args(argv)
    text = args.prompt
    if args.prompt_file is not None:  # read before the model: a bad file fails fast
        text = read_prompt_file(args.prompt_file)
    ckpt, fmt, tokenizer = open_checkpoint(args)
    if args.system is not None:  # a system prompt the chat format cannot carry: refused before the model loads
        try:
            tokenizer.encode_dialog([{"role": "system", "content": args.system}, {"role": "user", "content": "Hi"}])
        except ValueError as e:
            raise ValueError(f"--system: {e}") from None
    draft = open_draft(args, ckpt, tokenizer)  # checked before any weight is read
    model = load_model(args, ckpt, fmt, tokenizer, args.max_seq_len, args.kv_cache)
    if isinstance(draft, tuple):
        draft = load_model(args, *draft, tokenizer, args.max_seq_len, args.kv_cache)
    device = next(model.parameters()).device

    if args.chat:
        check_cache_fits(model, model.args.max_seq_len, device)
        return chat(model, tokenizer, args, draft)
    if args.system is not None:
        prompt_ids = tokenizer.encode_dialog([{"role": "system", "content": args.system}, {"role": "user", "content": text}])
    else:
        prompt_ids = tokenizer.encode(text, bos=True)
    check_cache_fits(model, min(model.args.max_seq_len, len(prompt_ids) + args.max_new_tokens), device)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1}/{args.num_samples}", flush=True)
        complete(model, tokenizer, prompt_ids, args, nth_seed(args, i), echo=text if args.system is None else "", draft=draft)


if __name__ == "__main__":
    sys.exit(run_main(main))
