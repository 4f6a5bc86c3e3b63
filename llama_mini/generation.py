"""Autoregressive sampling with a preallocated KV cache, as in Meta's generation.py.

Two phases, named as gpt-fast names them: prefill reads the prompts in one forward pass, and
decode_one_token then reads one position per step. Rows of different lengths need no padding:
every row starts at position 0, prefill reads the batch up to the shortest prompt, and a row
whose prompt is longer keeps feeding its own prompt tokens until they run out (Meta's
input_text_mask), so all rows share one cache and none sees padding.
"""

import math
import operator
from typing import Iterable, Iterator, Optional, Union

import torch

from .model import Transformer, check_fits_context

SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes an unsigned 64-bit seed
TEMPERATURE, TOP_P = 0.6, 0.9  # the defaults of Meta's example scripts


def check_sampling_args(temperature: float, top_p: float, top_k: Optional[int], seed: Optional[int] = None,
                        name=lambda argument: argument) -> None:
    """Refuse sampling settings that mean nothing (NaN and infinities included), with the valid
    range in the message; name(argument) is what the message calls each (generate.py: its flags).
    None (top_k, seed: unset) passes."""
    for argument, value, fits, valid in (
        ("temperature", temperature, lambda t: 0 <= t < math.inf, ">= 0 (0 is greedy)"),
        ("top_p", top_p, lambda p: 0 < p <= 1, "in (0, 1] (1 keeps every token)"),
        ("top_k", top_k, lambda k: k >= 0, ">= 0 (0 keeps every token)"),
        ("seed", seed, lambda s: 0 <= s < SEED_LIMIT, "in [0, 2**64)"),
    ):
        if value is not None and not fits(value):
            finite = "" if isinstance(value, int) or math.isfinite(value) else "a finite number "
            raise ValueError(f"{name(argument)} must be {finite}{valid}, got {value}")


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Logits with everything below the k-th largest of each row set to -inf (ties kept)."""
    if not k or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al., 2019) exactly as Meta's sample_top_p: a token is
    kept when the tokens more likely than it hold at most p of the mass, so the token that
    crosses p is kept. The rest are zeroed and the kept ones renormalised. probs: (..., vocab)."""
    if p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # the mass of the more likely tokens
    sorted_probs = sorted_probs.masked_fill(before > p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def sample(logits, temperature: float, top_p: float = 1.0, top_k: Optional[int] = None, generator=None):
    """Next token ids (B,) from last-position logits (B, vocab). temperature 0 is argmax."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    if not torch.isfinite(scaled).all():
        # A temperature so close to 0 that logits / temperature overflow is greedy decoding: the
        # distribution it stands for puts all its mass on the largest logit.
        return logits.argmax(dim=-1)
    probs = torch.softmax(top_k_filter(scaled, top_k), dim=-1)
    probs = top_p_filter(probs, top_p)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def generate(model: Transformer, prompt_tokens: list[list[int]], max_new_tokens: int, temperature: float = TEMPERATURE,
             top_p: float = TOP_P, top_k: Optional[int] = None, eos_id: Union[int, Iterable[int], None] = None,
             seed: Optional[int] = None) -> list[list[int]]:
    """Continue each prompt; returns only the new tokens of each row, cut before its EOS.

    temperature 0 is greedy; top_p and top_k filter as Meta's and llama.cpp's samplers do (top_k
    None or 0 keeps every token). prompt_tokens may have rows of different lengths; each row
    stops at its own EOS. eos_id is one id or several,
    as ints or a tensor (Llama-3 ends a text with <|end_of_text|> and a chat turn with
    <|eot_id|>: pass tokenizer.stop_ids); with None nothing stops early and every row gets
    exactly max_new_tokens. Sampling draws from a private torch.Generator (seeded by seed,
    or randomly when seed is None), so the same seed gives the same text and the global RNG
    is left alone.
    """
    out = [[] for _ in prompt_tokens]
    for step in generate_stream(model, prompt_tokens, max_new_tokens, temperature, top_p, top_k, eos_id, seed):
        for row, token in zip(out, step):
            if token is not None:
                row.append(token)
    return out


def generate_stream(
    model: Transformer,
    prompt_tokens: list[list[int]],
    max_new_tokens: int,
    temperature: float = TEMPERATURE,
    top_p: float = TOP_P,
    top_k: Optional[int] = None,
    eos_id: Union[int, Iterable[int], None] = None,
    seed: Optional[int] = None,
) -> Iterator[list[Optional[int]]]:
    """generate, one decoding step at a time, for printing text as it comes (the same arguments).

    Yields a list with one entry per row: the row's new token, or None where the row has
    none at this step (it is still reading its longer prompt, or it has finished). The
    arguments are checked here, before the first step.
    """
    check_sampling_args(temperature, top_p, top_k, seed)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not prompt_tokens or any(len(p) == 0 for p in prompt_tokens):
        raise ValueError("every prompt needs at least one token (e.g. BOS)")
    longest = max(len(p) for p in prompt_tokens)
    check_fits_context(model.args, longest + max_new_tokens, f"a prompt of {longest} tokens + {max_new_tokens} new tokens",
                       "shorten the prompt or lower max_new_tokens")
    generator = torch.Generator(device=model.tok_embeddings.weight.device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    stop_ids = _stop_ids(eos_id)
    steps = _decode(model, prompt_tokens, max_new_tokens, temperature, top_p, top_k, stop_ids, generator)
    return _dropping_cache(model, steps)


def _stop_ids(eos_id) -> list[int]:
    """eos_id as a list of ints: None (none), one id or several, as ints, numpy integers or tensors."""
    if eos_id is None:
        return []
    try:
        return [operator.index(eos_id)]  # an int, a numpy integer, a one-element integer tensor
    except TypeError:
        pass
    try:
        return [operator.index(i) for i in eos_id]
    except TypeError:
        raise ValueError(f"eos_id must be a token id, a list of ids or None, got {eos_id!r}") from None


def _dropping_cache(model, steps):
    """steps, then the KV cache freed however decoding ends (finished, stopped early or
    failed): the model's forwards after it process whole sequences again."""
    try:
        yield from steps
    finally:
        model.drop_cache()


def prefill(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (B, vocab) of the position after tokens (B, T), the prompts read from position 0
    in one forward; their keys and values fill the cache."""
    return model(tokens, start_pos=0, last_only=True)[:, -1]


def decode_one_token(model: Transformer, token: torch.Tensor, pos: int) -> torch.Tensor:
    """Logits (B, vocab) after one token per row (B, 1) at position pos, attending to the cache."""
    return model(token, start_pos=pos, last_only=True)[:, -1]


@torch.inference_mode()
def _decode(model, prompt_tokens, max_new_tokens, temperature, top_p, top_k, stop_ids, generator):
    device = model.tok_embeddings.weight.device
    stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=device)
    lengths = torch.tensor([len(p) for p in prompt_tokens], device=device)
    B, shortest, total_len = len(prompt_tokens), int(lengths.min()), int(lengths.max()) + max_new_tokens
    tokens = torch.zeros(B, total_len, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompt_tokens):
        tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    # Allocated once, just long enough: each step writes one position and reads the rest,
    # so after the first token no step recomputes anything of the prompt.
    model.setup_cache(B, total_len)

    done = torch.zeros(B, dtype=torch.bool, device=device)
    for cur_pos in range(shortest, total_len if max_new_tokens else 0):
        # Every row up to the shortest prompt at once, then one position per step.
        if cur_pos == shortest:
            logits = prefill(model, tokens[:, :cur_pos])
        else:
            logits = decode_one_token(model, tokens[:, cur_pos - 1 : cur_pos], cur_pos - 1)
        if not torch.isfinite(logits).all():  # argmax would pick garbage, multinomial would crash
            raise ValueError(
                f"the model's logits at position {cur_pos} are NaN or infinite: its weights hold NaN/inf (a "
                f"damaged checkpoint) or {model.output.weight.dtype} overflowed; try another checkpoint or float32"
            )
        next_token = sample(logits, temperature, top_p, top_k, generator)
        in_prompt = cur_pos < lengths
        next_token = torch.where(in_prompt, tokens[:, cur_pos], next_token)
        tokens[:, cur_pos] = next_token
        fresh = ~in_prompt & ~done
        stop = fresh & torch.isin(next_token, stop_ids)
        yield [t if new else None for t, new in zip(next_token.tolist(), (fresh & ~stop).tolist())]
        done |= stop | (cur_pos + 1 >= lengths + max_new_tokens)
        if done.all():
            break


def stream_text(tokenizer, token_ids: Iterable[int], context_id: int) -> Iterator[str]:
    """Decode token ids into text pieces as they arrive, for printing without waiting.

    Decoding tokens one by one is wrong twice over with SentencePiece: a piece's leading
    space ("▁time") is dropped at the start of a decode, and a character spelled in
    byte-fallback tokens (<0xF0><0x9F><0x99><0x82> for one emoji) is not text until its last
    byte. So each new token is decoded together with the token before it (context_id, the
    prompt's last, at first) and only the added text is emitted, and a piece that ends in
    an unfinished character (U+FFFD) is held back until the character completes.
    """
    window = [context_id]
    for token in token_ids:
        window.append(token)
        text = tokenizer.decode(window)
        if not text.endswith("\ufffd"):
            yield text[len(tokenizer.decode(window[:1])):]
            window = [token]
    if len(window) > 1:  # bytes that never formed a character: emit them as U+FFFD
        yield tokenizer.decode(window)[len(tokenizer.decode(window[:1])):]
