"""The decoding kernels (llama_mini/kernels/matvec.py): each operator against a float64 known
answer, the attention step against the model's own code, a layer's step against its
operators, and a model on the kernels against transformers and through generate.py."""

import copy

import pytest
import torch
import torch.nn.functional as F

from llama_mini import ModelArgs, Transformer, generate, load_checkpoint, save_checkpoint
from llama_mini.kernels import matvec, use_matvec
from llama_mini.kernels.matvec import KernelBlock, MatvecLinear
from llama_mini.quant.layers import quantized_activations
from llama_mini.quant.layout import pack_int8, unpack_int8
from llama_mini.model import KVCache, apply_rotary_emb, rope_cos_sin
from generate_cli_helpers import LLAMA2_TOKENIZER, require, run

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def ops():
    ops = matvec.operators()
    if ops is None:
        pytest.skip("no matrix-vector kernels on this machine (they need x86-64 with AVX2 and FMA)")
    return ops


def close(got, expected, dtype):
    """Within float32 summation-order error, or one bfloat16 rounding of the output."""
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.double(), expected, **tolerance)


# --- Operators against float64 -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n, k", [(1, 4, 16), (1, 37, 200), (3, 64, 768), (16, 9, 40)])  # tails of rows and inputs
@pytest.mark.parametrize("threads", [1, 2])
def test_dense_matches_float64(ops, dtype, rows, n, k, threads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(rows * n + k)
    x, w = torch.randn(rows, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    y = ops.matvec_dense(x, w)
    assert y.dtype == dtype and y.shape == (rows, n)
    close(y, x.double() @ w.double().t(), dtype)
    torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matches_float64_with_activations_rounded_in_blocks_of_32(ops, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2048, generator=g).to(dtype)
    x[0, 7] = 40.0  # one outlier: only its own block's scale grows
    w = torch.randint(-127, 128, (296, 2048), generator=g, dtype=torch.int8)
    w[5] = 127  # the extremes: |w| times x with w's sign must not saturate
    w[6] = -127
    x[1, :32] = -1.0  # a block whose codes are all -127
    scales = (torch.rand(296, generator=g) * 1e-2).to(dtype)
    expected = quantized_activations(x).double() @ (w.double() * scales.double()[:, None]).t()
    close(ops.matvec_int8(x, pack_int8(w), scales), expected, dtype)


def test_the_int8_layout_puts_each_rows_inputs_where_the_kernel_reads_them():
    """Row 8p + j's inputs 4c..4c+3 are bytes 4j..4j+3 of run c of set p (int4's layout is
    tests/quant/test_quantize.py's)."""
    codes = (torch.arange(16 * 64).reshape(16, 64) % 251 - 125).to(torch.int8)
    int8 = pack_int8(codes)
    assert int8.shape == (2, 512) and torch.equal(int8[1, 32 * 3 + 4 * 5: 32 * 3 + 4 * 5 + 4], codes[13, 12:16])
    assert torch.equal(unpack_int8(int8), codes)


def test_wrong_shapes_are_refused_by_the_operators(ops):
    with pytest.raises(RuntimeError, match="input of shape"):
        ops.matvec_dense(torch.randn(1, 10), torch.randn(4, 12))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.matvec_int8(torch.randn(1, 40), torch.zeros(1, 320, dtype=torch.int8), torch.ones(8))
    with pytest.raises(RuntimeError, match="one scale per row"):
        ops.matvec_int8(torch.randn(1, 32), torch.zeros(1, 256, dtype=torch.int8), torch.ones(4))


# --- A decoding step's attention -------------------------------------------------------------------


def reference_step(q, k, v, cache, cos, sin, position):
    """model.py's path: rotate, store in the cache, attend with SDPA (float64)."""
    q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
    keys, values = cache.update(position, k.transpose(1, 2), v.transpose(1, 2))
    repeat = q.shape[2] // k.shape[2]
    out = F.scaled_dot_product_attention(q.transpose(1, 2).double(), keys.double().repeat_interleave(repeat, 1),
                                         values.double().repeat_interleave(repeat, 1))
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (8, 2, 16), (2, 1, 128)])
def test_decode_attention_stores_the_cache_bit_for_bit_and_attends_as_sdpa(ops, dtype, heads, kv_heads, head_dim):
    args = ModelArgs(dim=heads * head_dim, n_heads=heads, n_kv_heads=kv_heads, vocab_size=8, max_seq_len=64)
    g = torch.Generator().manual_seed(heads + head_dim)
    ours, theirs = (KVCache(2, 40, kv_heads, head_dim, "cpu", dtype) for _ in range(2))
    for cache in (ours, theirs):  # earlier positions, the same in both
        cache.k[:, :, :20] = torch.randn(2, kv_heads, 20, head_dim, generator=g).to(dtype)
        cache.v[:, :, :20] = torch.randn(2, kv_heads, 20, head_dim, generator=g).to(dtype)
        g.manual_seed(heads + head_dim)
    for position in (0, 20, 39):
        q = torch.randn(2, 1, heads, head_dim, generator=g).to(dtype)
        k, v = (torch.randn(2, 1, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
        cos, sin = rope_cos_sin(args, position, 1)
        got = ops.decode_attention(q, k, v, ours.k, ours.v, cos, sin, position)
        expected = reference_step(q, k, v, theirs, cos, sin, position)
        assert torch.equal(ours.k, theirs.k) and torch.equal(ours.v, theirs.v)  # RoPE and the write, exactly
        assert got.shape == (2, 1, heads, head_dim) and got.dtype == dtype
        close(got, expected, dtype)


# --- A model on the kernels ------------------------------------------------------------------------


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    fields = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=256)
    return Transformer(ModelArgs(**{**fields, **overrides})).eval()


def test_use_matvec_swaps_every_linear_and_keeps_the_weights(ops):
    model = tiny_model()
    weights = {name: p.data_ptr() for name, p in model.named_parameters()}
    names = list(model.state_dict())
    use_matvec(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is MatvecLinear for m in linears)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == weights  # shared, not copied
    assert all(type(layer) is KernelBlock for layer in model.layers)  # a block's decoding step in one call
    assert list(model.state_dict()) == names  # the checkpoint it saves is the plain model's


def block_step_on_the_operators(ops, block, x, cos, sin, position):
    """TransformerBlock.forward for one decoded position, written out on the kernels: the block's
    own norm and linear modules (which run them), and the attention operator."""
    attention, batch = block.attention, x.shape[0]
    h = block.attention_norm(x)
    q, k, v = (linear(h).view(batch, 1, -1, attention.head_dim) for linear in (attention.wq, attention.wk, attention.wv))
    out = ops.decode_attention(q, k, v, attention.cache.k, attention.cache.v, cos, sin, position)
    h = x + attention.wo(out.view(batch, 1, -1))
    return h + block.feed_forward(block.ffn_norm(h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_a_layers_decoding_step_is_its_operators_bit_for_bit(ops, dtype, quantization):
    from llama_mini.quant import quantize

    model = tiny_model(n_layers=1).to(dtype)
    if quantization:
        quantize(model, quantization)
    use_matvec(model)
    block = model.layers[0]
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        model.setup_cache(2, 32)
        model(torch.randint(0, 128, (2, 12), generator=g), 0)  # a prompt in the cache
        cache = block.attention.cache
        before = cache.k.clone(), cache.v.clone()
        for position in (12, 13):
            x = torch.randn(2, 1, 64, generator=g).to(dtype)
            cos, sin = rope_cos_sin(model.args, position, 1)
            got = matvec.decode_layer(block, x, cos, sin, position)
            after = cache.k.clone(), cache.v.clone()
            cache.k.copy_(before[0]), cache.v.copy_(before[1])
            expected = block_step_on_the_operators(ops, block, x, cos, sin, position)
            assert got is not None and torch.equal(got, expected)
            assert torch.equal(after[0], cache.k) and torch.equal(after[1], cache.v)
            before = after


def test_a_step_past_the_cache_is_left_to_the_models_own_error(ops):
    model = use_matvec(tiny_model())
    model.setup_cache(1, 4)
    with torch.inference_mode(), pytest.raises(ValueError, match="do not fit the KV cache"):
        model(torch.tensor([[3]]), 4)  # decode_layer declines; KVCache.update says what is wrong


def test_a_model_changed_between_generations_decodes_with_its_new_weights(ops):
    """decode_layer gathers a block's weights once per KV cache: quantizing a model after
    use_matvec, then generating (which sets up a new cache), runs the quantized weights."""
    from llama_mini.quant import quantize

    changed, expected = use_matvec(tiny_model()), tiny_model()
    generate(changed, [[1, 2, 3]], 8, temperature=0)
    quantize(changed, "int8")
    use_matvec(changed)  # the quantized layers onto the kernels too
    quantize(expected, "int8")
    use_matvec(expected)
    assert generate(changed, [[1, 2, 3]], 30, temperature=0) == generate(expected, [[1, 2, 3]], 30, temperature=0)
    with torch.inference_mode():
        changed.setup_cache(1, 8), expected.setup_cache(1, 8)
        changed(torch.tensor([[1, 2]]), 0), expected(torch.tensor([[1, 2]]), 0)
        assert torch.equal(changed(torch.tensor([[5]]), 2), expected(torch.tensor([[5]]), 2))


def test_decoding_with_gradients_runs_the_models_own_operations(ops):
    model = use_matvec(tiny_model())
    model.setup_cache(1, 8)
    with torch.no_grad():
        model(torch.tensor([[1, 2]]), 0)
    logits = model(torch.tensor([[5]]), 2)  # grad mode, trainable weights: autograd needs torch's operations
    logits.sum().backward()
    assert model.layers[0].feed_forward.w2.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])  # a norm decode_layer does not take: the blocks' own code runs
def test_decoding_on_the_kernels_gives_the_models_logits(ops, dtype, norm):
    reference = tiny_model(norm=norm).to(dtype)
    fast = use_matvec(copy.deepcopy(reference))
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for model in (reference, fast):
            model.setup_cache(2, 24)
        steps = [(tokens[:, :8], 0)] + [(tokens[:, p:p + 1], p) for p in range(8, 24)]  # a prompt, then 16 steps
        for chunk, position in steps:
            expected, got = reference(chunk, position), fast(chunk, position)
            spread = (expected.amax(-1) - expected.amin(-1)).max()
            assert (got - expected).abs().max() <= (1e-5 if dtype == torch.float32 else 0.03) * spread


def test_training_and_long_prompts_run_torchs_kernels():
    """Gradients flow through a MatvecLinear (torch's F.linear runs), and a prompt longer than
    MAX_ROWS rows is one matrix-matrix product."""
    layer = use_matvec(torch.nn.Sequential(torch.nn.Linear(32, 8, bias=False)))[0]
    x = torch.randn(1, 3, 32, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    with torch.inference_mode():
        long = torch.randn(1, matvec.MAX_ROWS + 1, 32)
        torch.testing.assert_close(layer(long), F.linear(long, layer.weight), rtol=0, atol=0)


def test_greedy_decoding_on_the_kernels_equals_transformers(ops):
    transformers = pytest.importorskip("transformers")
    from llama_mini.formats.hf import hf_config_from_args, to_hf_state_dict

    ours = tiny_model(seed=0)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config_from_args(ours.args))).eval()
    theirs.load_state_dict(to_hf_state_dict(ours.state_dict(), ours.args), strict=False)
    theirs.generation_config.eos_token_id = None  # token 2 is an ordinary token here: nothing stops or is suppressed
    prompt = [1, 17, 42, 99, 5]
    expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False, pad_token_id=0)
    assert generate(use_matvec(ours), [prompt], 60, temperature=0)[0] == expected[0, len(prompt):].tolist()


def test_generate_cli_decodes_on_the_kernels_what_the_model_does(ops, tmp_path):
    """generate.py runs use_matvec: its sampled text is generate()'s on a model on the kernels."""
    from llama_mini.tokenizers import open_tokenizer

    fixture = require(LLAMA2_TOKENIZER)
    model = tiny_model(seed=4, vocab_size=32000, dim=128, n_heads=4, n_kv_heads=4)
    save_checkpoint(model, tmp_path, tokenizer_path=fixture)
    result = run("--ckpt", tmp_path, "--prompt", "Hello", "--max-new-tokens", 40, "--seed", 7)
    assert result.returncode == 0, result.stderr
    tokenizer = open_tokenizer(fixture)
    prompt = tokenizer.encode("Hello")
    fast = use_matvec(load_checkpoint(tmp_path))
    new = generate(fast, [prompt], 40, temperature=0.6, top_p=0.9, eos_id=tokenizer.stop_ids, seed=7)[0]
    assert result.stdout == tokenizer.decode(prompt + new) + "\n"
