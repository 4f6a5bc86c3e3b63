"""A GGUF file at its own precision: each quantized matrix becomes an int8 or int4 layer as it is
read (llama_mini/quant/gguf_blocks.py), checked against gguf.quants, llama.cpp's own
dequantization in numpy, and against the same file dequantized to float32."""

import mmap
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from gguf_files import gguf_names, write_gguf
from llama_mini import ModelArgs, Transformer, load_checkpoint, save_checkpoint
from llama_mini.formats.names import from_format
from llama_mini.kernels import on_kernels, use_cpu_kernels, use_fused_rmsnorm
from llama_mini.quant.gguf_blocks import held_bytes, layer_from_blocks
from llama_mini.quant.k_quants import Q5_KLinear, Q6_KLinear, q5_k_codes_and_factors, q6_k_codes_and_scales
from llama_mini.quant.layers import Int4Linear, Int8Linear, QuantizedEmbedding
from llama_mini.quant.mapped_q8_0 import MappedQ8_0Linear

EXACT = {T.Q8_0: Int8Linear, T.Q5_0: Int8Linear, T.Q4_0: Int4Linear, T.Q4_1: Int4Linear, T.Q4_K: Int4Linear,
         T.Q5_K: Q5_KLinear, T.Q6_K: Q6_KLinear}
REQUANTIZED = (T.Q5_1, T.Q2_K, T.Q3_K)
SHAPE = (48, 512)


def blocks_of(kind, shape, seed=0) -> np.ndarray:
    """Blocks of kind for a matrix of shape: gguf's own quantizer of normal weights where it has
    one; else random bytes with each block's 16-bit float scales set to small positive values
    (the rest, codes and sub-block scales, every bit pattern)."""
    generator = np.random.default_rng(seed)
    try:
        return gguf.quants.quantize(generator.standard_normal(shape).astype(np.float32), kind)
    except NotImplementedError:
        pass
    block, size = GGML_QUANT_SIZES[kind]
    data = generator.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    scales = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q2_K: (size - 4, size - 2), T.Q3_K: (size - 2,), T.Q6_K: (size - 2,)}[kind]
    for at in scales:  # d (and dmin): float16 in [1e-3, 1e-2)
        data[..., at : at + 2] = generator.uniform(1e-3, 1e-2, data.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return data.reshape(shape[0], -1)


def files_weights(kind, blocks, shape) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, kind)).view(shape)


@pytest.mark.parametrize("kind", list(EXACT), ids=lambda kind: kind.name)
def test_exact_types_carry_the_files_weights_value_for_value(kind):
    blocks = blocks_of(kind, SHAPE)
    layer = layer_from_blocks(kind, blocks, SHAPE)
    expected = files_weights(kind, blocks, SHAPE)
    assert type(layer) is EXACT[kind]
    if kind == T.Q4_K:  # factored as the file holds them: a 6-bit integer per group, its float16 per super-block
        assert layer.super_group_size == 256 and layer.super_scales.dtype == layer.super_offsets.dtype == torch.float16
        assert layer.scales.dtype == torch.uint8 and layer.scales.max() < 64 and layer.offsets.max() < 64
    elif kind == T.Q6_K:  # the file's bytes themselves, not a copy: an int8 per sub-block of 16, its float16 per super-block
        assert layer.blocks.data_ptr() == blocks.ctypes.data
        assert q6_k_codes_and_scales(layer.blocks)[1].min() == -128 and q6_k_codes_and_scales(layer.blocks)[1].max() == 127
    elif kind == T.Q5_K:  # the file's bytes themselves: 6-bit sc and m per sub-block of 32, every value of them
        assert layer.blocks.data_ptr() == blocks.ctypes.data
        assert all(len(torch.unique(f)) == 64 for f in q5_k_codes_and_factors(layer.blocks)[1:3])
    else:  # the file's own 16-bit floats
        assert layer.scales.dtype == torch.float16
    assert expected.abs().amax() > 0 and torch.equal(layer.dequantize(torch.float32), expected)
    ids = torch.tensor([47, 0, 9, 9, 30])  # looking tokens up dequantizes their rows only, the same values
    assert torch.equal(layer.rows(ids, torch.float32), expected[ids])
    if kind != T.Q8_0:  # every code the type has is used (Q8_0's range is the quantizer's)
        codes = {T.Q6_K: q6_k_codes_and_scales, T.Q5_K: q5_k_codes_and_factors}[kind](layer.blocks)[0] if kind in (T.Q5_K, T.Q6_K) \
            else layer.codes()
        assert len(torch.unique(codes)) == {Int8Linear: 32, Int4Linear: 16, Q5_KLinear: 32, Q6_KLinear: 64}[type(layer)]


@pytest.mark.parametrize("kind", list(EXACT), ids=lambda kind: kind.name)
def test_one_token_of_a_table_of_one_block_a_row_is_the_files_row(kind):
    """A row of 256 inputs is one K-quant block: looking up a single token slices one block of
    one row, which still dequantizes to the file's row."""
    shape = (16, 256)
    blocks = blocks_of(kind, shape)
    table = QuantizedEmbedding(layer_from_blocks(kind, blocks, shape))
    assert torch.equal(table(torch.tensor([[5]])), files_weights(kind, blocks, shape)[[5]][None])


@pytest.mark.parametrize("kind", REQUANTIZED, ids=lambda kind: kind.name)
def test_other_types_are_int8_within_half_a_step_of_the_files_weights(kind):
    blocks = blocks_of(kind, SHAPE)
    layer = layer_from_blocks(kind, blocks, SHAPE)
    expected = files_weights(kind, blocks, SHAPE)
    step = layer.block_scales().repeat_interleave(32, dim=1)
    assert type(layer) is Int8Linear and layer.scales.dtype == torch.bfloat16
    assert ((layer.dequantize(torch.float32) - expected).abs() <= step.float() / 2 * (1 + 1e-5)).all()
    relative = ((layer.dequantize(torch.float32) - expected).pow(2).mean() / expected.pow(2).mean()).sqrt()
    assert 0 < relative < 0.01  # int8 of 5-, 6-bit or coarser weights: under 1% of their rms


@pytest.mark.parametrize("shape", [SHAPE, (20, 256)], ids=["sets of eight rows", "int8 for want of them"])
@pytest.mark.parametrize("kind", [*EXACT, *REQUANTIZED], ids=lambda kind: kind.name)
def test_the_memory_check_counts_the_bytes_each_layer_holds(kind, shape):
    """held_bytes, which the memory check adds up before any block is converted, is what the layer holds."""
    layer = layer_from_blocks(kind, blocks_of(kind, shape), shape)
    assert held_bytes(kind, shape) == sum(t.numel() * t.element_size() for t in layer.buffers())


def test_a_q4_0_layer_holds_no_offsets_and_computes_past_float16s_range():
    """Q4_0's offset is -8 d: held by none (4.5 bits a weight, the file's), computed in float32,
    so a block with d over 8188, whose -8 d a float16 offset could not hold, keeps its weights."""
    blocks = blocks_of(T.Q4_0, SHAPE)
    blocks.reshape(SHAPE[0], -1, 18)[3, 2, :2] = np.array([9000.0], np.float16).view(np.uint8)  # -8 d: -72000
    layer = layer_from_blocks(T.Q4_0, blocks, SHAPE)
    assert layer.symmetric and "offsets" not in dict(layer.named_buffers())
    assert held_bytes(T.Q4_0, SHAPE) * 8 == 4.5 * SHAPE[0] * SHAPE[1]
    expected = files_weights(T.Q4_0, blocks, SHAPE)
    assert expected.abs().amax() >= 9000 * 7 and torch.equal(layer.dequantize(torch.float32), expected)


def test_a_matrix_without_sets_of_eight_rows_takes_int8_exactly_for_q4_0():
    shape = (20, 64)
    blocks = blocks_of(T.Q4_0, shape)
    layer = layer_from_blocks(T.Q4_0, blocks, shape)
    assert type(layer) is Int8Linear and (layer.dequantize() - files_weights(T.Q4_0, blocks, shape)).abs().amax() < 0.1


def test_rows_are_converted_a_chunk_at_a_time_as_whole(monkeypatch):
    """A chunk of 8 rows at a time gives the layer of the whole matrix at once."""
    import llama_mini.quant.layers as layers

    blocks = blocks_of(T.Q4_K, SHAPE)
    whole = layer_from_blocks(T.Q4_K, blocks, SHAPE)
    monkeypatch.setattr(layers, "CHUNK_ELEMENTS", 1)
    chunked = layer_from_blocks(T.Q4_K, blocks, SHAPE)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), chunked.state_dict().values()))


def kernels_converter():
    from llama_mini.kernels.gguf_blocks import gguf_converter

    converter = gguf_converter()
    if converter is None:
        pytest.skip("no CPU kernels on this machine")
    return converter


def random_blocks(kind, shape, seed=1) -> np.ndarray:
    """Every byte random: codes, sub-block scales, and 16-bit float scales of every bit pattern
    (infinities, NaNs and subnormals among them)."""
    block, size = GGML_QUANT_SIZES[kind]
    return np.random.default_rng(seed).integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8)


def same_bytes(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two layers hold the same buffers, bit for bit (NaNs' payloads too)."""
    pairs = list(zip(a.state_dict().items(), b.state_dict().items(), strict=True))
    return all(na == nb and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for (na, x), (nb, y) in pairs)


@pytest.mark.parametrize("shape", [(48, 512), (8, 256), (72, 1280)], ids=str)
@pytest.mark.parametrize("kind", list(EXACT), ids=lambda kind: kind.name)
def test_the_kernels_convert_each_type_to_the_bytes_torchs_converters_make(kind, shape):
    """The kernels' converter (kernels/gguf_blocks.py) is the torch converters here, faster: the
    same layer bit for bit, from a quantizer's blocks and from blocks of random bytes. A Q8_0
    matrix the kernels read where the file maps it: the same int8 layer's state."""
    converter = kernels_converter()
    for blocks in (blocks_of(kind, shape), random_blocks(kind, shape)):
        expected, got = layer_from_blocks(kind, blocks, shape), layer_from_blocks(kind, blocks, shape, converter)
        assert type(got) is (MappedQ8_0Linear if kind == T.Q8_0 else EXACT[kind]) and same_bytes(got, expected)
    got = layer_from_blocks(kind, blocks_of(kind, shape), shape, converter)
    assert torch.equal(got.dequantize(torch.float32), files_weights(kind, blocks_of(kind, shape), shape))


def test_the_kernels_leave_what_they_do_not_convert_to_torchs_converters():
    """A type without a kernel converter (Q5_1), and a matrix without sets of eight rows, are
    converted by torch's code: the layers it makes, untouched."""
    converter = kernels_converter()
    for kind, shape in ((T.Q5_1, SHAPE), (T.Q4_K, (20, 256)), (T.Q8_0, (20, 64))):
        blocks = blocks_of(kind, shape)
        assert same_bytes(layer_from_blocks(kind, blocks, shape, converter), layer_from_blocks(kind, blocks, shape))


def test_an_edited_converter_runs_as_edited_with_the_kernels_converter_left_off(monkeypatch, caplog):
    """The kernels' converter is written for quant/gguf_blocks.py's: a reader who edits one (here
    Q4_K's, its mins negated) gets the edited conversion, and one line naming it."""
    import logging

    import llama_mini.quant.gguf_blocks as gguf_blocks
    from llama_mini.kernels import fingerprints
    from llama_mini.kernels.gguf_blocks import gguf_converter

    kernels_converter()
    blocks = blocks_of(T.Q4_K, SHAPE)
    unedited = layer_from_blocks(T.Q4_K, blocks, SHAPE)
    q4_k = gguf_blocks._q4_k
    edited = lambda rows, k: (*q4_k(rows, k)[:4], q4_k(rows, k)[4].neg())  # noqa: E731
    monkeypatch.setattr(gguf_blocks, "_q4_k", edited)
    monkeypatch.setitem(gguf_blocks._INT4, T.Q4_K, edited)
    fingerprints.notice_changed.cache_clear()
    caplog.set_level(logging.WARNING, logger="llama_mini")
    layer = layer_from_blocks(T.Q4_K, blocks, SHAPE, gguf_converter())
    assert gguf_converter() is None and torch.equal(layer.super_offsets, unedited.super_offsets.neg())
    assert any("_q4_k in llama_mini/quant/gguf_blocks.py" in r.getMessage() and "left off" in r.getMessage() for r in caplog.records)
    fingerprints.notice_changed.cache_clear()


# --- A whole file ----------------------------------------------------------------------------

ARGS = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, hidden_dim=512, max_seq_len=64)
# Q4_K_M's mix (Q4_K, Q6_K for the head and half of attn_v and ffn_down), with every other type once.
TYPES = {
    "token_embd.weight": T.Q4_K, "output.weight": T.Q6_K,
    "blk.0.attn_q.weight": T.Q4_K, "blk.0.attn_k.weight": T.Q4_K, "blk.0.attn_v.weight": T.Q6_K,
    "blk.0.attn_output.weight": T.Q4_K, "blk.0.ffn_gate.weight": T.Q4_K, "blk.0.ffn_down.weight": T.Q6_K,
    "blk.0.ffn_up.weight": T.Q4_K, "blk.1.attn_q.weight": T.Q8_0, "blk.1.attn_k.weight": T.Q4_0,
    "blk.1.attn_v.weight": T.Q4_1, "blk.1.attn_output.weight": T.Q5_0, "blk.1.ffn_gate.weight": T.Q5_K,
    "blk.1.ffn_down.weight": T.F16, "blk.1.ffn_up.weight": T.Q3_K,
}
PROMPT = torch.tensor([[1, 5, 90, 17, 250, 33, 7, 100, 3, 3, 200, 41]])


def write_file(path, types, args=ARGS):
    torch.manual_seed(0)  # the float matrices: the same file in every run
    tensors = {}
    for i, (name, array) in enumerate(gguf_names(Transformer(args)).items()):
        kind = types.get(name, T.F32)
        if kind == T.F32:
            tensors[name] = (array if array.ndim == 2 else np.random.default_rng(i).uniform(0.5, 1.5, array.shape)
                             .astype(np.float32), kind)
        elif kind == T.F16:
            tensors[name] = (array.astype(np.float16), kind)
        else:
            tensors[name] = (blocks_of(kind, array.shape, seed=i), kind)
    return write_gguf(path, args, tensors), tensors


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    return write_file(tmp_path_factory.mktemp("blocks") / "model-Q4_K_M.gguf", TYPES)


def test_a_quantized_file_loads_at_its_own_precision_without_flags(q4_k_m):
    path, tensors = q4_k_m
    model = load_checkpoint(path)
    for name, (_, kind) in tensors.items():
        ours = from_format(name, "gguf").removesuffix(".weight")
        layer = model.get_submodule(ours)
        if ours == "tok_embeddings":
            assert isinstance(layer, QuantizedEmbedding) and type(layer.table) is Int4Linear
        elif kind in EXACT:
            assert type(layer) is EXACT[kind], name
        elif kind in REQUANTIZED:
            assert type(layer) is Int8Linear, name
        elif layer.weight.dim() == 2:  # F16 and F32 matrices stay float
            assert type(layer) is torch.nn.Linear and layer.weight.dtype == torch.float32, name
    assert model.quantization["method"] == "gguf" and "Q4_K as int4" in model.quantization["held"]
    assert all(not t.is_meta for t in (*model.parameters(), *model.buffers()))


@pytest.mark.parametrize("kernels", ["auto", "off"])
def test_generate_converts_a_files_blocks_by_the_kernels_where_they_run_to_the_same_layers(q4_k_m, kernels, monkeypatch):
    """generate.py's and evaluate's load (inference.loading.load_model) converts every type the
    kernels' converter takes by it, with --kernels off by torch's: the same layers either way."""
    import argparse

    import llama_mini.kernels.gguf_blocks as kernel_blocks
    from llama_mini.inference.loading import load_model
    from llama_mini.quant import hold_plain_rows

    if kernels == "auto":
        kernels_converter()
    path, tensors = q4_k_m
    converted, convert = [], kernel_blocks.convert
    monkeypatch.setattr(kernel_blocks, "convert", lambda kind, blocks, layer: converted.append(kind) or convert(kind, blocks, layer))
    flags = argparse.Namespace(device="cpu", dtype=None, quantize=None, kernels=kernels, compile=False)
    tokenizer = argparse.Namespace(model_path=None, n_words=ARGS.vocab_size)
    model, expected = load_model(flags, path, "gguf", tokenizer), load_checkpoint(path)
    # Q8_0's rows and Q6_K's blocks are read where the file maps them, converted by none
    assert set(converted) == ({kind for _, kind in tensors.values()} - {T.F32, T.F16, T.Q8_0, T.Q5_K, T.Q6_K} if kernels == "auto" else set())
    if kernels == "off":
        hold_plain_rows(expected)  # as load_model holds layers off the kernels
    assert same_bytes(model, expected)


def test_each_layer_holds_the_files_weights(q4_k_m):
    path, tensors = q4_k_m
    model = load_checkpoint(path)
    for name, (stored, kind) in tensors.items():
        ours = from_format(name, "gguf").removesuffix(".weight")
        if kind not in EXACT:
            continue
        layer = model.get_submodule(ours)
        layer = layer.table if isinstance(layer, QuantizedEmbedding) else layer
        assert torch.equal(layer.dequantize(), files_weights(kind, stored, layer.dequantize().shape)), name


def test_looking_up_tokens_gives_the_files_embedding_rows(q4_k_m):
    path, tensors = q4_k_m
    table = files_weights(T.Q4_K, tensors["token_embd.weight"][0], (ARGS.vocab_size, ARGS.dim))
    embedding = load_checkpoint(path).tok_embeddings
    assert torch.equal(embedding(PROMPT), table[PROMPT])
    embedding.table.hold_plain_rows()  # as off the kernels
    assert torch.equal(embedding(PROMPT), table[PROMPT])


@pytest.mark.parametrize("kind", [T.Q6_K, T.Q5_K, T.Q4_K, T.Q8_0], ids=lambda kind: kind.name)
def test_a_prompts_tokens_are_looked_up_a_few_rows_at_a_time_to_the_files_rows(kind, monkeypatch):
    """A 256-token chunk and a batch of two 70-token prompts: the file's rows, in the tokens'
    order, dequantized LOOKUP_ROWS tokens at a time (each token's set of eight rows unpacked
    for all 256 at once held more temporaries than the layer's activations)."""
    from llama_mini.quant.layers import LOOKUP_ROWS, QuantizedEmbedding

    shape = (256, 512)
    blocks = blocks_of(kind, shape)
    embedding, table = QuantizedEmbedding(layer_from_blocks(kind, blocks, shape)), files_weights(kind, blocks, shape)
    sizes, rows = [], embedding.table.rows
    monkeypatch.setattr(embedding.table, "rows", lambda ids, dtype: sizes.append(len(ids)) or rows(ids, dtype))
    generator = torch.Generator().manual_seed(0)
    for tokens in (torch.randint(0, 256, (1, 256), generator=generator), torch.randint(0, 256, (2, 70), generator=generator)):
        sizes.clear()
        looked_up = embedding(tokens)
        assert looked_up.shape == (*tokens.shape, 512) and torch.equal(looked_up, table[tokens])
        assert max(sizes) == LOOKUP_ROWS and sum(sizes) == tokens.numel()


def test_logits_are_the_dequantized_files_to_within_the_activations_rounding(q4_k_m):
    """The integer layers round their inputs to int8 in blocks of 32 (llama.cpp's Q8_0
    activations), the K-quants' in blocks of 256 (its Q8_K): the logits are the float32 model's to
    within that (on this file of random weights 6.4% of their spread; 2.3% with Q4_K's in blocks
    of 32, 1.3% with every layer's; the same top token either way), and on the CPU kernels
    they are model.py's own code's to float tolerance, but for an input the two round to
    neighbouring codes (the kernels' sums differ from torch's in the last bits, and now and then
    that tips a rounding: a code one apart, in one position's logits)."""
    blocks, dequantized = load_checkpoint(q4_k_m[0]), load_checkpoint(q4_k_m[0], dtype=torch.float32)
    with torch.inference_mode():
        ours, reference = blocks(PROMPT), dequantized(PROMPT)
        assert ((ours - reference).pow(2).mean() / reference.var()).sqrt() < 0.08
        assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
        fast = use_cpu_kernels(use_fused_rmsnorm(blocks))
        if on_kernels(fast):
            kernels = fast(PROMPT)
            assert ((kernels - ours).pow(2).mean() / ours.var()).sqrt() < 1e-3
            close = torch.isclose(kernels, ours, rtol=1e-4, atol=1e-4 * ours.abs().amax().item()).all(-1)
            assert close.sum() >= close.numel() - 1, close  # every position but at most one to float tolerance


def test_a_tied_head_is_the_embeddings_table_one_copy(tmp_path):
    args = ModelArgs(**{**ARGS.__dict__, "tie_embeddings": True})
    path, tensors = write_file(tmp_path / "tied.gguf", {name: T.Q8_0 for name in TYPES if name != "output.weight"}, args)
    model = load_checkpoint(path)
    assert model.output is model.tok_embeddings.table and type(model.output) is Int8Linear
    with torch.inference_mode():
        assert torch.equal(model.tok_embeddings(PROMPT), model.output.dequantize()[PROMPT])


def test_dtype_or_quantize_still_dequantize(q4_k_m):
    assert load_checkpoint(q4_k_m[0], dtype=torch.bfloat16).output.weight.dtype == torch.bfloat16
    assert load_checkpoint(q4_k_m[0], quantize="int8").quantization["method"] == "int8"


def test_loading_draws_no_initial_weights_on_the_meta_device(q4_k_m, tmp_path):
    """A model is built on the meta device to be loaded into. Drawing its initial weights there
    sets nothing, and torch's first normal_ on a meta tensor imports its Python decompositions
    (torch._dynamo among 800-odd modules): about a second and 70 MB of every load, skipped. Fails
    with the draws made (state_dict.empty_model without its mode)."""
    import subprocess
    import sys

    save_checkpoint(Transformer(ARGS), tmp_path / "native")
    code = ("import sys; from llama_mini import load_checkpoint\n"
            "for path in sys.argv[1:]: load_checkpoint(path)\n"
            "print('torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code, str(q4_k_m[0]), str(tmp_path / "native")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "False"


@pytest.mark.parametrize("tied", [False, True], ids=["own head", "tied head"])
def test_a_native_checkpoint_holds_each_layer_as_the_file_held_it(tmp_path, tied):
    """convert --to native keeps the file's precision: the same layers and tensors, bit for bit,
    in about the file's size, and the same logits; --init-from starts from the same dequantized
    weights as from the file."""
    from llama_mini.formats.convert import convert
    from llama_mini.quant import dequantize

    args = ModelArgs(**{**ARGS.__dict__, "tie_embeddings": tied})
    types = {name: kind for name, kind in TYPES.items() if not (tied and name == "output.weight")}
    path, _ = write_file(tmp_path / "m.gguf", types, args)
    convert(path, tmp_path / "native", "native")
    held, native = load_checkpoint(path), load_checkpoint(tmp_path / "native")
    assert native.quantization == held.quantization and len(native.quantization["layers"]) == len(types) - 1  # F16 stays float
    assert {n: type(m) for n, m in native.named_modules()} == {n: type(m) for n, m in held.named_modules()}
    assert native.state_dict().keys() == held.state_dict().keys()
    assert all(torch.equal(t, held.state_dict()[name]) and t.dtype == held.state_dict()[name].dtype
               for name, t in native.state_dict().items())
    assert (native.output is native.tok_embeddings.table) == tied
    stored = (tmp_path / "native" / "model.safetensors").stat().st_size
    assert stored < 1.15 * sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in held.state_dict().values()}.values())
    with torch.inference_mode():
        assert torch.equal(native(PROMPT), held(PROMPT))
    from_native = dequantize(load_checkpoint(tmp_path / "native", dtype=torch.float32)).state_dict()  # as --init-from takes it
    layers = {name: layer.dequantize(torch.float32) for name, layer in held.named_modules() if hasattr(layer, "dequantize")}
    assert torch.equal(from_native["tok_embeddings.weight"], layers["tok_embeddings.table"])
    assert all(torch.equal(from_native[name + ".weight"], weight) for name, weight in layers.items() if name != "tok_embeddings.table")


def test_a_native_checkpoint_converted_before_holding_float32_super_scales_computes_the_same(q4_k_m, tmp_path):
    """Checkpoints converted before held the K-quants' super-block scales as float32, the same
    values the file's float16 ones are now held as: loaded as they are, on the kernels and off,
    they give the file's logits."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from llama_mini.formats.convert import convert

    convert(q4_k_m[0], tmp_path / "native", "native")
    weights = tmp_path / "native" / "model.safetensors"
    with safe_open(weights, "pt") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    supers = [name for name in tensors if name.endswith(("super_scales", "super_offsets"))]
    assert supers and all(tensors[name].dtype == torch.float16 for name in supers)
    save_file({name: t.float() if name in supers else t for name, t in tensors.items()}, weights, metadata)
    older, held = load_checkpoint(tmp_path / "native"), load_checkpoint(q4_k_m[0])
    assert all(older.get_submodule(name.rsplit(".", 1)[0]).get_buffer(name.rsplit(".", 1)[1]).dtype == torch.float32
               for name in supers)
    with torch.inference_mode():
        assert torch.equal(older(PROMPT), held(PROMPT))
        use_cpu_kernels(use_fused_rmsnorm(older)), use_cpu_kernels(use_fused_rmsnorm(held))
        assert on_kernels(older) == on_kernels(held) and torch.equal(older(PROMPT), held(PROMPT))


def test_a_native_record_that_does_not_fit_its_model_is_refused_in_one_line(q4_k_m, tmp_path):
    import json

    from llama_mini.formats.convert import convert

    convert(q4_k_m[0], tmp_path / "native", "native")
    config = tmp_path / "native" / "config.json"
    fields = json.loads(config.read_text())
    for edit, message in ((lambda q: q["layers"].update({"layers.9.attention.wq": q["layers"]["output"]}), "not a matrix of this model"),
                          (lambda q: q["layers"]["output"].update(layer="int3"), "a record of a GGUF file's layers that llama_mini does not know"),
                          # checkpoints of llama_mini 0.3.0 before Q6_K and Q5_K were held as the file's blocks: convert the file again
                          (lambda q: q["layers"]["output"].update(layer="int6"), "a record of a GGUF file's layers that llama_mini does not know"),
                          (lambda q: q["layers"]["output"].update(layer="int5"), "a record of a GGUF file's layers that llama_mini does not know"),
                          (lambda q: q["layers"]["layers.0.attention.wq"].update(super_group_size=0), "does not fit the config")):
        record = json.loads(json.dumps(fields))
        edit(record["quantization"])
        config.write_text(json.dumps(record))
        with pytest.raises(ValueError, match=message):
            load_checkpoint(tmp_path / "native")
    for format in ("hf", "meta"):
        with pytest.raises(ValueError, match="saved in the native format only"):
            save_checkpoint(load_checkpoint(q4_k_m[0]), tmp_path / format, format=format)



def test_off_the_kernels_the_notice_names_the_files_blocks_not_a_flag(q4_k_m, monkeypatch):
    from llama_mini.quant import quantized_notice

    monkeypatch.setattr("llama_mini.quant.quantized_slowdown", lambda layer: 12.0)
    notice = quantized_notice(load_checkpoint(q4_k_m[0]), None)
    assert notice.startswith("note: here int4 layers take 12x the time of float ones") and "--quantize" not in notice
    assert "the file's int4 blocks save memory, not time (--dtype float32 spends the memory instead)" in notice


@pytest.mark.parametrize("kind", [T.Q5_K, T.Q6_K], ids=lambda kind: kind.name)
def test_the_notice_of_q5_k_and_q6_k_promises_nothing_of_compile(kind, monkeypatch):
    """Compiled, int8 and int4 layers read their codes in one pass (quant/layers.py one_row); Q5_K
    and Q6_K dequantize each step compiled or not, so their notice does not offer --compile."""
    from llama_mini.quant import quantized_notice

    monkeypatch.setattr("llama_mini.quant.quantized_slowdown", lambda layer: 12.0)
    model = torch.nn.Sequential(layer_from_blocks(kind, blocks_of(kind, SHAPE), SHAPE))
    method = kind.name
    assert quantized_notice(model, None) == (f"note: here {method} layers take 12x the time of float ones in a decoding step "
                                             f"(off the CPU kernels each step dequantizes them): the file's {method} blocks save "
                                             "memory, not time (--dtype float32 spends the memory instead)")
    assert quantized_notice(model, None, compiled=True).startswith(f"note: compiled, {method} layers still dequantize")


@pytest.mark.parametrize("kind", [T.Q5_K, T.Q6_K], ids=lambda kind: kind.name)
def test_an_edited_q5_k_or_q6_k_definition_runs_as_edited_with_the_kernel_left_off(kind, monkeypatch, caplog):
    """The K-quant kernel computes the layers' dequantized weights as k_quants.py holds them: a
    reader who edits that code gets the edited function, and one line naming it."""
    import logging

    from llama_mini.kernels import fingerprints
    from llama_mini.kernels.operators import operators

    if operators() is None:
        pytest.skip("no CPU kernels on this machine")
    cls = EXACT[kind]
    layer = layer_from_blocks(kind, blocks_of(kind, SHAPE), SHAPE)
    x = torch.randn(3, SHAPE[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        unedited = use_cpu_kernels(torch.nn.Sequential(layer))[0](x)
    layer.__class__ = cls
    weights = cls.weights
    monkeypatch.setattr(cls, "weights", lambda self, *args: weights(self, *args) * 0.5)
    fingerprints.notice_changed.cache_clear()
    caplog.set_level(logging.WARNING, logger="llama_mini")
    fast = use_cpu_kernels(torch.nn.Sequential(layer))[0]
    with torch.inference_mode():
        got = fast(x)
    assert type(fast) is cls and torch.allclose(got, unedited * 0.5, rtol=1e-4, atol=1e-4)
    assert any(f"{cls.__name__}.weights in llama_mini/quant/k_quants.py" in r.getMessage() and "left off" in r.getMessage()
               for r in caplog.records)
    fingerprints.notice_changed.cache_clear()


def test_an_edited_q4_0_offset_runs_as_edited_with_the_int4_kernel_left_off(monkeypatch, caplog):
    """The int4 kernel computes a symmetric layer's offsets as -8 times its scales, as
    Int4Linear.symmetric_offsets does: edit that, and the layer runs the edit, said in one line."""
    import logging

    from llama_mini.kernels import fingerprints
    from llama_mini.kernels.operators import operators
    from llama_mini.quant.layers import quantized_activations

    if operators() is None:
        pytest.skip("no CPU kernels on this machine")
    layer = layer_from_blocks(T.Q4_0, blocks_of(T.Q4_0, SHAPE), SHAPE)
    x = torch.randn(3, SHAPE[1], generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(Int4Linear, "symmetric_offsets", staticmethod(lambda scales: scales.float() * -7))
    fingerprints.notice_changed.cache_clear()
    caplog.set_level(logging.WARNING, logger="llama_mini")
    fast = use_cpu_kernels(torch.nn.Sequential(layer))[0]
    with torch.inference_mode():
        got, edited = fast(x), quantized_activations(x) @ layer.dequantize(torch.float32).t()
    assert type(fast) is Int4Linear and torch.allclose(got, edited, rtol=1e-4, atol=1e-4)
    assert (layer.dequantize(torch.float32) - files_weights(T.Q4_0, blocks_of(T.Q4_0, SHAPE), SHAPE)).abs().amax() > 0
    assert any("Int4Linear.symmetric_offsets in llama_mini/quant/layers.py" in r.getMessage() and "left off" in r.getMessage()
               for r in caplog.records)
    fingerprints.notice_changed.cache_clear()


def test_the_memory_the_layers_will_hold_is_checked_before_any_is_made(q4_k_m, monkeypatch):
    """The check asks for what the loaded model holds: one byte less free is refused in one line
    before any block is converted; exactly that much loads."""
    import llama_mini.formats.gguf as gguf_format
    from llama_mini.support import memory

    model = load_checkpoint(q4_k_m[0])
    held = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}.values())
    monkeypatch.setattr(memory, "free_bytes", lambda device: held - 1)
    with monkeypatch.context() as m:
        m.setattr(gguf_format, "layer_from_blocks", lambda *a: pytest.fail("a block was converted before the check"))
        with pytest.raises(ValueError, match="model-Q4_K_M.gguf at its own precision needs at least .* and cpu has .* free"):
            load_checkpoint(q4_k_m[0])
    monkeypatch.setattr(memory, "free_bytes", lambda device: held)
    assert load_checkpoint(q4_k_m[0]).quantization["method"] == "gguf"


@pytest.mark.parametrize("flag, held", [(None, torch.float16), ("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_a_gguf_files_kv_cache_is_float16_as_llama_cpps_unless_kv_cache_names_another(q4_k_m, tmp_path, flag, held, capsys):
    """generate.py keeps a GGUF file's keys and values in float16, llama.cpp's default (half
    the bytes a long context's decoding step reads), says so on its loading line, and takes
    --kv-cache; other checkpoints keep them in the model's dtype unless --kv-cache says."""
    import argparse

    from llama_mini.inference.loading import load_model

    flags = argparse.Namespace(device="cpu", dtype=None, quantize=None, kernels="auto", compile=False)
    tokenizer = argparse.Namespace(model_path=None, n_words=ARGS.vocab_size)
    model = load_model(flags, q4_k_m[0], "gguf", tokenizer, kv_cache=flag)
    model.setup_cache(1, 8)
    assert model.layers[0].attention.cache.k.dtype == held
    assert f"a {str(held).removeprefix('torch.')} KV cache, cpu" in capsys.readouterr().err
    save_checkpoint(Transformer(ARGS), tmp_path / "native")
    native = load_model(flags, tmp_path / "native", "native", tokenizer, kv_cache=flag)
    assert native.kv_dtype() == (torch.float32 if flag is None else held)
    assert ("KV cache" in capsys.readouterr().err) == (flag is not None)


# --- Q8_0 read where the file maps it ----------------------------------------------------------


def q8_0_blocks(shape, seed=2) -> np.ndarray:
    """Q8_0 rows of random bytes (every code, -128 too) with small positive float16 scales."""
    data = random_blocks(T.Q8_0, shape, seed).reshape(shape[0], -1, 34)
    data[..., :2] = np.random.default_rng(seed).uniform(1e-3, 1e-2, data.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return data.reshape(shape[0], -1)


def test_on_the_kernels_a_q8_0_file_runs_from_its_mapped_bytes(tmp_path):
    """generate.py's load (load_model) on the kernels: each Q8_0 matrix, the tied embedding and
    head too, is the file's own bytes where it is mapped (none written to memory of the
    process's own), its pages mapped as the model loads, and the layers compute what the int8
    layers of --kernels off do."""
    import argparse

    from llama_mini.inference.loading import load_model
    from llama_mini.kernels.linear import KernelMappedQ8_0Linear
    from llama_mini.support.memory import _in_a_file_mapping

    kernels_converter()
    args = ModelArgs(**{**ARGS.__dict__, "tie_embeddings": True})
    path, tensors = write_file(tmp_path / "tied-Q8_0.gguf", {name: T.Q8_0 for name in TYPES if name != "output.weight"}, args)
    tokenizer = argparse.Namespace(model_path=None, n_words=ARGS.vocab_size)
    flags = {kernels: argparse.Namespace(device="cpu", dtype=None, quantize=None, kernels=kernels, compile=False)
             for kernels in ("auto", "off")}
    mapped = load_model(flags["auto"], path, "gguf", tokenizer)
    head = mapped.output.blocks
    if sys.platform.startswith("linux"):  # mapped while loading, as llama.cpp maps its file: no forward has read them
        q8_0_bytes = sum(stored.nbytes for stored, kind in tensors.values() if kind == T.Q8_0)
        assert resident_bytes_of_mapping(head.data_ptr()) >= q8_0_bytes
    models = {"auto": mapped, "off": load_model(flags["off"], path, "gguf", tokenizer)}
    assert on_kernels(mapped) and mapped.output is mapped.tok_embeddings.table
    for name, (stored, kind) in tensors.items():
        if kind != T.Q8_0:
            continue
        layer = mapped.get_submodule(from_format(name, "gguf").removesuffix(".weight"))
        layer = layer.table if isinstance(layer, QuantizedEmbedding) else layer
        assert type(layer) is KernelMappedQ8_0Linear and torch.equal(layer.blocks, torch.from_numpy(stored)), name
        assert _in_a_file_mapping(layer.blocks.data_ptr(), layer.blocks.data_ptr() + layer.blocks.numel()), name
    assert same_bytes(mapped, models["off"])
    with torch.inference_mode():
        mapped.setup_cache(1, 32), models["off"].setup_cache(1, 32)
        ours, theirs = mapped(PROMPT), models["off"](PROMPT)
    assert ((ours - theirs).pow(2).mean() / theirs.var()).sqrt() < 1e-3


@pytest.mark.parametrize("kind", [T.Q5_K, T.Q6_K], ids=lambda kind: kind.name)
def test_a_k_quant_file_runs_from_its_mapped_bytes_on_the_kernels_and_off(tmp_path, kind):
    """A Q5_K or Q6_K matrix, the tied embedding and head too, is the file's own bytes where it is
    mapped, kernels or not (k_quants.py: nothing converted, none written to memory of the process's own),
    its pages mapped as the model loads; on the kernels the model computes what --kernels off
    does, and a native checkpoint holds the same blocks."""
    import argparse

    from llama_mini.formats.convert import convert
    from llama_mini.inference.loading import load_model
    from llama_mini.kernels.linear import LINEAR_KERNELS
    from llama_mini.support.memory import _in_a_file_mapping

    kernels_converter()
    args = ModelArgs(**{**ARGS.__dict__, "tie_embeddings": True})
    path, tensors = write_file(tmp_path / f"tied-{kind.name}.gguf", {name: kind for name in TYPES if name != "output.weight"}, args)
    tokenizer = argparse.Namespace(model_path=None, n_words=ARGS.vocab_size)
    models = {kernels: load_model(argparse.Namespace(device="cpu", dtype=None, quantize=None, kernels=kernels, compile=False), path,
                                  "gguf", tokenizer) for kernels in ("auto", "off")}
    if sys.platform.startswith("linux"):  # mapped while loading, as llama.cpp maps its file: no forward has read them
        k_quant_bytes = sum(stored.nbytes for stored, stored_kind in tensors.values() if stored_kind == kind)
        assert resident_bytes_of_mapping(models["auto"].output.blocks.data_ptr()) >= k_quant_bytes
    assert on_kernels(models["auto"]) and models["auto"].output is models["auto"].tok_embeddings.table
    for kernels, model in models.items():
        for name, (stored, stored_kind) in tensors.items():
            if stored_kind != kind:
                continue
            layer = model.get_submodule(from_format(name, "gguf").removesuffix(".weight"))
            layer = layer.table if isinstance(layer, QuantizedEmbedding) else layer
            assert type(layer) is (LINEAR_KERNELS[EXACT[kind]] if kernels == "auto" else EXACT[kind]), name
            assert torch.equal(layer.blocks.flatten(1), torch.from_numpy(stored)), name
            assert _in_a_file_mapping(layer.blocks.data_ptr(), layer.blocks.data_ptr() + layer.blocks.numel()), name
    assert same_bytes(models["auto"], models["off"])
    with torch.inference_mode():
        for model in models.values():
            model.setup_cache(1, 32)
        ours, theirs = models["auto"](PROMPT), models["off"](PROMPT)
    assert ((ours - theirs).pow(2).mean() / theirs.var()).sqrt() < 1e-3
    convert(path, tmp_path / "native", "native")
    native = load_checkpoint(tmp_path / "native")
    assert {record["layer"] for record in native.quantization["layers"].values()} == {kind.name.lower()}
    assert same_bytes(native, models["off"])


def test_after_loading_the_process_holds_no_page_of_the_file_but_its_mapped_layers(tmp_path):
    """Loading copies out what it converts (here the Q4_0 matrices) and the norms, and lets their
    pages go; the layers that read the file where it is mapped (here the Q6_K head) keep theirs.
    Reading one page maps the whole folio of the page cache around it, megabytes on recent
    kernels, so a forward that read a norm where it lay brought its neighbours back (a 110M Q4_0
    file peaked 1.5x its size, where its layers hold 1.0x): now a forward leaves the file's
    resident bytes at the head's."""
    import argparse

    from llama_mini.inference.loading import load_model

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/smaps")
    args = ModelArgs(**{**ARGS.__dict__, "n_layers": 8})
    names = gguf_names(Transformer(args))
    types = {name: T.Q4_0 for name, array in names.items() if array.ndim == 2} | {"output.weight": T.Q6_K}
    path, tensors = write_file(tmp_path / "Q4_0.gguf", types, args)
    flags = argparse.Namespace(device="cpu", dtype=None, quantize=None, kernels="auto", compile=False)
    model = load_model(flags, path, "gguf", argparse.Namespace(model_path=None, n_words=args.vocab_size))
    with torch.inference_mode():
        model.setup_cache(1, 32)
        model(PROMPT)
    head = tensors["output.weight"][0].nbytes
    assert head <= resident_bytes_of_mapping(model.output.blocks.data_ptr()) <= head + 2 * mmap.PAGESIZE


def resident_bytes_of_mapping(address: int) -> int:
    """The resident bytes of the mapping that holds address (/proc/self/smaps' Rss)."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        bounds = line.split(" ", 1)[0].split("-")
        if len(bounds) == 2 and all(c in "0123456789abcdef" for c in "".join(bounds)) and \
                int(bounds[0], 16) <= address < int(bounds[1], 16):
            rss = next(entry for entry in lines[i + 1:] if entry.startswith("Rss:"))
            return int(rss.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("shape", [(48, 1024), (24, 96)], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 15, 16, 17, 40])
def test_the_q8_0_kernel_gives_the_int8_kernels_bits_from_the_files_rows(rows, shape):
    """The rows read in place (a decoding step's few) or widened into int8's layout (a prompt's
    many) give the int8 kernel's outputs on the same codes and scales, bit for bit, in each
    dtype; both are the layers' definition's to float tolerance. A row holding a NaN is NaN
    throughout, as int8's, and leaves the others as they were."""
    from llama_mini.kernels.operators import FLOATS, operators
    from llama_mini.quant.layers import quantized_linear

    converter = kernels_converter()
    blocks = q8_0_blocks(shape)
    mapped, int8 = layer_from_blocks(T.Q8_0, blocks, shape, converter), layer_from_blocks(T.Q8_0, blocks, shape)
    assert type(mapped) is MappedQ8_0Linear and int(mapped.codes().min()) == -128
    generator = torch.Generator().manual_seed(rows)
    for dtype in FLOATS:
        x = torch.randn(rows, shape[1], generator=generator).to(dtype)
        got = operators().linear_q8_0(x, mapped.blocks)
        assert got.dtype == dtype and torch.equal(got, operators().linear_int8(x, int8.weight, int8.scales))
        torch.testing.assert_close(got.float(), quantized_linear(mapped, x.float()), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-4)
        x[-1, shape[1] // 2] = float("nan")
        with_nan = operators().linear_q8_0(x, mapped.blocks)
        assert with_nan[-1].isnan().all() and torch.equal(with_nan[:-1], got[:-1])


def test_a_mapped_q8_0_layer_copied_into_plain_rows_is_the_int8_layer_of_its_blocks():
    """Off the kernels (torch.compile's loops) the layer holds Int8Linear's plain rows, copied out
    of the file: the same weights, looked-up rows and state."""
    shape = (48, 512)
    blocks = q8_0_blocks(shape)
    layer = MappedQ8_0Linear(torch.from_numpy(blocks), shape[1])
    state, weights, ids = layer.state_dict(), files_weights(T.Q8_0, blocks, shape), torch.tensor([47, 0, 9, 9, 30])
    assert torch.equal(layer.dequantize(torch.float32), weights) and torch.equal(layer.rows(ids, torch.float32), weights[ids])
    layer.hold_plain_rows()
    assert type(layer) is Int8Linear and not layer.rows_of_8 and layer.weight.shape == shape
    assert torch.equal(layer.dequantize(torch.float32), weights) and torch.equal(layer.rows(ids, torch.float32), weights[ids])
    assert state.keys() == layer.state_dict().keys() and all(torch.equal(state[k], layer.state_dict()[k]) for k in state)


def test_an_edited_q8_0_layer_runs_as_edited_with_its_kernel_left_off(monkeypatch, caplog):
    """The Q8_0 kernel is written for mapped_q8_0.py's reading of the blocks: a reader who edits it
    (here every code zero) gets the edited layer, and one line naming it."""
    import logging

    from llama_mini.kernels import fingerprints
    from llama_mini.kernels.linear import LINEAR_KERNELS
    from llama_mini.kernels.operators import swap_classes

    converter = kernels_converter()
    shape = (48, 512)
    blocks = q8_0_blocks(shape)
    model = torch.nn.Sequential(layer_from_blocks(T.Q8_0, blocks, shape, converter))
    x = torch.randn(2, shape[1])
    assert model[0](x).abs().amax() > 0
    codes = MappedQ8_0Linear.codes
    monkeypatch.setattr(MappedQ8_0Linear, "codes", lambda self: torch.zeros_like(codes(self)))
    fingerprints.notice_changed.cache_clear()
    caplog.set_level(logging.WARNING, logger="llama_mini")
    swap_classes(model, LINEAR_KERNELS)
    assert type(model[0]) is MappedQ8_0Linear
    assert torch.equal(model[0](x), torch.zeros(2, shape[0]))
    assert any("MappedQ8_0Linear.codes in llama_mini/quant/mapped_q8_0.py" in r.getMessage() for r in caplog.records)
    fingerprints.notice_changed.cache_clear()
