"""Fused SwiGLU for training (llama_mini/kernels/fused_swiglu.py): the gate's forward is the
kernels' swiglu, its gradients those of F.silu(a) * b within float rounding (against float64
autograd), each element's computed alike wherever it sits, and a model with it trains as the
plain model does."""

import pytest
import torch
import torch.nn.functional as F

from llama_mini import ModelArgs, Transformer
from llama_mini.kernels import FusedFeedForward, use_fused_swiglu
from llama_mini.kernels.operators import operators
from llama_mini.model import FeedForward
from fixtures import assert_swapped_layers_keep_the_function, assert_swaps_every

KERNEL_NODE = "torch::autograd::CppNode<llama_mini::SwiGLUFunction>"  # kernels/csrc/swiglu_op.cpp

requires_kernels = pytest.mark.skipif(operators() is None, reason="no vector kernels on this machine (x86-64 with AVX2 and FMA)")
pytestmark = requires_kernels


def gradients(a, b, dout):
    a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
    out = torch.ops.llama_mini.swiglu(a, b)
    return (out, *torch.autograd.grad(out, (a, b), dout))


def float64_truth(a, b, dout):
    a, b = a.double().requires_grad_(), b.double().requires_grad_()
    out = F.silu(a) * b
    return (out, *torch.autograd.grad(out, (a, b), dout.double()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradients_are_silu_times_bs_within_rounding_of_float64(dtype):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(20_003, generator=g) * 6).to(dtype)  # exp's ends, and a tail past the eights
    b, dout = torch.randn(20_003, generator=g).to(dtype), torch.randn(20_003, generator=g).to(dtype)
    got, truth = gradients(a, b, dout), float64_truth(a, b, dout)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    for name, x, y in zip(("out", "da", "db"), got, truth):
        assert x.dtype == dtype
        torch.testing.assert_close(x.double(), y, **tolerance, msg=name)
    assert torch.equal(got[0], torch.ops.llama_mini.swiglu(a, b))  # the forward is the inference gate


def test_each_elements_gradients_do_not_depend_on_where_it_sits_or_the_thread_count():
    """So a run resumes exactly, whatever the hidden size or the threads."""
    g = torch.Generator().manual_seed(2)
    a, b, dout = (torch.randn(50_000, generator=g) * 4 for _ in range(3))
    whole = gradients(a, b, dout)
    for start, size in ((3, 1), (5, 7), (1, 17), (100, 172)):
        part = gradients(a[start:start + size], b[start:start + size], dout[start:start + size])
        assert all(torch.equal(x, y[start:start + size]) for x, y in zip(part, whole)), (start, size)
    threads = torch.get_num_threads()
    try:
        for n in (2, 3):
            torch.set_num_threads(n)
            assert all(torch.equal(x, y) for x, y in zip(gradients(a, b, dout), whole)), n
    finally:
        torch.set_num_threads(threads)


def test_a_nan_reaches_both_gradients_as_autograd_gives_it():
    a, b, dout = torch.tensor([float("nan"), 1.0]), torch.tensor([2.0, 3.0]), torch.ones(2)
    _, da, db = gradients(a, b, dout)
    _, ea, eb = float64_truth(a, b, dout)
    torch.testing.assert_close(da.double(), ea, equal_nan=True)
    torch.testing.assert_close(db.double(), eb, equal_nan=True)


def test_second_order_gradients_are_refused_not_silently_zero():
    a, b = torch.randn(8, requires_grad=True), torch.randn(8)
    with pytest.raises(RuntimeError, match="cannot be differentiated again; leave use_fused_swiglu out"):
        torch.autograd.grad(torch.ops.llama_mini.swiglu(a, b).pow(2).sum(), a, create_graph=True)


def test_use_fused_swiglu_swaps_every_feed_forward_keeping_weights_and_names(tmp_path):
    layers = assert_swaps_every(use_fused_swiglu, FeedForward, FusedFeedForward, "feed_forward", tmp_path)
    hidden = layers[0].w1(torch.randn(2, 64))
    assert torch.ops.llama_mini.swiglu(hidden, hidden).grad_fn.name() == KERNEL_NODE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("multiple_of", [32, 1], ids=["hidden-192", "hidden-170"])
def test_a_model_with_the_fused_gate_equals_the_plain_model(dtype, multiple_of):
    """Logits and every gradient, on batches of 1, 17 and 64 rows, at a hidden size a multiple
    of 8 and one that is not."""
    assert_swapped_layers_keep_the_function(use_fused_swiglu, dtype, multiple_of=multiple_of)


def test_torch_compile_traces_the_models_code_in_one_graph():
    """Inductor fuses the gate by itself; the opaque operator would break the graph."""
    model = use_fused_swiglu(Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=16)))
    layer = model.layers[0].feed_forward
    x = torch.randn(3, 32)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), FeedForward.forward(layer, x))
