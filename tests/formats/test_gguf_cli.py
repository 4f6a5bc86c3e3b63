"""A trained run through GGUF, as a user takes it: convert --to gguf, then generate.py --ckpt and
train.py --init-from on the GGUF file alone, its vocabulary read from the file."""

import gguf
import pytest
import torch

from gguf_files import EVAL, ROOT, cli
from llama_mini import generate, load_checkpoint
from llama_mini.tokenizers import open_tokenizer
from llama_mini.tokenizers.gguf_vocab import GgufSentencePiece
from llama_mini.run.folder import read_metrics

PROMPT = "Once upon a time"
pytestmark = pytest.mark.slow  # gguf_run (conftest.py) trains a model for 300 steps first


def greedy(ckpt, *flags):
    return cli(ROOT / "generate.py", "--ckpt", ckpt, "--prompt", PROMPT, "--temperature", 0, "--max-new-tokens", 100, *flags)


def test_generate_reads_an_f32_gguf_with_its_vocabulary_and_prints_the_runs_greedy_text(gguf_run):
    ours, theirs = greedy(gguf_run["run"]), greedy(gguf_run["files"]["f32"])
    assert theirs.stdout == ours.stdout and len(ours.stdout) > len(PROMPT) + 100
    assert f"loaded gguf checkpoint {gguf_run['files']['f32']}" in theirs.stderr
    assert isinstance(open_tokenizer(gguf_run["files"]["f32"]), GgufSentencePiece)


@torch.no_grad()
def test_a_q8_0_gguf_keeps_the_greedy_tokens_within_its_rounding(gguf_run):
    """Q8_0 rounds each weight to 1/254 of its block's largest (and its int8 layers each input
    alike): the greedy text of the trained model keeps at least 90 of its 100 tokens, and
    generate.py prints what generate() gives."""
    tokenizer = open_tokenizer(gguf_run["files"]["q8_0"])
    prompt = tokenizer.encode(PROMPT)
    new = generate(load_checkpoint(gguf_run["run"]), [prompt], 100, temperature=0)[0]
    quantized = generate(load_checkpoint(gguf_run["files"]["q8_0"]), [prompt], 100, temperature=0)[0]
    equal = sum(a == b for a, b in zip(new, quantized))
    print(f"Q8_0: {equal} of {len(new)} greedy tokens equal the float32 run's")
    assert len(new) == 100 and equal >= 90
    as_generate_py_holds_it = load_checkpoint(gguf_run["files"]["q8_0"])
    as_generate_py_holds_it.cache_dtype = torch.float16  # a GGUF file's KV cache, as llama.cpp's
    until_stop = generate(as_generate_py_holds_it, [prompt], 100, temperature=0, eos_id=tokenizer.stop_ids)[0]
    printed = greedy(gguf_run["files"]["q8_0"])
    assert printed.stdout == tokenizer.decode(prompt + until_stop) + "\n"
    assert "with the file's blocks (Q8_0 as int8)" in printed.stderr  # at the file's own precision, no flag needed


def test_fine_tuning_from_a_gguf_file_starts_where_the_run_ended(gguf_run, tmp_path):
    """Same weights, same vocabulary, same validation windows: the step-0 loss of a run started
    from the F32 file is the source run's last, to the bit (one thread each: the same sums)."""
    out = tmp_path / "ft"
    cli(ROOT / "train.py", "--init-from", gguf_run["files"]["f32"], *gguf_run["data"], *EVAL, "--max-steps", 2, "--eval-every", 2,
        "--save-every", 2, "--out", out)
    first, source = read_metrics(out / "metrics.jsonl")[0], read_metrics(gguf_run["run"] / "metrics.jsonl")[-1]
    assert first["step"] == 0 and first["val_loss"] == source["val_loss"]
    kept = out / "tokenizer.model"  # the file's vocabulary alone, not a copy of its weights
    assert gguf.GGUFReader(kept).tensors == [] and kept.stat().st_size < gguf_run["files"]["f32"].stat().st_size / 10
    text = "Lily and Tom played in the park. 123"
    assert open_tokenizer(kept).encode(text) == open_tokenizer(gguf_run["run"] / "tokenizer.model").encode(text)
    assert greedy(out).returncode == 0
