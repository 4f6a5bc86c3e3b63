"""Sample text from a Llama checkpoint: our run folders, Meta's and Hugging Face's folders, GGUF and llama2.c files.

    python generate.py --ckpt llama-2-7b --prompt "The capital of France is"
    python generate.py --ckpt Llama-3.2-1B-Instruct --chat --system "Answer in one sentence."

Text is printed token by token as it is generated, until the tokenizer's stop ids (Llama-3
ends a chat turn with <|eot_id|>) or --max-new-tokens. --chat reads one user turn per line
from stdin and keeps the conversation, in the model family's chat format, as the context of
the next; once it outgrows the model's context, its oldest exchanges are left out (the system
prompt stays), with a notice, as llama.cpp's context shift does.
"""

import argparse
import itertools
import sys

from llama_mini.cli import check_context, check_number, flag, run_main, utf8_text
from llama_mini.generation import SEED_LIMIT, TEMPERATURE, TOP_P, check_sampling_args, generate_stream, stream_text
from llama_mini.inference import add_model_arguments, load_model, open_checkpoint
from llama_mini.memory import check_fits, kv_cache_bytes
from llama_mini.model import check_fits_context

# Llama-3.1's context, 131,072 tokens, the longest of the family, at 128 bytes a token (its
# tokenizer's longest): a prompt file or a chat message longer than this cannot fit any context.
MAX_PROMPT_BYTES = 131072 * 128
# How far the chat reads on through a line too long to send before it stops waiting for its end.
MAX_SKIPPED_BYTES = 4 * MAX_PROMPT_BYTES


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
    args = p.parse_args(argv)
    check_sampling_args(args.temperature, args.top_p, args.top_k, args.seed, name=flag)
    check_number("--max-new-tokens", args.max_new_tokens, 1)
    check_number("--num-samples", args.num_samples, 1)
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


def nth_seed(args, i: int):
    """Sample i's seed: --seed + i, wrapping within the seeds torch takes."""
    return None if args.seed is None else (args.seed + i) % SEED_LIMIT


def complete(model, tokenizer, prompt_ids, args, seed, echo="", continues_prompt=True) -> str:
    """Generate after prompt_ids, printing echo and then the new text as it comes; returns the new text.

    A continuation is spaced as the prompt's continuation ("Once upon a" + " time"); a chat
    answer (continues_prompt=False) as text of its own, as Meta's chat_completion decodes it.
    """
    # At least one new token must fit; then as many of --max-new-tokens as the context holds.
    room = check_fits_context(model.args, len(prompt_ids) + 1, f"the prompt of {len(prompt_ids)} tokens + 1 new token",
                              "shorten the prompt (or raise --max-seq-len)")
    max_new = min(args.max_new_tokens, 1 + room)
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
    """Multi-turn chat: the whole dialog so far is the prompt of each answer, as much of it as
    the context holds (see shift_context)."""
    system = [{"role": "system", "content": args.system}] if args.system else []
    turns = []  # the user's and the model's messages, oldest first
    context = model.args.max_seq_len
    room = min(args.max_new_tokens, context // 2)  # the context kept free for each answer
    lines = chat_messages(sys.stdin.buffer)
    for turn in itertools.count():
        print("> ", end="", flush=True)
        user = next(lines, None)
        if user is None:
            print()
            return
        if not user.strip():
            continue
        turns.append({"role": "user", "content": user})
        try:
            prompt_ids, dropped = shift_context(tokenizer, system, turns, context, room)
        except ValueError as e:  # a message the chat format cannot carry, such as Llama-2's [INST] markup
            print(f"llama_mini: this message was not sent: {e}", file=sys.stderr)
            turns.pop()
            continue
        if prompt_ids is None:
            print(f"llama_mini: this message and the system prompt need more than the context of {context} "
                  "tokens; it was not sent: say it in fewer words", file=sys.stderr)
            turns.pop()
            continue
        if dropped:
            print(f"llama_mini: the conversation outgrew the context of {context} tokens; its {dropped} oldest "
                  f"messages are left out{' (the system prompt is kept)' if system else ''}", file=sys.stderr)
            del turns[:dropped]
        answer = complete(model, tokenizer, prompt_ids, args, nth_seed(args, turn), continues_prompt=False)
        turns.append({"role": "assistant", "content": answer})


def chat_messages(stream):
    """The chat input's lines as text, each read only as far as a message can reach. A line too
    long to send (MAX_PROMPT_BYTES), or not UTF-8, is refused in one line and the chat goes on;
    a line still without an end past MAX_SKIPPED_BYTES (a stream such as /dev/zero) ends it.
    A refused line is given as "", which the chat skips."""
    for number in itertools.count(1):
        line = stream.readline(MAX_PROMPT_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_PROMPT_BYTES and not line.endswith(b"\n"):
            skipped = len(line)
            while line and not line.endswith(b"\n"):
                if skipped > MAX_SKIPPED_BYTES:
                    raise ValueError(f"line {number} of the chat input runs past {MAX_SKIPPED_BYTES // 2**20} MiB without "
                                     "a line break; the chat reads one message per line")
                line = stream.readline(1 << 20)
                skipped += len(line)
            print(f"llama_mini: line {number} of the chat input is longer than {MAX_PROMPT_BYTES // 2**20} MiB, more "
                  "text than any Llama context holds; it was not sent", file=sys.stderr)
            yield ""  # nothing to send: the chat asks again
            continue
        try:
            yield utf8_text(line.rstrip(b"\r\n"), f"line {number} of the chat input")
        except ValueError as e:
            print(f"llama_mini: {e}; it was not sent", file=sys.stderr)
            yield ""


def shift_context(tokenizer, system, turns, context: int, room: int):
    """(prompt ids, how many of the oldest turns they leave out), as llama.cpp's context shift
    keeps a conversation going: the oldest exchanges (a user turn and its answer) are dropped
    until the prompt leaves room tokens of the context for the answer. The system prompt and
    the newest turn are always kept; (None, 0) where those alone fill the context."""
    for start in range(0, len(turns), 2):
        prompt_ids = tokenizer.encode_dialog(system + turns[start:])
        if len(prompt_ids) + room <= context:
            return prompt_ids, start
    # The newest turn alone leaves less room than asked: its answer gets what is left.
    return (prompt_ids, len(turns) - 1) if len(prompt_ids) < context else (None, 0)


def check_cache_fits(model, positions: int, device) -> None:
    """Refuse, in one line, a KV cache of positions that cannot fit the device's free memory."""
    needed = kv_cache_bytes(model.args, 1, positions, model.tok_embeddings.weight.dtype)
    check_fits(needed, f"a KV cache of {positions} positions", device, "lower --max-seq-len or --max-new-tokens")


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
    model = load_model(args, ckpt, fmt, tokenizer, args.max_seq_len)
    device = model.tok_embeddings.weight.device

    if args.chat:
        check_cache_fits(model, model.args.max_seq_len, device)
        return chat(model, tokenizer, args)
    if args.system is not None:
        prompt_ids = tokenizer.encode_dialog([{"role": "system", "content": args.system}, {"role": "user", "content": text}])
    else:
        prompt_ids = tokenizer.encode(text, bos=True)
    check_cache_fits(model, min(model.args.max_seq_len, len(prompt_ids) + args.max_new_tokens), device)
    for i in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {i + 1}/{args.num_samples}", flush=True)
        complete(model, tokenizer, prompt_ids, args, nth_seed(args, i), echo=text if args.system is None else "")


if __name__ == "__main__":
    sys.exit(run_main(main))
