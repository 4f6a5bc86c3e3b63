"""A trained run through GGUF, as a user takes it: convert --to gguf, then generate.py --ckpt and
train.py --init-from on the GGUF file alone, its vocabulary read from the file."""

import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch

from llama_mini import generate, load_checkpoint
from llama_mini.tokenizers import open_tokenizer
from llama_mini.tokenizers.gguf import GgufSentencePiece
from llama_mini.training import corpus
from llama_mini.training.run_folder import read_metrics

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time"
# What the run and the fine-tuning run share: the same evaluation windows.
EVAL = ["--seq-len", 128, "--batch-size", 4, "--eval-iters", 2, "--sample-tokens", 0, "--device", "cpu"]


def cli(*args, check=True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert not check or result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """A small model trained for 300 steps on the built-in stories, then exported as F32 and Q8_0."""
    root = tmp_path_factory.mktemp("run")
    (root / "stories.txt").write_text("\n\n".join(corpus.stories(200_000, seed=5)), encoding="utf-8")
    data = ["--data", root / "stories.txt", "--cache-dir", root / "cache"]
    cli(ROOT / "train.py", *data, *EVAL, "--dim", 96, "--n-layers", 2, "--n-heads", 4, "--vocab-size", 512,
        "--max-steps", 300, "--warmup-steps", 20, "--eval-every", 300, "--save-every", 300, "--out", root / "run")
    files = {}
    for type in ("f32", "q8_0"):
        files[type] = root / f"model-{type}.gguf"
        cli("-m", "llama_mini.formats.convert", root / "run", files[type], "--to", "gguf", "--type", type)
    return dict(root=root, run=root / "run", data=data, files=files)


def greedy(ckpt, *flags):
    return cli(ROOT / "generate.py", "--ckpt", ckpt, "--prompt", PROMPT, "--temperature", 0, "--max-new-tokens", 100, *flags)


def test_generate_reads_an_f32_gguf_with_its_vocabulary_and_prints_the_runs_greedy_text(run):
    ours, theirs = greedy(run["run"]), greedy(run["files"]["f32"])
    assert theirs.stdout == ours.stdout and len(ours.stdout) > len(PROMPT) + 100
    assert f"loaded gguf checkpoint {run['files']['f32']}" in theirs.stderr
    assert isinstance(open_tokenizer(run["files"]["f32"]), GgufSentencePiece)


@torch.no_grad()
def test_a_q8_0_gguf_keeps_the_greedy_tokens_within_its_rounding(run):
    """Q8_0 rounds each weight to 1/254 of its block's largest: the greedy text of the trained
    model keeps at least 90 of its 100 tokens, and generate.py prints what generate() gives."""
    tokenizer = open_tokenizer(run["files"]["q8_0"])
    prompt = tokenizer.encode(PROMPT)
    new = generate(load_checkpoint(run["run"]), [prompt], 100, temperature=0)[0]
    quantized = generate(load_checkpoint(run["files"]["q8_0"]), [prompt], 100, temperature=0)[0]
    equal = sum(a == b for a, b in zip(new, quantized))
    print(f"Q8_0: {equal} of {len(new)} greedy tokens equal the float32 run's")
    assert len(new) == 100 and equal >= 90
    until_stop = generate(load_checkpoint(run["files"]["q8_0"]), [prompt], 100, temperature=0, eos_id=tokenizer.stop_ids)[0]
    assert greedy(run["files"]["q8_0"]).stdout == tokenizer.decode(prompt + until_stop) + "\n"


def test_fine_tuning_from_a_gguf_file_starts_where_the_run_ended(run, tmp_path):
    """Same weights, same vocabulary, same validation windows: the step-0 loss of a run started
    from the F32 file is the source run's last, to the bit (one thread each: the same sums)."""
    out = tmp_path / "ft"
    cli(ROOT / "train.py", "--init-from", run["files"]["f32"], *run["data"], *EVAL, "--max-steps", 2, "--eval-every", 2,
        "--save-every", 2, "--out", out)
    first, source = read_metrics(out / "metrics.jsonl")[0], read_metrics(run["run"] / "metrics.jsonl")[-1]
    assert first["step"] == 0 and first["val_loss"] == source["val_loss"]
    kept = out / "tokenizer.model"  # the file's vocabulary alone, not a copy of its weights
    assert gguf.GGUFReader(kept).tensors == [] and kept.stat().st_size < run["files"]["f32"].stat().st_size / 10
    text = "Lily and Tom played in the park. 123"
    assert open_tokenizer(kept).encode(text) == open_tokenizer(run["run"] / "tokenizer.model").encode(text)
    assert greedy(out).returncode == 0
