"""Autoregressive sampling with a preallocated KV cache, as in Meta's generation.py.

Two phases, named as gpt-fast names them: prefill reads the prompts, PREFILL_CHUNK positions
per forward pass (llama.cpp's micro-batches), and decode_one_token then reads one position per
step. Rows of different lengths need no padding:
every row starts at position 0, prefill reads the batch up to the shortest prompt, and a row
whose prompt is longer keeps feeding its own prompt tokens until they run out (Meta's
input_text_mask), so all rows share one cache and none sees padding.

With a draft (speculative decoding, Leviathan et al. 2023; Chen et al. 2023), a cheaper
proposer guesses `lookahead` tokens and the model checks them all in one forward pass, so its
weights are read once for several tokens. The draft is a smaller model of the same vocabulary,
or "ngram": the tokens that followed the latest earlier occurrence of the last few tokens
(prompt lookup). Greedy decoding keeps the model's own argmax at every position, and sampling
the standard accept/resample rule, so the tokens are greedy decoding's, and the distribution
sampling's, whatever the draft proposes. Where the model computes each position as it would
alone (llama_mini's CPU kernels), greedy output is plain decoding's token for token.
"""

import math
import operator
from typing import Iterable, Iterator, Optional, Union

import torch

from .model import Transformer, check_fits_context

SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes an unsigned 64-bit seed
TEMPERATURE, TOP_P = 0.6, 0.9  # the defaults of Meta's example scripts
LOOKAHEAD, MAX_LOOKAHEAD = 4, 32  # tokens a draft proposes per forward of the model
NGRAM = "ngram"  # the draft that copies from the text so far (prompt lookup)
NGRAM_SIZES = (3, 2, 1)  # the n-grams it looks up, the longest first
PREFILL_CHUNK = 256  # prompt positions per forward: a long prompt's activations stay a chunk's
DRAFT_CONFIDENCE = 0.4  # a draft stops proposing after a token it gave less (transformers' assistant threshold)


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


def probabilities(logits, temperature: float, top_p: float = 1.0, top_k: Optional[int] = None):
    """The distribution sample() draws from, (..., vocab) from logits (..., vocab); None where
    sampling is greedy: temperature 0, or one so close to 0 that logits / temperature overflow
    (the distribution that stands for puts all its mass on the largest logit)."""
    if temperature == 0:
        return None
    scaled = logits.float() / temperature
    if not torch.isfinite(scaled).all():
        return None
    return top_p_filter(torch.softmax(top_k_filter(scaled, top_k), dim=-1), top_p)


def sample(logits, temperature: float, top_p: float = 1.0, top_k: Optional[int] = None, generator=None):
    """Next token ids (B,) from last-position logits (B, vocab). temperature 0 is argmax."""
    probs = probabilities(logits, temperature, top_p, top_k)
    if probs is None:
        return logits.argmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def generate(model: Transformer, prompt_tokens: list[list[int]], max_new_tokens: int, temperature: float = TEMPERATURE,
             top_p: float = TOP_P, top_k: Optional[int] = None, eos_id: Union[int, Iterable[int], None] = None,
             seed: Optional[int] = None, draft: Union[Transformer, str, None] = None,
             lookahead: int = LOOKAHEAD) -> list[list[int]]:
    """Continue each prompt; returns only the new tokens of each row, cut before its EOS.

    temperature 0 is greedy; top_p and top_k filter as Meta's and llama.cpp's samplers do (top_k
    None or 0 keeps every token). prompt_tokens may have rows of different lengths; each row
    stops at its own EOS. eos_id is one id or several,
    as ints or a tensor (Llama-3 ends a text with <|end_of_text|> and a chat turn with
    <|eot_id|>: pass tokenizer.stop_ids); with None nothing stops early and every row gets
    exactly max_new_tokens. Sampling draws from a private torch.Generator (seeded by seed,
    or randomly when seed is None), so the same seed gives the same text and the global RNG
    is left alone.

    draft: speculative decoding, `lookahead` tokens proposed per forward of model, by a smaller
    Transformer of the same vocabulary or by "ngram" (prompt lookup); see the module docstring.
    """
    out = [[] for _ in prompt_tokens]
    steps = generate_stream(model, prompt_tokens, max_new_tokens, temperature, top_p, top_k, eos_id, seed, draft, lookahead)
    for step in steps:
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
    draft: Union[Transformer, str, None] = None,
    lookahead: int = LOOKAHEAD,
    tally: Optional[dict] = None,
) -> Iterator[list[Optional[int]]]:
    """generate, one decoding step at a time, for printing text as it comes (the same arguments).

    Yields a list with one entry per row: the row's new token, or None where the row has
    none at this step (it is still reading its longer prompt, or it has finished). With a
    draft the rows are decoded one after another, a token per step. tally, a dict, gets the
    draft's tokens "drafted" and "accepted" added up. The arguments are checked here, before
    the first step.
    """
    check_sampling_args(temperature, top_p, top_k, seed)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not prompt_tokens or any(len(p) == 0 for p in prompt_tokens):
        raise ValueError("every prompt needs at least one token (e.g. BOS)")
    longest = max(len(p) for p in prompt_tokens)
    check_fits_context(model.args, longest + max_new_tokens, f"a prompt of {longest} tokens + {max_new_tokens} new tokens",
                       "shorten the prompt or lower max_new_tokens")
    if draft is not None:
        check_draft(model, draft, lookahead, longest + max_new_tokens)
    generator = torch.Generator(device=next(model.parameters()).device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    stop_ids = _stop_ids(eos_id)
    if draft is None:
        steps = _decode(model, prompt_tokens, max_new_tokens, temperature, top_p, top_k, stop_ids, generator)
    else:
        steps = _speculate_rows(model, draft, lookahead, prompt_tokens, max_new_tokens, temperature, top_p, top_k,
                                stop_ids, generator, tally if tally is not None else {})
    return _dropping_cache([model] if isinstance(draft, (str, type(None))) else [model, draft], steps)


def check_draft(model: Transformer, draft: Union[Transformer, str], lookahead: int, positions: int) -> None:
    """Refuse, in one line, a draft that cannot propose tokens for model: another vocabulary, a
    model as large as this one, a context too short; or a lookahead out of range."""
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or not 1 <= lookahead <= MAX_LOOKAHEAD:
        raise ValueError(f"lookahead must be an integer in [1, {MAX_LOOKAHEAD}] (tokens drafted per forward), got {lookahead!r}")
    if isinstance(draft, str):
        if draft != NGRAM:
            raise ValueError(f"draft must be a Transformer or {NGRAM!r} (prompt lookup), got {draft!r}")
        return
    if draft.args.vocab_size != model.args.vocab_size:
        raise ValueError(f"the draft's vocabulary has {draft.args.vocab_size} tokens and the model's {model.args.vocab_size}: "
                         "a draft must share the model's tokenizer")
    if draft is model or draft.args.n_parameters >= model.args.n_parameters:
        raise ValueError(f"the draft ({draft.args.n_parameters / 1e6:,.1f}M parameters) is not smaller than the model "
                         f"({model.args.n_parameters / 1e6:,.1f}M): it would cost more than it saves")
    check_fits_context(draft.args, positions, "the draft's context: {positions} positions",
                       "use a draft of a longer context, or shorten the prompt or the answer")


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


def _dropping_cache(models, steps):
    """steps, then the models' KV caches freed however decoding ends (finished, stopped early
    or failed): their forwards after it process whole sequences again."""
    try:
        yield from steps
    finally:
        for model in models:
            model.drop_cache()


def prefill(model: Transformer, tokens: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
    """Logits (B, vocab) of the position after tokens (B, T), read into the cache from
    start_pos, PREFILL_CHUNK positions per forward: a 1,024-token prompt then needs a quarter of
    the activations, and on the CPU kernels, which compute each position as it would be
    computed alone, the same numbers as one forward."""
    for start in range(0, tokens.shape[1], PREFILL_CHUNK):
        logits = model(tokens[:, start : start + PREFILL_CHUNK], start_pos=start_pos + start, last_only=True)
    return logits[:, -1]


def decode_one_token(model: Transformer, token: torch.Tensor, pos: int) -> torch.Tensor:
    """Logits (B, vocab) after one token per row (B, 1) at position pos, attending to the cache."""
    return model(token, start_pos=pos, last_only=True)[:, -1]


def _check_finite(logits, position: int, model, name: str = "model") -> None:
    """Refuse NaN or infinite logits, where argmax would pick garbage and multinomial crash."""
    if not torch.isfinite(logits).all():
        raise ValueError(
            f"the {name}'s logits at position {position} are NaN or infinite: its weights hold NaN/inf (a "
            f"damaged checkpoint) or {model.output.weight.dtype} overflowed; try another checkpoint or float32"
        )


@torch.inference_mode()
def _decode(model, prompt_tokens, max_new_tokens, temperature, top_p, top_k, stop_ids, generator):
    device = next(model.parameters()).device
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
        _check_finite(logits, cur_pos, model)
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


def _speculate_rows(model, draft, lookahead, prompt_tokens, max_new_tokens, temperature, top_p, top_k, stop_ids,
                    generator, tally):
    """Speculative decoding, one row after another (rows accept different numbers of tokens, so
    they would need caches at different positions), in the step format of _decode."""
    for row, prompt in enumerate(prompt_tokens):
        for token in _speculate(model, draft, lookahead, prompt, max_new_tokens, temperature, top_p, top_k, stop_ids,
                                generator, tally):
            step = [None] * len(prompt_tokens)
            step[row] = token
            yield step


@torch.inference_mode()
def _speculate(model, draft, lookahead, prompt, max_new_tokens, temperature, top_p, top_k, stop_ids, generator, tally):
    """The new tokens of one row. Each round the draft proposes up to lookahead tokens after
    seq, the text so far, and the model reads seq's last token and the proposals in one forward
    from the cache's end: its logits for every proposal and one past them. The proposals it
    agrees with are kept, and one token of its own follows (at the first disagreement, or
    after them all), so a round gives 1 to lookahead + 1 tokens. A cache holds the positions
    a model has read; positions past the kept tokens are written over in the next round."""
    if max_new_tokens == 0:
        return
    device = next(model.parameters()).device
    total = len(prompt) + max_new_tokens
    model.setup_cache(1, total)
    if not isinstance(draft, str):
        draft.setup_cache(1, total)
    seq, drafted_upto = list(prompt), 0  # drafted_upto: the positions the draft's cache holds
    logits = prefill(model, torch.tensor([seq], device=device))
    _check_finite(logits, len(seq), model)
    new = [sample(logits, temperature, top_p, top_k, generator).item()]
    while True:
        for token in new:
            if token in stop_ids:
                return
            seq.append(token)
            yield token
            if len(seq) == total:
                return
        k = min(lookahead, total - len(seq) - 1)  # the round's last token must fit too
        if isinstance(draft, str):
            proposals, draft_dists = _ngram_proposals(seq, k), None
        else:
            proposals, draft_dists = _draft_proposals(draft, seq, drafted_upto, k, temperature, top_p, top_k, generator)
            drafted_upto = len(seq) + len(proposals) - 1 if proposals else drafted_upto
        fed = torch.tensor([seq[-1:] + proposals], device=device)
        logits = model(fed, start_pos=len(seq) - 1)[0]  # (1 + len(proposals), vocab)
        _check_finite(logits, len(seq), model)
        kept, last = _verify(logits, proposals, draft_dists, temperature, top_p, top_k, generator)
        tally["drafted"] = tally.get("drafted", 0) + len(proposals)
        tally["accepted"] = tally.get("accepted", 0) + len(kept)
        drafted_upto = min(drafted_upto, len(seq) + len(kept))
        new = kept + [last]


def _ngram_proposals(seq: list[int], k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of seq's last n tokens (the
    longest n of NGRAM_SIZES that occurs before): prompt lookup, no model."""
    for n in NGRAM_SIZES:
        if len(seq) <= n:
            continue
        tail = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == tail:
                return seq[start + n:start + n + k]
    return []


def _draft_proposals(draft, seq, drafted_upto, k, temperature, top_p, top_k, generator):
    """Up to k tokens sampled from the draft after seq (its cache holds drafted_upto positions
    of seq), and for each the distribution it was drawn from (None where drawn greedily). It
    stops early after a token it gave less than DRAFT_CONFIDENCE: the next would likely be
    refused, and costs a draft step and a row of the check."""
    device = next(draft.parameters()).device
    proposals, dists = [], []
    fed, pos = seq[drafted_upto:], drafted_upto
    for _ in range(k):
        logits = prefill(draft, torch.tensor([fed], device=device), pos)[0]
        _check_finite(logits, pos + len(fed), draft, "draft")
        probs = probabilities(logits, temperature, top_p, top_k)
        token = (logits.argmax() if probs is None else torch.multinomial(probs, 1, generator=generator)[0]).item()
        proposals.append(token)
        dists.append(probs)
        confidence = torch.softmax(logits.float(), -1)[token] if probs is None else probs[token]
        if confidence < DRAFT_CONFIDENCE:
            break
        pos, fed = pos + len(fed), [token]
    return proposals, dists


def _verify(logits, proposals, draft_dists, temperature, top_p, top_k, generator):
    """(the proposals kept, the token that follows them) from the model's logits at each
    proposal and one past them. Greedy keeps the proposals equal to the model's argmax. Sampling
    keeps proposal x drawn from q with probability min(1, p(x) / q(x)) and at the first refusal
    draws from max(p - q, 0), renormalised, so each token follows p, the model's distribution,
    exactly; a proposal drawn greedily or copied from the text (q None) has q(x) = 1."""
    if temperature == 0:
        chosen = logits.argmax(-1).tolist()
        kept = 0
        while kept < len(proposals) and proposals[kept] == chosen[kept]:
            kept += 1
        return proposals[:kept], chosen[kept]
    for i, token in enumerate(proposals):
        p = probabilities(logits[i], temperature, top_p, top_k)
        if p is None:  # logits / temperature overflow: the argmax, as sample() takes it
            if logits[i].argmax().item() == token:
                continue
            return proposals[:i], logits[i].argmax().item()
        q = draft_dists[i] if draft_dists is not None and draft_dists[i] is not None else \
            torch.zeros_like(p).index_fill_(0, torch.tensor([token], device=p.device), 1.0)
        if torch.rand((), generator=generator, device=p.device) * q[token] < p[token]:
            continue
        residual = (p - q).clamp(min=0)
        return proposals[:i], torch.multinomial(residual if residual.sum() > 0 else p, 1, generator=generator).item()
    return proposals, sample(logits[len(proposals):], temperature, top_p, top_k, generator).item()


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
