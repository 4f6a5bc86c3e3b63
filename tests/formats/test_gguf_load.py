"""Loading GGUF files: what llama.cpp's tools write reads back as the model they hold.

The references are independent of llama_mini's reader: the model a file was written from,
gguf's own dequantization of each tensor's bytes, and transformers' own GGUF reader (its config
mapping, dequantization and q/k permutation). The q/k layout is proven by logits against
transformers' LlamaForCausalLM on the Hugging Face weights a file was converted from.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from fixtures import load_peak, tiny_model
from gguf_files import gguf_names, llama_cpp_permute, random_blocks, transformers_model, write_gguf
from llama_mini import ModelArgs, Transformer, load_checkpoint
from llama_mini.formats.checkpoint import detect_format
from llama_mini.formats.gguf import export_gguf
from llama_mini.formats.names import from_format, to_format
from llama_mini.model import rope_frequencies
from llama_mini.quant.layers import Int8Linear
from llama_mini.support.gguf_file import GGUFFile
from llama_mini.tokenizers import open_tokenizer
from llama_mini.tokenizers.spm import train_sentencepiece
from llama_mini.run import corpus

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
VOCAB = 320
PROMPT = [[1, 5, 90, 17, 250, 33, 7, 100]]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    """A SentencePiece tokenizer of VOCAB tokens, trained on the built-in stories."""
    lines = [line for story in corpus.stories(3000) for line in story.splitlines()]
    return Path(train_sentencepiece(lines, VOCAB, tmp_path_factory.mktemp("tok") / "tokenizer.model").model_path)


def small_model(**overrides):
    """The shared tiny model (tests/fixtures.py) with the test tokenizer's vocabulary."""
    return tiny_model(**{"vocab_size": VOCAB, "max_seq_len": 256, **overrides})


@torch.no_grad()
def logits(model, tokens=PROMPT):
    if hasattr(model, "lm_head"):  # transformers
        return model(torch.tensor(tokens)).logits.float()
    return model(torch.tensor(tokens))


SHAPES = {
    "llama2": dict(n_kv_heads=4),
    # Llama-3.x: GQA, theta 500000, a tied head, and llama3 scaling with a frequency in each band
    "llama3": dict(rope_theta=500000.0, tie_embeddings=True, use_scaled_rope=True, rope_scaling_factor=32.0, max_seq_len=512),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_an_f32_file_loads_back_as_the_model_it_was_written_from(tmp_path, tokenizer_path, shape):
    model = small_model(**SHAPES[shape])
    path = export_gguf(model, tmp_path / "m.gguf", tokenizer_path, "f32")
    loaded = load_checkpoint(path)
    assert detect_format(path) == "gguf"
    fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "norm_eps", "rope_theta", "max_seq_len",
              "tie_embeddings", "use_scaled_rope", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
              "rope_original_max_seq_len")
    assert {f: getattr(loaded.args, f) for f in fields} == {f: getattr(model.args, f) for f in fields}
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert torch.equal(logits(loaded), logits(model))
    if model.args.tie_embeddings:
        assert loaded.output.weight is loaded.tok_embeddings.weight


def test_llama31_scaling_is_read_from_rope_freqs_as_the_frequencies_llama_cpp_uses(tmp_path, tokenizer_path):
    model = small_model(**SHAPES["llama3"])
    path = export_gguf(model, tmp_path / "m.gguf", tokenizer_path, "f32")
    factors = torch.from_numpy(np.array(gguf.GGUFReader(path).get_tensor(-1).data))  # rope_freqs, written last
    plain = rope_frequencies(ModelArgs(dim=64, n_heads=4, rope_theta=500000.0))
    loaded = load_checkpoint(path).args
    assert loaded.use_scaled_rope and loaded.rope_scaling_factor == 32.0
    assert (factors == 1).any() and (factors == 32).any() and ((factors > 1) & (factors < 32)).any()  # all three bands
    torch.testing.assert_close(rope_frequencies(loaded), plain / factors, rtol=1e-6, atol=0)


def test_a_file_is_told_by_its_content_not_its_name(tmp_path, tokenizer_path):
    path = export_gguf(small_model(), tmp_path / "m.gguf", tokenizer_path, "f16")
    renamed = tmp_path / "weights.bin"
    shutil.copyfile(path, renamed)
    assert detect_format(renamed) == "gguf"
    assert torch.equal(logits(load_checkpoint(renamed)), logits(load_checkpoint(path)))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("type, dtype", [("f32", torch.float32), ("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_float_tensors_keep_their_dtype_and_stay_mapped_from_the_file(tmp_path, tokenizer_path, type, dtype):
    from test_checkpoint import mapped_file

    path = export_gguf(small_model(), tmp_path / "m.gguf", tokenizer_path, type)
    model = load_checkpoint(path)
    for name, p in model.named_parameters():
        assert p.dtype == dtype, name
        if p.dim() == 2:  # the norms are F32 in every file and are converted to the model's dtype
            assert mapped_file(p) == path.resolve(), name


# --- Every tensor type, against gguf's dequantization and transformers' reader ---------------

# One file holding every type: each matrix of a 2-layer model in another one. Rows of 256
# values (dim 256, hidden 512) split into blocks of every type, K-quants' 256 included.
MIXED = {
    "token_embd.weight": T.Q4_K, "output.weight": T.Q6_K,
    "blk.0.attn_q.weight": T.Q8_0, "blk.0.attn_k.weight": T.Q4_0, "blk.0.attn_v.weight": T.Q4_1,
    "blk.0.attn_output.weight": T.Q5_0, "blk.0.ffn_gate.weight": T.Q5_1, "blk.0.ffn_down.weight": T.Q2_K,
    "blk.0.ffn_up.weight": T.Q3_K, "blk.1.attn_q.weight": T.Q5_K, "blk.1.attn_k.weight": T.F16,
    "blk.1.attn_v.weight": T.BF16, "blk.1.attn_output.weight": T.F32, "blk.1.ffn_gate.weight": T.Q6_K,
    "blk.1.ffn_down.weight": T.Q4_K, "blk.1.ffn_up.weight": T.Q8_0,
}
MIXED_ARGS = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, hidden_dim=512, max_seq_len=64,
                       rope_theta=500000.0)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(the file, {GGUF name: (stored array or block bytes, type)}): random blocks of every type."""
    generator = np.random.default_rng(0)
    floats = gguf_names(Transformer(MIXED_ARGS))
    tensors = {}
    for name, array in floats.items():
        kind = MIXED.get(name, T.F32)
        if kind == T.F16:
            tensors[name] = (array.astype(np.float16), kind)
        elif kind == T.BF16:
            tensors[name] = (gguf.quants.quantize(array, kind), kind)
        elif kind == T.F32:
            tensors[name] = (array if array.ndim == 2 else generator.uniform(0.5, 1.5, array.shape).astype(np.float32), kind)
        else:
            tensors[name] = (random_blocks(array.shape, kind, generator), kind)
    return write_gguf(tmp_path_factory.mktemp("mixed") / "mixed.gguf", MIXED_ARGS, tensors), tensors


def test_mixed_file_holds_every_type_the_loader_reads(mixed):
    types = {t.tensor_type for t in gguf.GGUFReader(mixed[0]).tensors}
    assert types == {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}


def test_every_tensor_is_gguf_quants_own_dequantization_of_its_bytes(mixed):
    path, tensors = mixed
    ours = load_checkpoint(path, dtype=torch.float32).state_dict()
    for name, (stored, kind) in tensors.items():
        tensor = ours[from_format(name, "gguf")]
        expected = torch.from_numpy(np.array(gguf.quants.dequantize(stored, kind), dtype=np.float32))
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected.view(tensor.shape)), name


def test_logits_equal_transformers_reading_of_the_same_file(mixed):
    ours, theirs = logits(load_checkpoint(mixed[0], dtype=torch.float32)), logits(transformers_model(mixed[0]))
    assert ours.abs().amax() > 1  # the random blocks make a model with real logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * ours.abs().amax().item())


def test_quantized_blocks_are_dequantized_to_the_dtype_asked_for(mixed):
    full, half = load_checkpoint(mixed[0], dtype=torch.float32), load_checkpoint(mixed[0], dtype=torch.bfloat16)
    for name, tensor in half.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, full.state_dict()[name].to(torch.bfloat16)), name


def test_quantize_at_load_gives_llama_minis_own_layers(mixed):
    model = load_checkpoint(mixed[0], quantize="int8")
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 7 * 2 + 1
    assert model.quantization["method"] == "int8"
    dequantized = logits(load_checkpoint(mixed[0], dtype=torch.float32))
    assert (logits(model) - dequantized).abs().amax() < 0.1 * dequantized.std()


# --- q and k rows: a file converted from Hugging Face as llama.cpp converts it ------------------


@pytest.fixture(scope="module")
def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def convert_hf_to_gguf(hf, path, permute=True):
    """What llama.cpp's convert_hf_to_gguf.py does for a LlamaForCausalLM: llama.cpp's tensor
    names (gguf's own name map), q and k rows permuted for its rope, float32 kept."""
    config = hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tensors = {}
    for name, w in hf.state_dict().items():
        if name.endswith("q_proj.weight") and permute:
            w = llama_cpp_permute(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight") and permute:
            w = llama_cpp_permute(w, config.num_key_value_heads)
        tensors[names.get_name(name, try_suffixes=(".weight",))] = (w.detach().numpy(), T.F32)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, hidden_dim=160, max_seq_len=256,
                     rope_theta=500000.0)
    return write_gguf(path, args, tensors)


def test_q_and_k_of_a_file_converted_from_hugging_face_give_transformers_logits(tmp_path, hf_llama):
    ours = logits(load_checkpoint(convert_hf_to_gguf(hf_llama, tmp_path / "m.gguf")))
    torch.testing.assert_close(ours, logits(hf_llama), rtol=1e-4, atol=1e-4)
    unpermuted = logits(load_checkpoint(convert_hf_to_gguf(hf_llama, tmp_path / "raw.gguf", permute=False)))
    assert not torch.allclose(unpermuted, logits(hf_llama), atol=1e-3)  # the permutation matters: the check can fail


# --- Files refused in one line -----------------------------------------------------------------


def refusal(tmp_path, args=None, drop=(), fields=None, tensors=None) -> str:
    """The one-line refusal of a file made from a small model: tensors dropped or replaced,
    metadata fields added or overridden."""
    args = args or small_model().args
    written = {**gguf_names(small_model()), **(tensors or {})}
    arrays = {name: (array, T.F32) if not isinstance(array, tuple) else array for name, array in written.items() if name not in drop}
    path = write_gguf(tmp_path / "bad.gguf", args, arrays, fields=fields)
    with pytest.raises(ValueError) as e:
        load_checkpoint(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message, message
    return message


@pytest.mark.parametrize("case, fragment", [
    (dict(fields={"general.architecture": ("qwen2", V.STRING)}), "architecture 'qwen2'; llama_mini reads GGUF files of llama.cpp's llama"),
    (dict(fields={"llama.attention.head_count": ("4", V.STRING)}), "field 'llama.attention.head_count' is '4'"),
    (dict(fields={"llama.block_count": (0, V.UINT32)}), "field 'llama.block_count' is 0"),
    (dict(fields={"llama.rope.dimension_count": (8, V.UINT32)}), "llama.rope.dimension_count is 8, not the head size 16"),
    (dict(fields={"llama.rope.scaling.type": ("yarn", V.STRING)}), "asks for 'yarn' RoPE scaling"),
    (dict(fields={"llama.rope.scaling.type": ("linear", V.STRING), "llama.rope.scaling.factor": (4.0, V.FLOAT32)}),
     "asks for 'linear' RoPE scaling"),
    (dict(fields={"llama.vocab_size": (999, V.UINT32)}), "states a vocabulary of 999 tokens but token_embd has 320 rows"),
    (dict(drop=["blk.1.ffn_up.weight"]), "missing ['blk.1.ffn_up.weight']"),
    (dict(drop=["token_embd.weight"]), "has no token_embd.weight"),
    (dict(tensors={"blk.0.attn_qkv.weight": np.zeros((192, 64), np.float32)}), "holds tensor 'blk.0.attn_qkv.weight', which is not part of a Llama"),
    (dict(tensors={"blk.0.attn_k.weight": np.zeros((64, 64), np.float32)}), "tensor blk.0.attn_k.weight has shape (64, 64) but the config implies (32, 64)"),
    (dict(tensors={"blk.2.attn_k.weight": np.zeros((32, 64), np.float32)}), "the config says 2 layers; the weights hold 3"),
    (dict(tensors={"rope_freqs.weight": np.full(8, 3.0, np.float32)}), "its rope_freqs are not Llama-3.1's RoPE scaling"),
    (dict(tensors={"blk.0.ffn_up.weight": (np.zeros((192, 64 // 32 * 18), np.uint8), T.IQ4_NL)}), "stores tensor blk.0.ffn_up.weight as IQ4_NL"),
])
def test_a_file_llama_mini_cannot_run_exactly_is_refused_in_one_line(tmp_path, case, fragment):
    assert fragment in refusal(tmp_path, **case)


def test_loading_steps_over_the_vocabulary_the_tokenizer_has_read(tmp_path, tokenizer_path):
    """The model is loaded from the file's metadata without its arrays of strings (a vocabulary,
    tens to hundreds of thousands of them, which the tokenizer reads): the same fields less those,
    the same tensors, and each string's length still checked against the bytes left."""
    path = export_gguf(small_model(), tmp_path / "m.gguf", tokenizer_path, "f32")
    whole, stepped = GGUFFile(path), GGUFFile(path, string_arrays=False)
    strings = {key for key, (kind, item) in whole.value_types.items() if item == V.STRING}
    assert strings == {"tokenizer.ggml.tokens"} and len(whole.fields["tokenizer.ggml.tokens"]) == VOCAB
    assert stepped.fields.keys() == whole.fields.keys() - strings
    assert all(np.array_equal(stepped.fields[key], whole.fields[key]) for key in stepped.fields)
    assert stepped.value_types == whole.value_types and stepped.tensors == whole.tensors
    data = bytearray(path.read_bytes())
    at = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 4 + 4 + 8  # the type, items' type, count
    data[at : at + 8] = (1 << 40).to_bytes(8, "little")  # the first token's length, past the end
    (tmp_path / "long.gguf").write_bytes(data)
    with pytest.raises(ValueError, match="runs past the end"):
        GGUFFile(tmp_path / "long.gguf", string_arrays=False)


@pytest.mark.parametrize("field, value, fragment", [
    ("llama.attention.layer_norm_rms_epsilon", 1e30, "field 'norm_eps' is 1e+30; a Llama model's is from 1e-12 to 0.1"),
    ("llama.rope.freq_base", 1e-30, "field 'rope_theta' is 1e-30; a Llama model's is from 1 to 1e+12"),
])
def test_constants_far_outside_any_llamas_are_refused_in_one_line(tmp_path, field, value, fragment):
    assert fragment in refusal(tmp_path, fields={field: (value, V.FLOAT32)})


def moved_offset(path, tensor: str, offset) -> None:
    """Rewrite, in place, the data offset the file's tensor table gives tensor."""
    reader = gguf.GGUFReader(path, "r+")
    part = next(t for t in reader.tensors if t.name == tensor).field.parts[-1]
    part[0] = offset(reader, part[0])
    part.flush()


@pytest.mark.parametrize("offset, fragment", [
    (lambda reader, own: own + 4, "tensor 'output_norm.weight' starts at offset"),  # misaligned: 4 bytes on
    (lambda reader, own: next(t for t in reader.tensors if t.name == "token_embd.weight").field.parts[-1][0],
     "overlap"),  # onto another tensor's data
])
def test_a_tensor_table_that_lies_about_where_the_data_is_is_refused_in_one_line(tmp_path, offset, fragment):
    path = write_gguf(tmp_path / "m.gguf", small_model().args, {k: (v, T.F32) for k, v in gguf_names(small_model()).items()})
    moved_offset(path, "output_norm.weight", offset)
    with pytest.raises(ValueError) as e:
        load_checkpoint(path)
    assert fragment in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_linear_scaling_by_one_is_no_scaling(tmp_path):
    fields = {"llama.rope.scaling.type": ("linear", V.STRING), "llama.rope.scaling.factor": (1.0, V.FLOAT32)}
    path = write_gguf(tmp_path / "m.gguf", small_model().args, {k: (v, T.F32) for k, v in gguf_names(small_model()).items()},
                      fields=fields)
    assert torch.equal(logits(load_checkpoint(path)), logits(small_model()))


# --- Memory: one tensor at a time --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("kind", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K])
def test_a_quantized_file_loads_in_about_its_own_size_or_its_dequantized_size_asked(tmp_path, kind):
    """A file of 29M weights (112 MiB in float32; Q4_0 16 MiB, Q8_0 30 MiB, Q4_K 16 MiB). At its
    own precision, loading raises the peak memory by the bytes the model holds (Q4_0 as int4 with
    the file's float16 scales and offsets is 1.11x its bytes, Q8_0 as int8 1.00x, Q4_K as int4
    with factored scales 1.06x, Q5_K and Q6_K their own blocks 1.00x) and at most 20 MiB more
    (imports, threads, the largest tensor's conversion; Q5_K and Q6_K convert none): each
    tensor's pages are dropped once converted, the heap's freed pages given back, and no float
    copy is made. Dequantized (dtype float32), by the float32 weights and the
    file's pages, under 1.5x the weights: each tensor is dequantized into its place once (a
    second copy would be 2x)."""
    args = ModelArgs(dim=512, n_layers=6, n_heads=8, vocab_size=4096, hidden_dim=2048, max_seq_len=64)
    generator = np.random.default_rng(0)
    with torch.device("meta"):
        shapes = {name: tuple(array.shape) for name, array in Transformer(args).state_dict().items()}
    tensors = {to_format(name, "gguf"): (random_blocks(shape, kind, generator), kind) if len(shape) == 2 else
               (np.ones(shape, np.float32), T.F32) for name, shape in shapes.items()}
    path = write_gguf(tmp_path / "q.gguf", args, tensors)
    float_bytes = 4 * sum(np.prod(s) for s in shapes.values())
    (own, held), (dequantized, _) = (load_peak(f"load_checkpoint({str(path)!r}, dtype={dtype})")
                                     for dtype in ("None", "torch.float32"))
    print(f"{kind.name}: file {path.stat().st_size / 2**20:.1f} MiB; at its precision the model holds {held / 2**20:.1f} "
          f"MiB, peak +{own / 2**20:.1f} MiB; dequantized +{dequantized / 2**20:.1f} MiB")
    assert held < {T.Q4_0: 1.12, T.Q8_0: 1.01, T.Q4_K: 1.06, T.Q5_K: 1.02, T.Q6_K: 1.02}[kind] * path.stat().st_size
    assert own < held + 20 * 2**20
    assert float_bytes < dequantized < 1.5 * float_bytes, (dequantized / 2**20, float_bytes / 2**20)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("kind", [T.F16, T.BF16])
def test_a_half_precision_file_on_the_kernels_peaks_at_about_its_own_size(tmp_path, kind):
    """An F16 or BF16 file (29M weights, 56 MiB) loaded as generate.py loads it: at its own
    dtype, each matrix copied into panels for the kernels (kernels/linear.py), the file's pages
    of it given back as the copy is made. The peak rises by the model's bytes and at most 20 MiB
    more (the kernels' library and self-check, the largest matrix); keeping the pages would make
    it twice the file (+117 MiB)."""
    from llama_mini.kernels.operators import operators

    if operators() is None:
        pytest.skip("no CPU kernels on this machine: nothing is laid out again")
    args = ModelArgs(dim=512, n_layers=6, n_heads=8, vocab_size=4096, hidden_dim=2048, max_seq_len=64)
    generator = np.random.default_rng(0)
    with torch.device("meta"):
        shapes = {name: tuple(array.shape) for name, array in Transformer(args).state_dict().items()}

    def stored(shape):
        values = generator.standard_normal(shape, dtype=np.float32) * 0.02
        if kind == T.F16:
            return values.astype(np.float16)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # bfloat16's bits, as raw bytes

    tensors = {to_format(name, "gguf"): (stored(shape), kind) if len(shape) == 2 else (np.ones(shape, np.float32), T.F32)
               for name, shape in shapes.items()}
    path = write_gguf(tmp_path / "half.gguf", args, tensors)
    own, held = load_peak(f"__import__('llama_mini.kernels').kernels.use_cpu_kernels(load_checkpoint({str(path)!r}))")
    size = path.stat().st_size
    print(f"{kind.name}: file {size / 2**20:.1f} MiB; the model holds {held / 2**20:.1f} MiB, peak +{own / 2**20:.1f} MiB")
    assert held < 1.01 * size and own < held + 20 * 2**20


# --- The command lines on a GGUF file ---------------------------------------------------------


def convert(*args):
    return subprocess.run([sys.executable, "-m", "llama_mini.formats.convert", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, tokenizer_path):
    return export_gguf(small_model(), tmp_path_factory.mktemp("src") / "model.gguf", tokenizer_path, "f32")


@pytest.mark.parametrize("to", ["native", *(pytest.param(to, marks=pytest.mark.slow) for to in ("meta", "hf", "gguf"))])
def test_convert_reads_a_gguf_file_into_every_format_with_its_vocabulary(tmp_path, gguf_file, to):
    dst = tmp_path / ("out.gguf" if to == "gguf" else "out")
    result = convert(gguf_file, dst, "--to", to, *(["--type", "f32"] if to == "gguf" else []))
    assert result.returncode == 0, result.stderr
    source, converted = load_checkpoint(gguf_file), load_checkpoint(dst)
    assert all(torch.equal(converted.state_dict()[k], v) for k, v in source.state_dict().items())
    text = "Once upon a time, Lily saw a cat."
    ids = open_tokenizer(gguf_file).encode(text)
    tokenizer = dst if to == "gguf" else dst / "tokenizer.model"
    assert open_tokenizer(tokenizer).encode(text) == ids and open_tokenizer(tokenizer).decode(ids) == text
    if to != "gguf":  # the vocabulary alone, not a second copy of the weights
        assert tokenizer.stat().st_size < gguf_file.stat().st_size / 10
        assert gguf.GGUFReader(tokenizer).tensors == []


def test_convert_checks_the_vocabulary_it_copies(tmp_path, tokenizer_path):
    """A GGUF model whose vocabulary is damaged (a NaN score) is refused before anything is
    written, as generate.py would refuse the copy."""
    path = export_gguf(small_model(), tmp_path / "model.gguf", tokenizer_path, "f32")
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields["tokenizer.ggml.scores"]
    part = field.parts[field.data[5]]
    part[0] = np.nan
    part.flush()
    result = convert(path, tmp_path / "out", "--to", "native")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == f"error: {path}: its vocabulary is damaged (tokenizer.ggml.scores holds NaN or inf); download or convert it again"
    assert not (tmp_path / "out").exists()
