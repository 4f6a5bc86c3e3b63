"""A model computes one function: a prompt's logits and greedy tokens do not depend on the other
prompts of its batch, nor on how it is cut into forward calls, in fp32, bf16, int8 and int4, on
the kernels and off them. The bar is the order of float sums: logits within 1e-4 of their
spread and the same greedy tokens; on the kernels each row is computed alone, bit for bit, at
any head size, hidden size and thread count."""

import pytest
import torch

from llama_mini import ModelArgs, Transformer, generate
from llama_mini.kernels import on_kernels, use_cpu_kernels, use_fused_rmsnorm
from llama_mini.kernels.operators import operators
from llama_mini.quant import quantize

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

VARIANTS = [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8"), (torch.bfloat16, "int8"),
            (torch.float32, "int4"), (torch.bfloat16, "int4")]
IDS = [f"{str(dtype)[6:]}-{quantization or 'float'}" for dtype, quantization in VARIANTS]


def needs_kernels():
    if operators() is None:
        pytest.skip("no CPU kernels on this machine (they need x86-64 with AVX2 and FMA)")


@pytest.fixture(params=["kernels", "plain"])
def kernels(request):
    """On the kernels (generate.py's way on a CPU), or the plain model (--kernels off): the
    same function, bit for bit on the kernels, within float rounding on torch's code."""
    if request.param == "kernels":
        needs_kernels()
    return request.param == "kernels"


def model_on_kernels(dtype, quantization, seed=0, kernels=True):
    """A small Llama (head size 64, grouped-query attention) as generate.py runs it on a CPU."""
    torch.manual_seed(seed)
    args = ModelArgs(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=256, multiple_of=64, max_seq_len=256)
    model = Transformer(args).eval()
    if quantization:
        quantize(model, quantization)
    return use_cpu_kernels(use_fused_rmsnorm(model.to(dtype))) if kernels else model.to(dtype)


def share_for(dtype, quantization, kernels) -> float:
    """The bar: on the kernels, float32 summation order (each row is in fact alone, bit for
    bit). On torch's code a row's sums depend on its neighbours: a bfloat16 rounding each time,
    and an activation that lands on the other side of an int8 rounding."""
    if kernels or (dtype == torch.float32 and quantization is None):
        return 1e-4
    return 3e-2 if dtype == torch.bfloat16 else 1e-2


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
def test_a_prompt_read_whole_or_in_pieces_gives_the_same_logits(dtype, quantization, kernels):
    """Across the kernels' tiles and chunks of rows (4, 64): read whole, in pieces of 16 and 1,
    of 63, 1 and 66, one token at a time (decoding steps), and without a cache."""
    model, share = model_on_kernels(dtype, quantization, kernels=kernels), share_for(dtype, quantization, kernels)
    tokens = torch.randint(0, 256, (2, 130), generator=torch.Generator().manual_seed(1))
    whole = logits_in_pieces(model, tokens, [])
    with torch.inference_mode():
        assert within_spread(model(tokens), whole, share)
    for cuts in ([16, 1], [63, 1], [1] * 129):
        assert within_spread(logits_in_pieces(model, tokens, cuts), whole, share), cuts


@pytest.mark.parametrize("dtype, quantization", VARIANTS, ids=IDS)
def test_each_prompt_of_a_batch_gets_the_logits_it_gets_alone(dtype, quantization, kernels):
    model, share = model_on_kernels(dtype, quantization, kernels=kernels), share_for(dtype, quantization, kernels)
    tokens = torch.randint(0, 256, (5, 70), generator=torch.Generator().manual_seed(2))
    batched = logits_in_pieces(model, tokens, [20])
    for row in range(5):
        assert within_spread(logits_in_pieces(model, tokens[row:row + 1], []), batched[row:row + 1], share), row


@pytest.mark.parametrize("dtype, quantization", VARIANTS, ids=IDS)
def test_a_ragged_batch_decodes_each_prompt_as_it_decodes_alone(dtype, quantization):
    """generate() reads every row up to the shortest prompt in one forward, then one position per
    step: 17 prompts of 1-40 tokens give each the greedy tokens it gets alone, on the kernels (on
    torch's code a near tie may fall either way)."""
    needs_kernels()
    model = model_on_kernels(dtype, quantization, seed=3)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 41, (17,), generator=g)]
    batched = generate(model, prompts, 12, temperature=0)
    assert [generate(model, [prompt], 12, temperature=0)[0] for prompt in prompts] == batched


# Shapes whose sizes are not multiples of 16: llama2.c's stories260K (head size 8, hidden 172)
# and stories15M (head size 48), head sizes 80, 96 and 256, hidden sizes 200 and 264.
SHAPES = {
    "stories260K": dict(dim=64, n_heads=8, n_kv_heads=4, hidden_dim=172),
    "head48": dict(dim=288, n_heads=6, hidden_dim=200),
    "head80": dict(dim=160, n_heads=2, n_kv_heads=1, hidden_dim=96),
    "head96": dict(dim=192, n_heads=2, hidden_dim=264),
    "head256": dict(dim=256, n_heads=1, hidden_dim=200),
}
CASES = [(shape, dtype, None) for shape in SHAPES for dtype in ("float32", "bfloat16")] + \
        [("stories260K", "float16", None), ("head80", "float16", None)] + \
        [("head80", "float32", "int8"), ("head80", "bfloat16", "int4")]  # sizes the integer layers take


@pytest.mark.parametrize("shape, dtype, quantization", CASES)
def test_each_row_is_bit_for_bit_the_same_at_any_head_size_hidden_size_and_thread_count(shape, dtype, quantization):
    """On the kernels a position's logits are the same bits whether the prompt is read whole, in
    pieces or token by token, alone or in a batch, on 1, 2, 3 or 6 threads (the kernels split
    rows off multiples of 16 there); float weights held in panels of their own dtype."""
    needs_kernels()
    torch.manual_seed(0)
    args = ModelArgs(n_layers=2, vocab_size=256, max_seq_len=128, **SHAPES[shape])
    model = Transformer(args).eval()
    if quantization:
        quantize(model, quantization)
    model = use_cpu_kernels(use_fused_rmsnorm(model.to(getattr(torch, dtype))))
    assert on_kernels(model)
    in_panels = any(getattr(m, "in_panels", False) for m in model.modules())
    assert in_panels == (not quantization)  # float weights in panels of 16 outputs
    tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        whole = logits_in_pieces(model, tokens, [])
        for count in (1, 2, 3, 6):
            torch.set_num_threads(count)
            assert torch.equal(logits_in_pieces(model, tokens, []), whole), count
            assert torch.equal(logits_in_pieces(model, tokens, [7, 1, 30]), whole), count
            assert torch.equal(logits_in_pieces(model, tokens[1:], []), whole[1:]), count
        assert torch.equal(logits_in_pieces(model, tokens[:, :40], [1] * 39), whole[:, :40])
    finally:
        torch.set_num_threads(threads)


def test_blocks_the_kernels_cannot_run_are_named_in_one_line_with_the_reason(caplog):
    """A block stays on the model's own code only with a notice that says which and why, and
    on_kernels says so; the model's numbers are its own."""
    needs_kernels()
    models = {
        "head size 12: the kernels take multiples of 8 up to 256": dict(dim=48, n_heads=4),
        "its attention_norm is LayerNorm, and the kernels run RMSNorm": dict(dim=64, n_heads=2, norm="layernorm"),
        "feed_forward.w1 is int8 of shape 64 -> 172": dict(dim=64, n_heads=8, hidden_dim=172),
    }
    for reason, shape in models.items():
        torch.manual_seed(0)
        model = Transformer(ModelArgs(n_layers=3, vocab_size=64, max_seq_len=32, **shape)).eval()
        if "int8" in reason:
            quantize(model, "int8")
        tokens = torch.randint(0, 64, (1, 9))
        with torch.inference_mode():
            expected = model(tokens)
        caplog.clear()
        with caplog.at_level("WARNING"):
            use_cpu_kernels(model)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and f"torch's code runs blocks 0-2 ({reason}" in lines[0] and "of 3, not the CPU kernels" in lines[0], lines
        assert not on_kernels(model)
        with torch.inference_mode():
            torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert on_kernels(use_cpu_kernels(Transformer(ModelArgs(dim=64, n_heads=4, n_layers=1, vocab_size=64))))
    assert not caplog.records
