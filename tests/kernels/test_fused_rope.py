"""Fused RoPE for training (llama_mini/kernels/fused_rope.py): the kernels' rope gives
apply_rotary_emb's output and gradient bit for bit, at every head size the kernels take, and a
model with it trains to the plain model's numbers bit for bit."""

import pytest
import torch

from llama_mini import ModelArgs, Transformer
from llama_mini.kernels import FusedAttention, use_fused_rope, use_fused_swiglu
from llama_mini.kernels.operators import operators
from llama_mini.model import Attention, FeedForward, apply_rotary_emb, rope_cos_sin
from fixtures import assert_swaps_every, tiny_model

KERNEL_NODE = "torch::autograd::CppNode<llama_mini::RoPEFunction>"  # kernels/csrc/rope_op.cpp

requires_kernels = pytest.mark.skipif(operators() is None, reason="no vector kernels on this machine (x86-64 with AVX2 and FMA)")
pytestmark = requires_kernels


def output_and_gradient(rotate, x, cos, sin, dout):
    x = x.detach().requires_grad_()
    out = rotate(x, cos, sin)
    return out, torch.autograd.grad(out, x, dout)[0]


def same_bits(a, b) -> bool:
    """a and b hold the same bits, NaNs aside, and NaN in the same places (torch rounds a NaN to
    bfloat16 as 0xFFFF in its vector code, 0x7FC0 in its scalar code, as the kernels do)."""
    nan = a.isnan()
    integers = torch.int16 if a.element_size() == 2 else torch.int32
    return a.dtype == b.dtype and torch.equal(nan, b.isnan()) and torch.equal(a.view(integers)[~nan], b.view(integers)[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [8, 48, 64, 80, 128, 256])
@pytest.mark.parametrize("start_pos", [0, 1000])
def test_output_and_gradient_are_apply_rotary_embs_bit_for_bit(dtype, head_dim, start_pos):
    g = torch.Generator().manual_seed(head_dim)
    args = ModelArgs(dim=head_dim * 3, n_heads=3, max_seq_len=2048)
    cos, sin = rope_cos_sin(args, start_pos, 37)
    x, dout = (torch.randn(2, 37, 3, head_dim, generator=g).to(dtype) for _ in range(2))
    x[1, 5, 2, 7] = float("nan")
    ours = output_and_gradient(torch.ops.llama_mini.rope, x, cos, sin, dout)
    theirs = output_and_gradient(apply_rotary_emb, x, cos, sin, dout)
    for a, b in zip(ours, theirs):
        assert a.dtype == dtype and same_bits(a, b)
    assert ours[0].isnan().sum() == 2  # the NaN reaches its pair, and nothing else


def test_second_order_gradients_are_refused_not_silently_zero():
    cos, sin = rope_cos_sin(ModelArgs(dim=32, n_heads=2), 0, 4)
    x = torch.randn(1, 4, 2, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="cannot be differentiated again; leave use_fused_rope out"):
        torch.autograd.grad(torch.ops.llama_mini.rope(x, cos, sin).pow(2).sum(), x, create_graph=True)


def test_use_fused_rope_swaps_every_attention_keeping_weights_and_names(tmp_path):
    layers = assert_swaps_every(use_fused_rope, Attention, FusedAttention, "attention", tmp_path)
    cos, sin = rope_cos_sin(ModelArgs(dim=64, n_heads=4), 0, 3)
    assert layers[0].rotate(torch.randn(1, 3, 4, 16, requires_grad=True), cos, sin).grad_fn.name() == KERNEL_NODE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [dict(), dict(dim=96, n_heads=2, n_kv_heads=1)], ids=["head-16", "head-48-gqa"])
def test_a_model_with_fused_rope_trains_to_the_plain_models_numbers_bit_for_bit(dtype, shape):
    """Logits and every gradient, on batches of 1, 17 and 64 rows."""
    plain, fused = tiny_model(**shape).train().to(dtype), use_fused_rope(tiny_model(**shape).train().to(dtype))
    assert type(fused.layers[0].attention) is FusedAttention
    for batch, rows in ((1, 1), (3, 17), (2, 64)):
        tokens = torch.randint(0, plain.args.vocab_size, (batch, rows))
        expected, got = plain(tokens), fused(tokens)
        assert torch.equal(got, expected)
        expected.float().square().mean().backward()
        got.float().square().mean().backward()
        for (name, a), b in zip(plain.named_parameters(), fused.parameters()):
            assert torch.equal(b.grad, a.grad), name
        plain.zero_grad(), fused.zero_grad()


def test_torch_compile_traces_the_models_code_in_one_graph():
    """Inductor fuses RoPE by itself; the opaque operator would break the graph."""
    model = use_fused_rope(Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=16)))
    layer = model.layers[0].attention
    cos, sin = rope_cos_sin(model.args, 0, 3)
    x = torch.randn(2, 3, 32)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, cos, sin), Attention.forward(layer, x, cos, sin))


@pytest.mark.parametrize("use, attribute, base", [(use_fused_rope, "attention", Attention), (use_fused_swiglu, "feed_forward", FeedForward)])
def test_where_the_kernels_do_not_run_the_training_fusions_leave_the_model_as_it_is(monkeypatch, use, attribute, base):
    for module in ("fused_rope", "fused_swiglu"):
        monkeypatch.setattr(f"llama_mini.kernels.{module}.operators", lambda: None)  # no AVX2, or no compiler
    model = use(Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=16)))
    assert type(getattr(model.layers[0], attribute)) is base
    monkeypatch.undo()
    on_meta = use(Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=16)).to("meta"))  # not on the CPU
    assert type(getattr(on_meta.layers[0], attribute)) is base


def test_a_head_size_off_a_multiple_of_8_runs_the_models_code():
    model = use_fused_rope(Transformer(ModelArgs(dim=36, n_layers=1, n_heads=3, vocab_size=16)))  # head size 12
    plain = Transformer(ModelArgs(dim=36, n_layers=1, n_heads=3, vocab_size=16))
    plain.load_state_dict(model.state_dict())
    tokens = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(model(tokens), plain(tokens))
