"""Memory counted from a shape alone, checked against the model torch builds."""

import pytest
import torch

from llama_mini import ModelArgs, Transformer
from llama_mini.support.memory import check_free_memory, kv_cache_bytes, shown

SHAPES = [
    dict(dim=32, n_layers=1, n_heads=2, vocab_size=400, tie_embeddings=True),
    dict(dim=64, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=300, multiple_of=32),  # GQA, untied
    dict(dim=48, n_layers=2, n_heads=6, vocab_size=100, hidden_dim=100),  # a stated SwiGLU size
    dict(dim=64, n_layers=2, n_heads=4, vocab_size=100, ffn_dim_multiplier=1.3, multiple_of=64),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_parameter_count_from_the_shape_is_the_models(shape):
    args = ModelArgs(**shape)
    assert args.n_parameters == sum(p.numel() for p in Transformer(args).parameters())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.float16)])
def test_the_kv_cache_bytes_are_the_caches_the_model_allocates(shape, dtype, cache_dtype):
    model = Transformer(ModelArgs(**shape, max_seq_len=40)).to(dtype)
    model.cache_dtype = cache_dtype
    model.setup_cache(3, 40)
    dtype = model.kv_dtype()
    allocated = sum(b.numel() * b.element_size() for layer in model.layers for b in (layer.attention.cache.k, layer.attention.cache.v))
    assert kv_cache_bytes(model.args, 3, 40, dtype) == allocated


def test_what_does_not_fit_is_refused_naming_both_figures_and_the_fix(monkeypatch):
    from llama_mini.support import memory

    monkeypatch.setattr(memory, "free_bytes", lambda device: 3 * 2**30)
    check_free_memory(3 * 2**30, "this", torch.device("cpu"), "do less")  # exactly what is free fits
    with pytest.raises(ValueError, match=r"^this needs at least 3.0 GiB, and cpu has 3.0 GiB free; do less$"):
        check_free_memory(3 * 2**30 + 2**20, "this", torch.device("cpu"), "do less")
    assert [shown(n) for n in (512, 5 * 2**20, 2**40, 2**70)] == ["512 bytes", "5.0 MiB", "1.0 TiB", "2**70 bytes"]
