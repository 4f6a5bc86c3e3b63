"""A model on the kernels computes one function: a prompt's logits and greedy tokens do not
depend on the other prompts of its batch, nor on how it is cut into forward calls, in fp32,
bf16, int8 and int4. The bar is the order of float sums: logits within 1e-4 of their spread
and the same greedy tokens (on the kernels each row is in fact computed alone, bit for bit)."""

import pytest
import torch

from llama_mini import ModelArgs, Transformer, generate
from llama_mini.kernels import matvec, use_fused_rmsnorm, use_matvec
from llama_mini.quant import quantize

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

VARIANTS = [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8"), (torch.bfloat16, "int8"),
            (torch.float32, "int4"), (torch.bfloat16, "int4")]
IDS = [f"{str(dtype)[6:]}-{quantization or 'float'}" for dtype, quantization in VARIANTS]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if matvec.operators() is None:
        pytest.skip("no CPU kernels on this machine (they need x86-64 with AVX2 and FMA)")


def model_on_kernels(dtype, quantization, seed=0):
    """A small Llama (head size 64, grouped-query attention) as generate.py runs it on a CPU."""
    torch.manual_seed(seed)
    args = ModelArgs(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=256, multiple_of=64, max_seq_len=256)
    model = Transformer(args).eval()
    if quantization:
        quantize(model, quantization)
    return use_matvec(use_fused_rmsnorm(model.to(dtype)))


def within_spread(got, expected, share=1e-4):
    """Each position's logits within `share` of that position's spread (max - min)."""
    spread = expected.amax(-1, keepdim=True) - expected.amin(-1, keepdim=True)
    return bool(((got - expected).abs() <= share * spread).all())


@torch.inference_mode()
def logits_in_pieces(model, tokens, cuts):
    """Logits of every position of tokens (B, T), read into the KV cache in pieces of the sizes
    in cuts (the rest in one last piece)."""
    model.setup_cache(tokens.shape[0], tokens.shape[1])
    pieces, start = [], 0
    for size in [*cuts, tokens.shape[1] - sum(cuts)]:
        pieces.append(model(tokens[:, start:start + size], start))
        start += size
    model.drop_cache()
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("dtype, quantization", VARIANTS, ids=IDS)
def test_a_prompt_read_whole_or_in_pieces_gives_the_same_logits(dtype, quantization):
    """Across the kernels' tiles and chunks of rows (4, 64): read whole, in pieces of 16 and 1,
    of 63, 1 and 66, one token at a time (decoding steps), and without a cache."""
    model = model_on_kernels(dtype, quantization)
    tokens = torch.randint(0, 256, (2, 130), generator=torch.Generator().manual_seed(1))
    whole = logits_in_pieces(model, tokens, [])
    with torch.inference_mode():
        assert within_spread(model(tokens), whole)
    for cuts in ([16, 1], [63, 1], [1] * 129):
        assert within_spread(logits_in_pieces(model, tokens, cuts), whole), cuts


@pytest.mark.parametrize("dtype, quantization", VARIANTS, ids=IDS)
def test_each_prompt_of_a_batch_gets_the_logits_it_gets_alone(dtype, quantization):
    model = model_on_kernels(dtype, quantization)
    tokens = torch.randint(0, 256, (5, 70), generator=torch.Generator().manual_seed(2))
    batched = logits_in_pieces(model, tokens, [20])
    for row in range(5):
        assert within_spread(logits_in_pieces(model, tokens[row:row + 1], []), batched[row:row + 1]), row


@pytest.mark.parametrize("dtype, quantization", VARIANTS, ids=IDS)
def test_a_ragged_batch_decodes_each_prompt_as_it_decodes_alone(dtype, quantization):
    """generate() reads every row up to the shortest prompt in one forward, then one position per
    step: 17 prompts of 1-40 tokens give each the greedy tokens it gets alone."""
    model = model_on_kernels(dtype, quantization, seed=3)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 41, (17,), generator=g)]
    batched = generate(model, prompts, 12, temperature=0)
    assert [generate(model, [prompt], 12, temperature=0)[0] for prompt in prompts] == batched
