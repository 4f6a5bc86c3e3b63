"""The Transformer against an independent reference: transformers' LlamaForCausalLM."""

import json

import pytest
import torch

from llama_mini import ModelArgs, Transformer
from llama_mini.formats.hf import from_hf_state_dict, hf_config_from_args, permute_from_hf, permute_to_hf, to_hf_state_dict
from llama_mini.model import ffn_hidden_dim, rope_frequencies
from fixtures import tiny_model

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "mha": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=None, vocab_size=97, multiple_of=32),
    "gqa": dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=97, multiple_of=32),
    "theta500k_ffnmult": dict(
        dim=96, n_layers=2, n_heads=6, n_kv_heads=3, vocab_size=101, multiple_of=64,
        ffn_dim_multiplier=1.3, rope_theta=500000.0, norm_eps=1e-6,
    ),
    "tied": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=32, tie_embeddings=True),
    "llama31_scaled_rope": dict(
        dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=32,
        rope_theta=500000.0, use_scaled_rope=True, max_seq_len=256,
    ),
}

def hf_twin(model):
    """The same weights in transformers' LlamaForCausalLM."""
    config = transformers.LlamaConfig(**hf_config_from_args(model.args), attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model.state_dict(), model.args), strict=False)
    assert not unexpected and all("rotary" in k or (model.args.tie_embeddings and k == "lm_head.weight") for k in missing)
    return hf


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(name):
    model = tiny_model(**CONFIGS[name])
    hf = hf_twin(model)
    tokens = torch.randint(0, model.args.vocab_size, (2, 37), generator=torch.Generator().manual_seed(1))
    if model.args.use_scaled_rope:  # long enough that scaled and unscaled frequencies differ
        tokens = torch.randint(0, model.args.vocab_size, (1, 250), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.dtype == torch.float32 and ours.shape == (*tokens.shape, model.args.vocab_size)
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["theta500k_ffnmult", "llama31_scaled_rope"])
def test_rope_frequencies_match_transformers(name):
    model = tiny_model(**CONFIGS[name])
    rotary = hf_twin(model).model.rotary_emb
    assert torch.allclose(rope_frequencies(model.args), rotary.inv_freq, rtol=1e-6, atol=0)
    if model.args.use_scaled_rope:  # the scaling really changed the low frequencies
        model.args.use_scaled_rope = False
        assert not torch.allclose(rope_frequencies(model.args), rotary.inv_freq, rtol=1e-3, atol=0)


def test_hf_round_trip_restores_state_dict():
    model = tiny_model(**CONFIGS["gqa"])
    sd = model.state_dict()
    back = from_hf_state_dict(to_hf_state_dict(sd, model.args), model.args)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_permutation_pairs_adjacent_rows_with_half_offset_rows():
    # One head of head_dim 4: Meta's rows (0,1),(2,3) are rotation pairs; HF pairs row i with i+2.
    w = torch.arange(4.0)[:, None]
    assert permute_to_hf(w, 1).flatten().tolist() == [0.0, 2.0, 1.0, 3.0]
    assert torch.equal(permute_from_hf(permute_to_hf(w, 1), 1), w)


def test_hf_config_reads_transformers5_rope_parameters():
    model = tiny_model(**CONFIGS["theta500k_ffnmult"])
    config = transformers.LlamaConfig(**hf_config_from_args(model.args)).to_dict()
    assert "rope_parameters" in config and config["rope_parameters"]["rope_theta"] == 500000.0
    from llama_mini.formats.hf import args_from_hf_config

    args = args_from_hf_config(json.loads(json.dumps(config)))
    assert (args.rope_theta, args.ffn_dim, args.n_kv_heads) == (500000.0, model.args.ffn_dim, 3)


@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_prefill_then_decode_matches_full_forward(name):
    model = tiny_model(**CONFIGS[name])
    tokens = torch.randint(0, model.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)
        model.setup_cache(batch_size=2)
        steps = [model(tokens[:, :10], start_pos=0)]
        steps += [model(tokens[:, t : t + 1], start_pos=t) for t in range(10, 16)]
        steps.append(model(tokens[:, 16:], start_pos=16))  # a multi-token chunk after the cache
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_cache_is_used_exactly_between_setup_cache_and_drop_cache():
    """start_pos is only the position, as in Meta's code: whether keys and values are
    cached depends on setup_cache alone, and start_pos=0 means the same either way."""
    model = tiny_model(**CONFIGS["mha"])
    tokens = torch.randint(0, model.args.vocab_size, (1, 8))
    with torch.no_grad():
        plain = model(tokens)
        assert all(layer.attention.cache is None for layer in model.layers)
        model.setup_cache(batch_size=1)
        assert all(layer.attention.cache.k.abs().sum() == 0 for layer in model.layers)
        assert torch.equal(model(tokens, start_pos=0), plain)
        assert all(layer.attention.cache.k[:, :, :8].abs().sum() > 0 for layer in model.layers)
        model.drop_cache()
        assert all(layer.attention.cache is None for layer in model.layers)
        assert torch.equal(model(tokens), plain)
    with pytest.raises(RuntimeError, match="call model.setup_cache"):
        model(tokens[:, :1], start_pos=8)


def rope_tables_seen(model, tokens, **kw) -> list:
    """The cos tables the first attention layer receives in one forward."""
    seen = []
    hook = model.layers[0].attention.register_forward_pre_hook(lambda _, args: seen.append(args[1]))
    with torch.no_grad():
        model(tokens, **kw)
    hook.remove()
    return seen


def test_cache_lives_on_model_device_and_dtype():
    model = tiny_model(**CONFIGS["gqa"]).to(torch.bfloat16)
    model.setup_cache(batch_size=3, max_seq_len=16)
    cache = model.layers[0].attention.cache
    assert cache.k.dtype == torch.bfloat16 and cache.k.shape == (3, 2, 16, 8)
    (cos,) = rope_tables_seen(model, torch.zeros(3, 4, dtype=torch.long))
    assert cos.dtype == torch.float32  # Meta rotates in float32 whatever the weights
    with torch.no_grad():
        assert model(torch.zeros(3, 4, dtype=torch.long), start_pos=4).dtype == torch.float32


@torch.no_grad()
def test_a_float16_cache_holds_the_keys_rounded_and_attends_in_the_models_dtype():
    """cache_dtype float16 under a float32 model (llama.cpp's cache): the first layer's cache
    holds the float32 cache's keys and values rounded to float16, bit for bit, and decoding
    attends to them read back in float32: logits within float16's rounding of the float32
    cache's."""
    wide, narrow = tiny_model(**CONFIGS["gqa"]), tiny_model(**CONFIGS["gqa"])
    narrow.cache_dtype = torch.float16
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    for model in (wide, narrow):
        model.setup_cache(2, 12)
    assert narrow.kv_dtype() == torch.float16 and narrow.layers[0].attention.cache.k.dtype == torch.float16
    steps = [(tokens[:, :8], 0)] + [(tokens[:, p:p + 1], p) for p in range(8, 12)]
    for chunk, position in steps:
        expected, got = wide(chunk, position), narrow(chunk, position)
        assert got.dtype == torch.float32
        spread = (expected.amax(-1) - expected.amin(-1)).max()
        assert 0 < (got - expected).abs().max() <= 3e-3 * spread  # rounded, slightly
    first, rounded = wide.layers[0].attention.cache, narrow.layers[0].attention.cache  # the first layer's inputs are alike
    assert torch.equal(first.k.half(), rounded.k) and torch.equal(first.v.half(), rounded.v)


def test_rope_tables_cover_the_positions_used_not_the_whole_context():
    """A context of 250M positions (a hostile config) or 128K (Llama-3) allocates nothing
    up front: each forward computes cos/sin for its own positions only."""
    model = tiny_model(**CONFIGS["gqa"], max_seq_len=250_000_000)
    assert not list(model.buffers())
    tokens = torch.randint(0, model.args.vocab_size, (1, 5))
    (cos,) = rope_tables_seen(model, tokens)
    assert cos.shape == (5, 1, model.args.head_dim // 2, 2)  # (positions, heads, pairs, each of a pair)
    model.setup_cache(batch_size=1, max_seq_len=20)
    (later,) = rope_tables_seen(model, tokens[:, :3], start_pos=5)
    assert later.shape == (3, 1, model.args.head_dim // 2, 2)
    freqs = rope_frequencies(model.args)
    expected = torch.outer(torch.arange(5.0, 8.0), freqs).cos()  # positions 5, 6, 7
    assert torch.equal(later[:, 0, :, 0], expected) and torch.equal(later[:, 0, :, 1], expected)


@pytest.mark.parametrize(
    "dim, multiple_of, mult, expected",
    [(4096, 256, None, 11008), (5120, 256, None, 13824), (8192, 4096, 1.3, 28672)],
    ids=["7B", "13B", "70B"],
)
def test_ffn_hidden_dim_matches_llama2(dim, multiple_of, mult, expected):
    assert ffn_hidden_dim(dim, multiple_of, mult) == expected


def test_model_args_accepts_meta_params_json():
    llama2_7b = {"dim": 4096, "multiple_of": 256, "n_heads": 32, "n_layers": 32, "norm_eps": 1e-06, "vocab_size": -1}
    llama3_8b = {
        "dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256,
        "multiple_of": 1024, "ffn_dim_multiplier": 1.3, "norm_eps": 1e-05, "rope_theta": 500000.0,
    }
    assert ModelArgs(**llama2_7b).n_kv_heads == 32 and ModelArgs(**llama2_7b).ffn_dim == 11008
    assert ModelArgs(**llama3_8b).ffn_dim == 14336
    with pytest.raises(ValueError, match="set it from the tokenizer"):
        Transformer(ModelArgs(**llama2_7b))


def test_meta_parameter_names():
    keys = set(tiny_model(**CONFIGS["gqa"]).state_dict())
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")}
        expected |= {f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")}
        expected |= {f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"}
    assert keys == expected


def test_scaled_residual_init():
    model = Transformer(ModelArgs(dim=256, n_layers=8, n_heads=4, vocab_size=64))
    assert abs(model.layers[0].attention.wq.weight.std().item() - 0.02) < 1e-3
    for w in (model.layers[0].attention.wo.weight, model.layers[0].feed_forward.w2.weight):
        assert abs(w.std().item() - 0.02 / 4) < 5e-4  # 0.02 / sqrt(2 * 8)


@pytest.mark.parametrize("norm", ["layernorm", "none", "prmsnorm"])
def test_other_norms_train_with_finite_values(norm):
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=50, norm=norm, norm_p=0.25))
    tokens = torch.randint(0, 50, (2, 16))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    if norm == "layernorm":
        assert isinstance(model.norm, torch.nn.LayerNorm)
    if norm == "none":
        assert not any("norm" in k for k in model.state_dict())


def test_bad_args_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="unknown norm"):
        ModelArgs(norm="batchnorm")
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelArgs(dim=64, n_heads=4, n_kv_heads=3)
    model = tiny_model(**CONFIGS["mha"])
    with pytest.raises(ValueError, match="exceeds max_seq_len 128"):
        model(torch.zeros(1, 129, dtype=torch.long))
