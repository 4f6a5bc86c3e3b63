"""A Llama-3.2-style Hugging Face folder, end to end through the command lines: RoPE factor 32,
theta 500000, GQA and a tied head, with Meta's Llama-3 tokenizer. It loads, converts to Meta's
format and back, and generate.py prints transformers' own greedy continuation."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llama_mini import load_checkpoint
from llama_mini.tokenizers import open_tokenizer
from fixtures import LLAMA3_TOKENIZER, require

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"


def run(*args):
    cmd = [sys.executable, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def llama32(tmp_path_factory):
    """(folder written by save_pretrained, the transformers model)."""
    require(LLAMA3_TOKENIZER)
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128256, max_position_embeddings=2048, rope_theta=500000.0, rope_scaling=rope,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that greedy decoding follows the rotation
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if name.endswith("norm.weight") else torch.randn_like(p) * 0.3)
    folder = tmp_path_factory.mktemp("llama32") / "hf"
    model.save_pretrained(folder)
    return folder, model


@pytest.mark.slow
def test_llama32_folder_converts_to_meta_and_back_with_its_scaling_and_tied_head(llama32, tmp_path):
    folder, reference = llama32
    for src, dst, fmt in ((folder, tmp_path / "meta", "meta"), (tmp_path / "meta", tmp_path / "hf2", "hf")):
        result = run("-m", "llama_mini.formats.convert", src, dst, "--to", fmt)
        assert result.returncode == 0, result.stderr
    tokens = torch.randint(0, 128256, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(tokens).logits
    for path in (folder, tmp_path / "meta", tmp_path / "hf2"):
        model = load_checkpoint(path)
        assert (model.args.rope_scaling_factor, model.args.rope_theta, model.args.n_kv_heads) == (32.0, 500000.0, 2)
        assert model.output.weight is model.tok_embeddings.weight  # one shared tensor
        with torch.no_grad():
            assert (model(tokens) - expected).abs().max() <= 1e-4, path


@pytest.mark.slow
def test_generate_prints_transformers_greedy_continuation(llama32):
    folder, reference = llama32
    tokenizer = open_tokenizer(LLAMA3_TOKENIZER)
    ids = tokenizer.encode(PROMPT, bos=True)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.stop_ids)
    new = out[0, len(ids):].tolist()
    new = new[: next((i for i, t in enumerate(new) if t in tokenizer.stop_ids), len(new))]
    result = run("generate.py", "--ckpt", folder, "--tokenizer", LLAMA3_TOKENIZER, "--prompt", PROMPT,
                 "--temperature", 0, "--max-new-tokens", 12)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.rstrip("\n") == PROMPT + tokenizer.decode(ids + new)[len(tokenizer.decode(ids)):]
