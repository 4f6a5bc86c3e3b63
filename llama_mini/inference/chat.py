"""The chat of generate.py --chat, and the printing of one answer: a conversation in the model
family's chat format, as much of it as the context holds.

chat reads one user turn per line from stdin and keeps the conversation, in the model family's
chat format, as the context of the next; once it outgrows the model's context, its oldest
exchanges are left out (the system prompt stays), with a notice, as llama.cpp's context shift does.
"""

import itertools
import sys
import time

from ..generation import SEED_LIMIT, generate_stream, stream_text
from ..model import check_fits_context
from ..support.cli import utf8_text

# Llama-3.1's context, 131,072 tokens, the longest of the family, at 128 bytes a token (its
# tokenizer's longest): a prompt file or a chat message longer than this cannot fit any context.
MAX_PROMPT_BYTES = 131072 * 128
# How far the chat reads on through a line too long to send before it stops waiting for its end.
MAX_SKIPPED_BYTES = 4 * MAX_PROMPT_BYTES


def nth_seed(args, i: int):
    """Sample i's seed: --seed + i, wrapping within the seeds torch takes."""
    return None if args.seed is None else (args.seed + i) % SEED_LIMIT


def complete(model, tokenizer, prompt_ids, args, seed, echo="", continues_prompt=True, draft=None) -> str:
    """Generate after prompt_ids (speculatively with a draft: a model or "ngram"), printing echo
    and then the new text as it comes, and a line of speeds on stderr; returns the new text.

    A continuation is spaced as the prompt's continuation ("Once upon a" + " time"); a chat
    answer (continues_prompt=False) as text of its own, as Meta's chat_completion decodes it.
    """
    # At least one new token must fit; then as many of --max-new-tokens as the context holds.
    room = check_fits_context(model.args, len(prompt_ids) + 1, f"the prompt of {len(prompt_ids)} tokens + 1 new token",
                              "shorten the prompt (or raise --max-seq-len)")
    max_new = min(args.max_new_tokens, 1 + room)
    tally = {}
    steps = generate_stream(model, [prompt_ids], max_new, args.temperature, args.top_p, args.top_k or None,
                            tokenizer.stop_ids, seed, draft, args.lookahead, tally)
    print(echo, end="", flush=True)
    pieces = []
    context_id = prompt_ids[-1] if continues_prompt else tokenizer.bos_id
    clock = Clock()
    # one row: its step is None only at the end, for the stop id that is not part of the text
    new_ids = (clock.tick(step[0]) for step in steps if step[0] is not None)
    for piece in stream_text(tokenizer, new_ids, context_id=context_id):
        print(piece, end="", flush=True)
        pieces.append(piece)
    print(flush=True)
    print(clock.report(len(prompt_ids), tally), file=sys.stderr)
    return "".join(pieces)


class Clock:
    """When an answer's tokens came: the first ends the prompt's reading, the rest are decoding,
    reported as llama.cpp reports them (tokens and tokens per second of each)."""

    def __init__(self):
        self.start, self.times = time.perf_counter(), []

    def tick(self, token):
        self.times.append(time.perf_counter())
        return token

    def report(self, prompt_tokens: int, tally: dict) -> str:
        first = self.times[0] if self.times else time.perf_counter()
        line = f"prompt {prompt_tokens} tokens, {prompt_tokens / max(first - self.start, 1e-9):,.1f} tokens/s"
        answer = len(self.times)
        if answer > 1:
            line += f"; answer {answer} tokens, {(answer - 1) / max(self.times[-1] - first, 1e-9):,.1f} tokens/s after the first"
        else:
            line += f"; answer {answer} token{'' if answer == 1 else 's'}"
        if tally.get("drafted"):
            line += (f"; draft: {tally['accepted']} of {tally['drafted']} proposed tokens accepted "
                     f"({100 * tally['accepted'] / tally['drafted']:.0f}%)")
        return line


def chat(model, tokenizer, args, draft=None) -> None:
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
        answer = complete(model, tokenizer, prompt_ids, args, nth_seed(args, turn), continues_prompt=False, draft=draft)
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
