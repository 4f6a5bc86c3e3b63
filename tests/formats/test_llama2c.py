"""llama2.c's files load as they are: the .bin export (v0, v1, v2) and the training ckpt.pt.

The files are written by a small writer that follows llama2.c's export.py (legacy_export,
version1_export, version2_export with quantize_q80; tests/llama2c_files.py) and train.py's
checkpoint dict, line by line, independently of the reader. The known answer is the model that was exported: its
weights, and its logits.
"""

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llama_mini import ModelArgs, Transformer, generate, load_checkpoint, save_checkpoint
from llama_mini.formats.checkpoint import detect_format
from llama_mini.tokenizers.spm import train_sentencepiece
from fixtures import tiny_model
from llama2c_files import export, quantize_q80

ROOT = Path(__file__).resolve().parents[2]
TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))


def llama2c_model(shared=True, seed=0, n_kv_heads=2):
    """The shared tiny model (tests/fixtures.py) as llama2.c's train.py builds one: multiple_of 32, GQA."""
    return tiny_model(seed, n_kv_heads=n_kv_heads, max_seq_len=48, tie_embeddings=shared)


def dequantized(model, group_size=64):
    """The model whose weights are what v2's int8 values and scales give back."""
    copy = llama2c_model(shared=model.args.tie_embeddings)
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in copy.named_parameters():
            if p.dim() == 2:
                q, s = quantize_q80(p, group_size)
                p.copy_((q.float() * s[:, None]).view(p.shape))
    return copy


def save_training_checkpoint(model, path, compiled=True):
    """train.py's ckpt.pt: the raw model's state dict (keys prefixed when saved through
    torch.compile), the optimizer, and model_args without hidden_dim or norm_eps."""
    state = model.state_dict()
    if compiled:
        state = {f"_orig_mod.{k}": v for k, v in state.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, betas=(0.9, 0.95))
    model_args = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, max_seq_len=48, dropout=0.0)
    torch.save({"model": state, "optimizer": optimizer.state_dict(), "model_args": model_args, "iter_num": 2000,
                "best_val_loss": torch.tensor(1.25), "config": {"batch_size": 128, "dataset": "tinystories"}}, path)


def logits(model):
    with torch.no_grad():
        return model(TOKENS)


def assert_same_model(loaded, model):
    assert loaded.args.ffn_dim == model.args.ffn_dim and loaded.args.n_kv_heads == model.args.n_kv_heads
    theirs = model.state_dict()
    assert {k: torch.equal(v, theirs[k]) for k, v in loaded.state_dict().items()} == {k: True for k in theirs}
    assert torch.equal(logits(loaded), logits(model))


# --- Loading --------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("shared", [True, False])
def test_fp32_bin_loads_the_exported_model(tmp_path, version, shared):
    model = llama2c_model(shared=shared)
    export(model, tmp_path / "model.bin", version)
    assert detect_format(tmp_path / "model.bin") == "llama2c-bin"
    loaded = load_checkpoint(tmp_path / "model.bin")
    assert_same_model(loaded, model)
    assert loaded.args.tie_embeddings == shared and (loaded.output.weight is loaded.tok_embeddings.weight) == shared
    assert loaded.args.max_seq_len == 48


def test_v0_vocab_sign_is_the_shared_classifier_flag(tmp_path):
    # run.c: shared_weights = vocab_size > 0; a negative size still means |vocab_size| tokens.
    export(llama2c_model(shared=False), tmp_path / "model.bin", 0)
    assert struct.unpack_from("7i", (tmp_path / "model.bin").read_bytes())[5] == -96
    assert load_checkpoint(tmp_path / "model.bin").args.vocab_size == 96


@pytest.mark.parametrize("shared", [True, False])
def test_q8_bin_loads_the_weights_its_int8_values_give(tmp_path, shared):
    model = llama2c_model(shared=shared)
    export(model, tmp_path / "model.bin", 2)
    loaded = load_checkpoint(tmp_path / "model.bin")
    assert_same_model(loaded, dequantized(model))
    assert (logits(loaded) - logits(model)).abs().max().item() < 0.05  # Q8_0 stays close to the fp32 model


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_fp32_bin_weights_stay_memory_mapped(tmp_path):
    from test_checkpoint import mapped_file

    export(llama2c_model(), tmp_path / "model.bin", 1)
    loaded = load_checkpoint(tmp_path / "model.bin")
    assert all(mapped_file(p) == tmp_path / "model.bin" for p in loaded.parameters())


@pytest.mark.parametrize("compiled", [True, False])
def test_training_checkpoint_loads_tied_with_the_multiple_of_rule(tmp_path, compiled):
    model = llama2c_model(shared=True)
    save_training_checkpoint(model, tmp_path / "ckpt.pt", compiled)
    assert detect_format(tmp_path / "ckpt.pt") == "llama2c-pt"
    loaded = load_checkpoint(tmp_path / "ckpt.pt")
    assert loaded.layers[0].feed_forward.w1.weight.shape == (192, 64)  # 32 * ceil(int(2 * 4 * 64 / 3) / 32)
    assert loaded.output.weight is loaded.tok_embeddings.weight
    assert_same_model(loaded, model)


def test_converted_to_hf_it_gives_transformers_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = llama2c_model(shared=False)
    export(model, tmp_path / "model.bin", 0)
    save_checkpoint(load_checkpoint(tmp_path / "model.bin"), tmp_path / "hf", format="hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert (hf(TOKENS).logits - logits(model)).abs().max().item() <= 1e-4


# --- Refusals: one line, before anything large is read -------------------------------------------


def one_line(excinfo) -> str:
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


def test_truncated_bin_is_refused_by_its_size(tmp_path):
    export(llama2c_model(), tmp_path / "model.bin", 1)
    data = (tmp_path / "model.bin").read_bytes()
    (tmp_path / "model.bin").write_bytes(data[:-4])
    with pytest.raises(ValueError, match=rf"model.bin is {len(data) - 4} bytes but its llama2.c v1 header implies {len(data)}") as e:
        load_checkpoint(tmp_path / "model.bin")
    one_line(e)


def test_header_claiming_huge_sizes_is_refused_before_any_read(tmp_path):
    # 10M layers of dim 4096: terabytes the header claims and the file does not hold.
    model = llama2c_model()
    export(model, tmp_path / "model.bin", 0)
    data = bytearray((tmp_path / "model.bin").read_bytes())
    data[0:28] = struct.pack("7i", 4096, 11008, 10_000_000, 32, 32, 32000, 4096)
    (tmp_path / "model.bin").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="header implies .* the file is truncated or corrupt") as e:
        load_checkpoint(tmp_path / "model.bin")
    one_line(e)


def test_unknown_bin_version_is_refused(tmp_path):
    export(llama2c_model(), tmp_path / "model.bin", 1)
    data = bytearray((tmp_path / "model.bin").read_bytes())
    data[4:8] = struct.pack("i", 3)
    (tmp_path / "model.bin").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="llama2.c .bin of version 3; llama_mini reads versions 0, 1 and 2"):
        load_checkpoint(tmp_path / "model.bin")


def test_a_pytorch_file_that_is_not_a_training_checkpoint_is_refused(tmp_path):
    torch.save(llama2c_model().state_dict(), tmp_path / "consolidated.00.pth")
    with pytest.raises(ValueError, match="is a PyTorch file but not llama2.c's training checkpoint") as e:
        load_checkpoint(tmp_path / "consolidated.00.pth")
    one_line(e)


def test_a_file_of_no_known_format_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="notes.txt is a file in no format llama_mini reads; pass the checkpoint folder"):
        load_checkpoint(tmp_path / "notes.txt")


# --- The user's path: generate.py --ckpt model.bin --------------------------------------------------


@pytest.mark.slow
def test_generate_cli_prints_the_exported_models_greedy_text(tmp_path):
    text = "Tom had a red ball. He gave it to Sue, and she was glad. " * 40
    tok = train_sentencepiece(text.split(". "), vocab_size=300, model_path=tmp_path / "tokenizer.model")
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=tok.n_words, max_seq_len=64)).eval()
    export(model, tmp_path / "stories.bin", 0)  # llama2.c's layout keeps tokenizer.model beside the .bin
    prompt = tok.encode("Tom had", bos=True, eos=False)
    expected = tok.decode(generate(model, [prompt], 12, temperature=0)[0])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(tmp_path / "stories.bin"), "--prompt",
                             "Tom had", "--max-new-tokens", "12", "--temperature", "0"], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert "loaded llama2c-bin checkpoint" in result.stderr
    assert expected.strip() and expected.strip() in result.stdout
