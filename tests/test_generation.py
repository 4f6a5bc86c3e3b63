"""Sampling and decoding: known answers for the filters, invariants for generate."""

import math

import pytest
import torch

from llama_mini import generate
from llama_mini import generation
from llama_mini.generation import prefill, sample, stream_text, top_k_filter, top_p_filter
from llama_mini.kernels import use_cpu_kernels
from llama_mini.kernels.operators import operators
from llama_mini.quant import quantize
from llama_mini.tokenizers import open_tokenizer

from fixtures import LLAMA2_TOKENIZER, require, tiny_model



def double_model(seed=0, **kw):
    """The shared tiny model (tests/fixtures.py), smaller, in float64, so that batched and
    unbatched runs agree to the last bit of every argmax."""
    return tiny_model(seed, **{"dim": 32, "vocab_size": 64, "multiple_of": 16, "max_seq_len": 96, **kw}).double()


def greedy_without_cache(model, prompt, n):
    """The definition of greedy decoding: rerun the whole sequence, take the argmax."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(model(torch.tensor([seq]))[0, -1].argmax().item())
    return seq[len(prompt):]


# --- The filters -------------------------------------------------------------------------------


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    kept = top_k_filter(logits, 2)
    assert torch.isfinite(kept).nonzero()[:, 1].tolist() == [1, 3]
    assert torch.equal(kept[0, [1, 3]], logits[0, [1, 3]])


def test_top_k_zero_keeps_everything():
    logits = torch.randn(3, 10)
    assert torch.equal(top_k_filter(logits, 0), logits)


@pytest.mark.parametrize(
    "p, kept",
    [(0.4, [0]), (0.6, [0, 1]), (0.75, [0, 1, 2]), (0.95, [0, 1, 2, 3])],
    ids=["inside_first", "inside_second", "exactly_at_a_boundary", "reaching_the_tail"],
)
def test_top_p_keeps_the_tokens_whose_predecessors_hold_at_most_p(p, kept):
    # Exact binary fractions, shuffled: 8/16, 4/16, 3/16, 1/16 live at indices 2, 0, 3, 1,
    # so the mass before each rank is 0, 8/16, 12/16 = 0.75 and 15/16.
    probs = torch.tensor([[0.25, 0.0625, 0.5, 0.1875]])
    by_rank = [2, 0, 3, 1]
    out = top_p_filter(probs, p)
    expected = torch.zeros_like(probs)
    expected[0, [by_rank[i] for i in kept]] = probs[0, [by_rank[i] for i in kept]]
    assert torch.allclose(out, expected / expected.sum(), atol=0, rtol=1e-6)


def test_temperature_zero_is_argmax():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, temperature=0.0), logits.argmax(dim=-1))


def test_sampling_follows_the_filtered_distribution():
    # top_k=2 leaves tokens 1 and 3 with probabilities e^5 : e^4; 4000 draws land within 5 sigma.
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]]).expand(4000, 5)
    draws = sample(logits, temperature=1.0, top_p=1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {1, 3}
    p1 = math.e / (math.e + 1)
    assert abs((draws == 1).float().mean().item() - p1) < 5 * math.sqrt(p1 * (1 - p1) / 4000)


@pytest.mark.parametrize(
    "kw, message",
    [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
     ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"), ({"top_p": math.nan}, "top_p"),
     ({"seed": 2**64}, "seed must be in \\[0, 2\\*\\*64\\)"), ({"seed": -1}, "seed")],
)
def test_bad_sampling_arguments_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        generate(double_model(), [[1, 2]], 4, **kw)


# --- generate ---------------------------------------------------------------------------------


def test_greedy_generate_equals_rerunning_the_full_sequence():
    model = double_model()
    assert generate(model, [[1, 5, 9]], 20, temperature=0)[0] == greedy_without_cache(model, [1, 5, 9], 20)


@pytest.mark.parametrize("chunk", [generation.PREFILL_CHUNK, 3])
def test_ragged_batch_rows_equal_their_single_runs(chunk, monkeypatch):
    monkeypatch.setattr(generation, "PREFILL_CHUNK", chunk)  # 3: the shared prompt read in several forwards
    model = double_model()
    prompts = [[1, 5, 9, 2, 33, 7, 8, 4], [1, 40, 7, 7, 2, 9, 6], [1, 3, 3, 3, 12, 13, 14, 15, 16]]
    batched = generate(model, prompts, 12, temperature=0)
    assert batched == [greedy_without_cache(model, p, 12) for p in prompts]


def test_without_eos_exactly_max_new_tokens_come_back():
    out = generate(double_model(), [[1, 2, 3], [4]], 17, temperature=1.0, top_p=1.0, seed=0)
    assert [len(row) for row in out] == [17, 17]


def test_eos_stops_its_row_only():
    model = double_model()
    prompts = [[1, 5, 9], [1, 40]]
    free = generate(model, prompts, 20, temperature=0)
    eos = free[0][3]
    assert eos not in free[0][:3] and eos not in free[1]  # stops row 0 after 3 tokens, never row 1
    assert generate(model, prompts, 20, temperature=0, eos_id=eos) == [free[0][:3], free[1]]


def test_several_stop_ids_stop_a_row_at_the_first_of_them():
    model = double_model()
    free = generate(model, [[1, 5, 9]], 20, temperature=0)[0]
    later, earlier = free[6], free[2]
    assert earlier not in free[:2] and later not in free[:6]
    assert generate(model, [[1, 5, 9]], 20, temperature=0, eos_id=[later, earlier]) == [free[:2]]
    assert generate(model, [[1, 5, 9]], 20, temperature=0, eos_id=(later,)) == [free[:6]]


def test_stop_ids_given_as_tensors_or_numpy_integers_stop_as_ints_do():
    """The ids a user holds: tokenizer output as a tensor, an id read from a numpy array."""
    import numpy as np

    model = double_model()
    free = generate(model, [[1, 5, 9]], 20, temperature=0)[0]
    later, earlier = free[6], free[2]
    assert earlier not in free[:2] and later not in free[:6]
    assert generate(model, [[1, 5, 9]], 20, temperature=0, eos_id=torch.tensor(later)) == [free[:6]]
    assert generate(model, [[1, 5, 9]], 20, temperature=0, eos_id=np.int64(later)) == [free[:6]]
    assert generate(model, [[1, 5, 9]], 20, temperature=0, eos_id=torch.tensor([later, earlier])) == [free[:2]]
    with pytest.raises(ValueError, match="eos_id must be a token id, a list of ids or None, got tensor\\(2.5000\\)"):
        generate(model, [[1, 5, 9]], 20, eos_id=torch.tensor(2.5))


def test_a_temperature_too_small_for_the_logits_samples_their_argmax():
    """logits / 1e-40 overflow float32; such a temperature stands for a distribution with all
    its mass on the largest logit, which is what sampling must then draw."""
    logits = torch.tensor([[1.0, 5.0, 3.0], [2.0, -1.0, 0.5]])
    assert not torch.isfinite(logits / 1e-40).all()
    for seed in range(5):
        assert sample(logits, 1e-40, generator=torch.Generator().manual_seed(seed)).tolist() == [1, 0]


def test_the_largest_seed_is_accepted():
    out = generate(double_model(), [[1, 2]], 3, temperature=1.0, seed=2**64 - 1)
    assert len(out[0]) == 3


def test_same_seed_gives_same_tokens_and_leaves_global_rng_alone():
    model = double_model()
    rng = torch.get_rng_state()
    a = generate(model, [[1, 2, 3]], 30, temperature=1.0, seed=1234)
    b = generate(model, [[1, 2, 3]], 30, temperature=1.0, seed=1234)
    c = generate(model, [[1, 2, 3]], 30, temperature=1.0, seed=4321)
    assert a == b and a != c
    assert torch.equal(torch.get_rng_state(), rng)


def test_cache_is_allocated_once_and_the_prompt_is_read_once(monkeypatch):
    model = double_model()
    calls, setups = [], []
    forward, setup_cache = model.forward, model.setup_cache
    monkeypatch.setattr(model, "forward", lambda tokens, start_pos=None, **kw: calls.append((tokens.shape[1], start_pos)) or forward(tokens, start_pos, **kw))
    monkeypatch.setattr(model, "setup_cache", lambda *a: setups.append(a) or setup_cache(*a))
    generate(model, [[1] * 30, [2] * 33], 5, temperature=0)
    assert setups == [(2, 38)]
    # The shortest prompt is read in one pass; every later step reads one token.
    assert calls == [(30, 0)] + [(1, pos) for pos in range(30, 37)]


def test_a_long_prompt_is_read_a_chunk_at_a_time_and_gives_the_same_tokens(monkeypatch):
    model = double_model()
    whole = generate(model, [[1, 2, 3] * 10], 6, temperature=0)
    calls, forward = [], model.forward
    monkeypatch.setattr(model, "forward", lambda tokens, start_pos=None, **kw: calls.append((tokens.shape[1], start_pos)) or forward(tokens, start_pos, **kw))
    monkeypatch.setattr(generation, "PREFILL_CHUNK", 8)
    assert generate(model, [[1, 2, 3] * 10], 6, temperature=0) == whole
    assert calls == [(8, 0), (8, 8), (8, 16), (6, 24)] + [(1, pos) for pos in range(30, 35)]


@pytest.mark.skipif(operators() is None, reason="no vector kernels on this machine (x86-64 with AVX2 and FMA)")
@pytest.mark.parametrize("method", [None, "int8", "int4"])
def test_on_the_kernels_a_prompt_read_in_chunks_gives_one_forwards_logits_bit_for_bit(monkeypatch, method):
    """The kernels compute each position as if alone, so cutting a prompt into chunks changes no bit."""
    model = tiny_model(3, max_seq_len=256)
    model = use_cpu_kernels(quantize(model, method) if method else model)
    tokens = torch.randint(0, model.args.vocab_size, (2, 150), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        model.setup_cache(2, 150)
        whole = model(tokens, 0, last_only=True)[:, -1]
        cache = model.layers[-1].attention.cache.k.clone()
        monkeypatch.setattr(generation, "PREFILL_CHUNK", 32)
        model.setup_cache(2, 150)
        assert torch.equal(prefill(model, tokens), whole)
        assert torch.equal(model.layers[-1].attention.cache.k, cache)


def test_nan_weights_are_reported_not_sampled():
    model = double_model()
    with torch.no_grad():
        model.norm.weight[0] = float("nan")
    with pytest.raises(ValueError, match="logits at position 2 are NaN or infinite"):
        generate(model, [[1, 2]], 4, temperature=0)


def test_prompt_longer_than_context_is_refused_with_both_numbers():
    with pytest.raises(ValueError, match="prompt of 90 tokens \\+ 10 new tokens exceeds max_seq_len 96, the model's context; "
                                         "shorten the prompt or lower max_new_tokens"):
        generate(double_model(), [[1] * 90], 10)


# --- Streaming text ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return open_tokenizer(require(LLAMA2_TOKENIZER))


def test_streamed_pieces_spell_the_decoded_text(tokenizer):
    ids = tokenizer.encode("Once upon a time, in 日本, a cat 🙂 said:\n  \"naïve\" — twice.")
    prompt, new = ids[:4], ids[4:]  # <s> ▁Once ▁upon ▁a | ▁time , ...
    assert any(tokenizer.sp.id_to_piece(t).startswith("<0x") for t in new)  # byte-fallback tokens
    pieces = list(stream_text(tokenizer, new, context_id=prompt[-1]))
    full = tokenizer.decode(prompt + new)
    assert "".join(pieces) == full[len(tokenizer.decode(prompt)):]
    assert pieces[0] == " time" and "\ufffd" not in "".join(pieces)
    assert "🙂" in pieces  # the emoji's four byte tokens come out as one piece


def test_streaming_after_bos_starts_without_a_space(tokenizer):
    new = tokenizer.encode("Hello world", bos=False)
    assert "".join(stream_text(tokenizer, new, context_id=tokenizer.bos_id)) == "Hello world"
