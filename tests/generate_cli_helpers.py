"""Running generate.py as a user does, and tiny models whose samples end on a chosen token."""

import importlib.util
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from llama_mini import ModelArgs, Transformer, generate, load_checkpoint, save_checkpoint
from fixtures import LLAMA2_TOKENIZER, LLAMA3_TOKENIZER, require  # noqa: F401  (re-exported to the CLI tests)

ROOT = Path(__file__).resolve().parents[1]


def run(*args, stdin=""):
    """generate.py in a new interpreter. Bytes arguments reach it as bytes, and so do the
    surrogates of stdin ("\udcff" is the byte 0xff), for input that is not UTF-8."""
    return subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), *(a if isinstance(a, bytes) else str(a) for a in args)],
        input=stdin, capture_output=True, text=True, encoding="utf-8", errors="surrogateescape", timeout=180, cwd=ROOT,
    )


def run_in_process(*args, capsys):
    """generate.py's __main__ block, run here: the same error handling without a new interpreter."""
    with pytest.raises(SystemExit) as exit_info:
        with mock.patch("sys.argv", ["generate.py", *map(str, args)]):
            runpy.run_path(str(ROOT / "generate.py"), run_name="__main__")
    return subprocess.CompletedProcess(args, exit_info.value.code, "", capsys.readouterr().err)


def load_cli():
    spec = importlib.util.spec_from_file_location("generate_cli", ROOT / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_clean_error(result, *words):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "error:" in result.stderr
    assert len([line for line in result.stderr.splitlines() if "error:" in line]) == 1, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def favour_token(model, token_id, logit):
    """Give token_id a steady logit of about `logit` above a near-uniform rest, at every position.

    Every token embedding carries a constant 1 in feature 0, so the final RMSNorm output has
    feature 0 near sqrt(dim) at every position (the random blocks add little); only
    token_id's output row reads that feature.
    """
    with torch.no_grad():
        model.tok_embeddings.weight[:, 0] = 1.0
        model.output.weight[:, 0] = 0.0
        model.output.weight[token_id, 0] = logit / model.args.dim**0.5
    return model


def expected_samples(ckpt, tokenizer, prompt, n_samples, max_new_tokens, seed, stop_ids=None):
    """What generate.py must print for --num-samples: the prompt as typed, then the text that
    sample i (generate() with seed + i) adds to the decoded prompt; and each sample's length."""
    model = load_checkpoint(ckpt)
    ids = tokenizer.encode(prompt)
    stop_ids = tokenizer.stop_ids if stop_ids is None else stop_ids
    news = [generate(model, [ids], max_new_tokens, eos_id=stop_ids, seed=seed + i)[0] for i in range(n_samples)]
    added = [tokenizer.decode(ids + new)[len(tokenizer.decode(ids)) :] for new in news]
    return [prompt + text for text in added], [len(new) for new in news]


def tiny_llama3(folder, change=lambda model: model):
    """A tiny random model of Llama-3's vocabulary (128,256 ids) and context (131,072
    positions), change(model) applied, in a Hugging Face folder, with Meta's tokenizer where
    Meta's Hugging Face repositories keep it: original/tokenizer.model."""
    require(LLAMA3_TOKENIZER)
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128256, multiple_of=16,
                     rope_theta=500000.0, max_seq_len=131072)
    save_checkpoint(change(Transformer(args)), folder, format="hf")
    (folder / "original").mkdir()
    shutil.copyfile(LLAMA3_TOKENIZER, folder / "original" / "tokenizer.model")
    return folder


def write_llama3_tokenizer_json(path):
    """Meta's Llama-3 ranks as Hugging Face's tokenizer.json, made as the Hub's were: by
    transformers' TikTokenConverter."""
    require(LLAMA3_TOKENIZER)
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from llama_mini.tokenizers.llama3 import SPECIAL_TOKENS

    TikTokenConverter(vocab_file=str(LLAMA3_TOKENIZER), extra_special_tokens=SPECIAL_TOKENS).converted().save(str(path))
    return path
