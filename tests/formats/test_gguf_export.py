"""GGUF export: read the file back with gguf's own reader and compare tensors and metadata.
(Llama-3's vocabulary: tests/tokenizers/test_gguf_vocab.py.)"""

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llama_mini import save_checkpoint
from llama_mini.formats.convert import GGUF_TYPES
from llama_mini.formats.hf import to_hf_state_dict

gguf = pytest.importorskip("gguf")
from llama_mini.formats.gguf import TENSOR_TYPES, export_gguf  # noqa: E402
from fixtures import LLAMA2_TOKENIZER, require, tiny_model
from llama2c_files import export_sentencepiece

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tokenizer_path():
    require(LLAMA2_TOKENIZER)
    return LLAMA2_TOKENIZER


def small_model(**overrides):
    """The shared tiny model (tests/fixtures.py) with Llama-2's vocabulary and Llama-3's RoPE base."""
    return tiny_model(**{"vocab_size": 32000, "max_seq_len": 256, "rope_theta": 500000.0, **overrides})


def read(path):
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    return reader, tensors


def as_torch(t) -> torch.Tensor:
    """A tensor read back, dequantized where it is quantized, in PyTorch's (rows, columns) order."""
    data = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(tuple(reversed(t.shape.tolist())))


def field(reader, key):
    return reader.fields[key].contents()


def test_export_types_are_those_convert_offers():
    assert GGUF_TYPES == tuple(TENSOR_TYPES)


def test_f32_tensors_come_back_exactly_under_llama_cpp_names(tmp_path, tokenizer_path):
    model = small_model()
    _, tensors = read(export_gguf(model, tmp_path / "m.gguf", tokenizer_path, "f32"))
    state = model.state_dict()
    assert torch.equal(as_torch(tensors["token_embd.weight"]), state["tok_embeddings.weight"])
    assert torch.equal(as_torch(tensors["output.weight"]), state["output.weight"])
    assert torch.equal(as_torch(tensors["output_norm.weight"]), state["norm.weight"])
    for i in range(2):
        for ours, theirs in [("attention.wq", "attn_q"), ("attention.wk", "attn_k"), ("attention.wv", "attn_v"),
                             ("attention.wo", "attn_output"), ("feed_forward.w1", "ffn_gate"),
                             ("feed_forward.w2", "ffn_down"), ("feed_forward.w3", "ffn_up"),
                             ("attention_norm", "attn_norm"), ("ffn_norm", "ffn_norm")]:
            assert torch.equal(as_torch(tensors[f"blk.{i}.{theirs}.weight"]), state[f"layers.{i}.{ours}.weight"])
    assert len(tensors) == 3 + 9 * 2


def llama_cpp_permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: Hugging Face's q/k rows -> the order llama.cpp reads."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def test_q_and_k_rows_are_in_the_order_llama_cpp_converts_hugging_face_ones_to(tmp_path, tokenizer_path):
    model = small_model()
    _, tensors = read(export_gguf(model, tmp_path / "m.gguf", tokenizer_path, "f32"))
    hf = to_hf_state_dict(model.state_dict(), model.args)
    q_proj, k_proj = hf["model.layers.1.self_attn.q_proj.weight"], hf["model.layers.1.self_attn.k_proj.weight"]
    assert not torch.equal(q_proj, model.layers[1].attention.wq.weight)  # the two layouts differ: the check can fail
    assert torch.equal(as_torch(tensors["blk.1.attn_q.weight"]), llama_cpp_permute(q_proj, 4))
    assert torch.equal(as_torch(tensors["blk.1.attn_k.weight"]), llama_cpp_permute(k_proj, 2))


@pytest.mark.parametrize("type, dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_precision_tensors_are_rounded_to_nearest_once(tmp_path, tokenizer_path, type, dtype):
    model = small_model()
    _, tensors = read(export_gguf(model, tmp_path / "m.gguf", tokenizer_path, type))
    w = model.layers[0].feed_forward.w1.weight.detach()
    assert tensors["blk.0.ffn_gate.weight"].tensor_type == TENSOR_TYPES[type]
    assert torch.equal(as_torch(tensors["blk.0.ffn_gate.weight"]), w.to(dtype).float())
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


@pytest.mark.parametrize("type, levels", [("q8_0", 127), ("q4_0", 8)])
def test_blocks_of_32_come_back_within_a_step_of_their_block(tmp_path, tokenizer_path, type, levels):
    model = small_model()
    _, tensors = read(export_gguf(model, tmp_path / "m.gguf", tokenizer_path, type))
    t = tensors["blk.0.attn_q.weight"]
    assert t.tensor_type == TENSOR_TYPES[type]
    w = model.layers[0].attention.wq.weight.detach()
    step = w.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True) / levels  # Q8_0: absmax/127, Q4_0: absmax/8
    error = (as_torch(t) - w).unflatten(-1, (-1, 32)).abs()
    assert (error <= step * 1.01).all()
    assert (error > 0).any()  # it was quantized
    head = gguf.GGMLQuantizationType.Q8_0  # q4_0 files keep the head at Q8_0; q8_0 files have it anyway
    assert tensors["output.weight"].tensor_type == head


def test_rows_that_do_not_split_into_blocks_fall_back_to_f16(tmp_path, tokenizer_path):
    model = small_model(dim=48, n_heads=4, n_kv_heads=4)  # 48 inputs: not a multiple of 32
    _, tensors = read(export_gguf(model, tmp_path / "m.gguf", tokenizer_path, "q4_0"))
    assert tensors["blk.0.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16


def test_hyperparameters_are_llama_cpps_keys(tmp_path, tokenizer_path):
    model = small_model()
    reader, _ = read(export_gguf(model, tmp_path / "m.gguf", tokenizer_path, "f16"))
    assert field(reader, "general.architecture") == "llama"
    expected = {"context_length": 256, "embedding_length": 64, "block_count": 2, "feed_forward_length": model.args.ffn_dim,
                "attention.head_count": 4, "attention.head_count_kv": 2, "rope.dimension_count": 16}
    for key, value in expected.items():
        assert field(reader, f"llama.{key}") == value, key
    assert field(reader, "llama.rope.freq_base") == 500000.0
    assert field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_F16


def test_vocabulary_is_the_sentencepiece_model(tmp_path, tokenizer_path):
    reader, _ = read(export_gguf(small_model(), tmp_path / "m.gguf", tokenizer_path, "f16"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert field(reader, "tokenizer.ggml.model") == "llama"
    assert len(tokens) == 32000
    assert tokens[:4] == ["<unk>", "<s>", "</s>", "<0x00>"] and tokens[15043] == "▁Hello" and tokens[3186] == "▁world"
    types = field(reader, "tokenizer.ggml.token_type")
    assert types[:4] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.BYTE]
    assert types[15043] == gguf.TokenType.NORMAL
    assert (field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.eos_token_id")) == (1, 2)
    assert field(reader, "tokenizer.ggml.unknown_token_id") == 0
    assert "tokenizer.ggml.padding_token_id" not in reader.fields  # Meta's tokenizer has none
    assert field(reader, "tokenizer.ggml.add_space_prefix") is True
    scores = field(reader, "tokenizer.ggml.scores")
    assert scores[15043] < scores[3186] < 0  # merge order: Meta's "▁Hello" ranks after "▁world"


def test_llama31_scaling_is_stored_as_rope_freqs_divisors(tmp_path, tokenizer_path):
    args = dict(use_scaled_rope=True, rope_scaling_factor=8.0, rope_original_max_seq_len=8192, dim=256, n_heads=2,
                n_kv_heads=2)
    model = small_model(**args)
    _, tensors = read(export_gguf(model, tmp_path / "m.gguf", tokenizer_path, "f32"))
    factors = as_torch(tensors["rope_freqs.weight"])
    # Meta's apply_scaling, head_dim 128, theta 500000: short wavelengths kept (1), long ones slowed 8x,
    # and the frequency llama.cpp gets, freq / factor, is the scaled one.
    assert factors.shape == (64,) and factors[0] == 1.0 and factors[-1] == 8.0
    assert ((factors >= 1) & (factors <= 8)).all() and (factors[1:] >= factors[:-1]).all()
    unscaled = dataclasses.replace(model.args, use_scaled_rope=False)
    from llama_mini.model import rope_frequencies

    torch.testing.assert_close(rope_frequencies(unscaled) / factors, rope_frequencies(model.args))
    assert "rope_freqs.weight" not in read(export_gguf(small_model(), tmp_path / "plain.gguf", tokenizer_path))[1]


def test_tied_head_is_left_to_token_embd(tmp_path, tokenizer_path):
    _, tensors = read(export_gguf(small_model(tie_embeddings=True), tmp_path / "m.gguf", tokenizer_path, "f16"))
    assert "output.weight" not in tensors and "token_embd.weight" in tensors


def test_what_llama_cpp_cannot_run_is_refused(tmp_path, tokenizer_path):
    with pytest.raises(ValueError, match="RMSNorm only"):
        export_gguf(small_model(norm="layernorm"), tmp_path / "a.gguf", tokenizer_path)
    with pytest.raises(ValueError, match="has 32000 tokens but the model has 1000"):
        export_gguf(small_model(vocab_size=1000), tmp_path / "b.gguf", tokenizer_path)
    llama2c = export_sentencepiece(tokenizer_path, tmp_path / "tokenizer.bin")  # the same vocabulary, as llama2.c flattens it
    with pytest.raises(ValueError, match="is llama2.c's tokenizer.bin, which GGUF export does not write"):
        export_gguf(small_model(), tmp_path / "c.gguf", llama2c)
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*tmp*"))


def convert(*args):
    return subprocess.run([sys.executable, "-m", "llama_mini.formats.convert", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_convert_cli_writes_gguf_and_refuses_to_overwrite(tmp_path, tokenizer_path):
    ckpt = save_checkpoint(small_model(), tmp_path / "ckpt", tokenizer_path=tokenizer_path)
    result = convert(ckpt, tmp_path / "m.gguf", "--to", "gguf", "--type", "q8_0")
    assert result.returncode == 0, result.stderr
    _, tensors = read(tmp_path / "m.gguf")
    assert tensors["blk.0.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    again = convert(ckpt, tmp_path / "m.gguf", "--to", "gguf")
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'm.gguf'} already exists; choose a new file name for the GGUF export"]
    both = convert(ckpt, tmp_path / "n.gguf", "--to", "gguf", "--quantize", "int8")
    assert both.returncode == 2 and "--quantize writes a native checkpoint" in both.stderr


def test_llama_cpp_gives_the_same_logits(tmp_path, tokenizer_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    model = small_model()
    path = export_gguf(model, tmp_path / "m.gguf", tokenizer_path, "f32")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False)
    tokens = [1, 15043, 3186, 29892, 920]
    llm.eval(tokens)
    theirs = torch.tensor(np.array(llm.scores[: len(tokens)]))
    with torch.no_grad():
        ours = model(torch.tensor([tokens]))[0]
    torch.testing.assert_close(theirs, ours, rtol=1e-3, atol=1e-3)
