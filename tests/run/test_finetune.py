"""Fine-tuning: `train.py --init-from CKPT` starts from any checkpoint load_checkpoint reads,
with its shape and tokenizer, and makes an ordinary run folder."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import llama_mini
from llama_mini.run import corpus
from llama_mini.formats.checkpoint import save_checkpoint
from llama_mini.run.folder import read_metrics
from llama_mini.tokenizers.spm import train_sentencepiece
from llama_mini.run.start import start_run
from llama_mini.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
import train as train_cli  # noqa: E402  (the top-level script, called in-process)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # one_thread: tests/conftest.py; slow: a run trained first

# What the source run and the fine-tuning runs share: the same evaluation windows.
EVAL = ["--seq-len", 32, "--batch-size", 4, "--eval-iters", 2, "--sample-tokens", 0, "--device", "cpu"]
SOURCE_SHAPE = ["--dim", 32, "--n-layers", 2, "--n-heads", 2, "--n-kv-heads", 1, "--multiple-of", 32, "--vocab-size", 400]


def cli(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *map(str, args)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict:
    """A 20-step run on one text: the checkpoint every fine-tuning run here starts from."""
    root = tmp_path_factory.mktemp("source")
    (root / "a.txt").write_text("\n\n".join(corpus.stories(60_000, seed=21)), encoding="utf-8")
    data = ["--data", root / "a.txt", "--cache-dir", root / "cache"]
    cli(ROOT / "train.py", *data, *EVAL, *SOURCE_SHAPE, "--max-steps", 20, "--save-every", 20, "--eval-every", 20, "--out", root / "run")
    last = read_metrics(root / "run" / "metrics.jsonl")[-1]
    return dict(run=root / "run", data=data, root=root, val_loss=last["val_loss"])


@pytest.fixture(scope="module")
def finetuned(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ft") / "run"
    cli(ROOT / "train.py", "--init-from", source["run"], *source["data"], *EVAL, "--max-steps", 4, "--save-every", 2,
        "--eval-every", 2, "--out", out)
    return out


def refused(capsys, *args) -> str:
    assert train_cli.main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error: ") == 1, err
    return err.strip().splitlines()[-1]


def test_fine_tuning_starts_exactly_where_the_source_run_ended(source, finetuned):
    """Same weights, same validation windows, same arithmetic: the step-0 loss is the source's
    last one to the bit (both processes run one thread, so every sum adds in the same order)."""
    first = read_metrics(finetuned / "metrics.jsonl")[0]
    assert first["step"] == 0 and first["val_loss"] == source["val_loss"]
    later = read_metrics(finetuned / "metrics.jsonl")[-1]
    assert later["step"] == 4 and later["val_loss"] != source["val_loss"]  # and then it trains


def test_fine_tuned_run_takes_the_checkpoints_shape_and_tokenizer(source, finetuned):
    ours = json.loads((finetuned / "step-000004" / "config.json").read_text())["llama_mini"]
    theirs = json.loads((source["run"] / "step-000020" / "config.json").read_text())["llama_mini"]
    assert ours == theirs and (ours["dim"], ours["n_layers"], ours["n_kv_heads"], ours["multiple_of"]) == (32, 2, 1, 32)
    w1 = llama_mini.load_checkpoint(finetuned / "step-000004").layers[0].feed_forward.w1.weight
    assert w1.shape == (96, 32)  # 2/3 of 4 * 32, rounded up to a multiple of 32 (256 by default)
    assert (finetuned / "tokenizer.model").read_bytes() == (source["run"] / "tokenizer.model").read_bytes()


@pytest.mark.parametrize("fmt", ["native", "meta", "hf"])
def test_init_from_reads_every_checkpoint_format(source, tmp_path, fmt):
    """Meta's and Hugging Face's files hold the same float32 tensors (HF's query/key row order
    is a permutation, undone exactly on load), so the loss is the same to the bit."""
    tokenizer = source["run"] / "tokenizer.model"
    folder = save_checkpoint(llama_mini.load_checkpoint(source["run"]), tmp_path / fmt, format=fmt, tokenizer_path=tokenizer)
    cfg = TrainConfig(init_from=str(folder), data=str(source["data"][1]), cache_dir=str(source["data"][3]),
                      out=str(tmp_path / "run"), seq_len=32, batch_size=4, eval_iters=2, device="cpu")
    run = start_run(cfg)
    assert run.evaluate()["val_loss"] == source["val_loss"]
    assert run.args.dim == 32 and run.cfg.n_kv_heads == 1 and run.trainer.step == 0
    run.close()


def test_fine_tuned_run_resumes_bitwise_like_any_run(source, finetuned, tmp_path):
    """Stopped after step 2 and resumed, with no shape flags and no --init-from, it ends with the weights of the run that did not stop."""
    run = tmp_path / "run"
    shutil.copytree(finetuned, run)
    shutil.rmtree(run / "step-000004")
    (run / "latest").write_text("step-000002\n")
    cli(ROOT / "train.py", *source["data"], *EVAL, "--max-steps", 4, "--save-every", 2, "--eval-every", 2, "--out", run, "--resume")
    ref, ours = load_file(finetuned / "step-000004" / "model.safetensors"), load_file(run / "step-000004" / "model.safetensors")
    assert ref.keys() == ours.keys() and all(torch.equal(ref[k], ours[k]) for k in ref)


def test_fine_tuned_run_generates_and_converts(finetuned, tmp_path):
    out = cli(ROOT / "generate.py", "--ckpt", finetuned, "--prompt", "Once upon a time", "--max-new-tokens", 8,
              "--temperature", 0).stdout
    assert "Once upon a time" in out
    cli("-m", "llama_mini.formats.convert", finetuned, tmp_path / "hf", "--to", "hf")
    model, hf = llama_mini.load_checkpoint(finetuned), llama_mini.load_checkpoint(tmp_path / "hf")
    tokens = torch.randint(0, 400, (2, 16))
    torch.testing.assert_close(hf(tokens), model(tokens))


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--dim", 48], "--dim 48 (it has 32); leave those flags out"),
        (["--n-layers", 3], "--n-layers 3 (it has 2); leave those flags out"),
        (["--n-heads", 4, "--n-kv-heads", 2], "--n-heads 4 (it has 2), --n-kv-heads 2 (it has 1); leave those flags out"),
        (["--multiple-of", 256], "--multiple-of 256 (it has 32); leave those flags out"),
        (["--vocab-size", 500], "--vocab-size 500 (it has 400); leave those flags out"),
        (["--norm", "layernorm"], "--norm layernorm (it has rmsnorm); leave those flags out"),
        (["--no-tie-embeddings"], "--tie-embeddings False (it has True); leave those flags out"),
        (["--seq-len", 64], "--seq-len 64 is longer than the context of"),
    ],
)
def test_shape_flag_that_disagrees_with_the_checkpoint_is_refused(capsys, source, tmp_path, flags, fragment):
    err = refused(capsys, "--init-from", source["run"], *source["data"], *EVAL, *flags, "--out", tmp_path / "run")
    assert fragment in err
    assert not (tmp_path / "run").exists()


def test_shape_flags_that_agree_with_the_checkpoint_are_accepted(source, tmp_path):
    cfg = TrainConfig(init_from=str(source["run"]), data=str(source["data"][1]), cache_dir=str(source["data"][3]),
                      out=str(tmp_path / "run"), seq_len=32, dim=32, n_layers=2, norm="rmsnorm", vocab_size=400, device="cpu")
    start_run(cfg).close()


def test_checkpoint_without_a_tokenizer_needs_one_named(capsys, source, tmp_path):
    bare = save_checkpoint(llama_mini.load_checkpoint(source["run"]), tmp_path / "models" / "bare")
    err = refused(capsys, "--init-from", bare, *source["data"], *EVAL, "--out", tmp_path / "run")
    assert f"no tokenizer for {bare}: neither it nor its parent holds tokenizer.model" in err and "pass --tokenizer PATH" in err
    args = ["--init-from", bare, "--tokenizer", source["run"] / "tokenizer.model", *source["data"], *EVAL, "--max-steps", 1]
    assert train_cli.main([str(a) for a in [*args, "--out", tmp_path / "run"]]) == 0


def test_tokenizer_larger_than_the_checkpoints_vocabulary_is_refused(capsys, source, tmp_path):
    big = train_sentencepiece("\n".join(corpus.stories(30_000, seed=2)).splitlines(), 500, tmp_path / "big.model")
    err = refused(capsys, "--init-from", source["run"], "--tokenizer", big.model_path, *source["data"], *EVAL,
                  "--out", tmp_path / "run")
    assert f"{big.model_path} has 500 tokens but the model's vocabulary has 400 ({source['run']})" in err


def test_tokenizer_smaller_than_the_checkpoints_vocabulary_is_refused_before_any_work(capsys, source, tmp_path):
    """Its ids would train and save, and the run's own sample, generate.py and convert would then
    refuse the run: refused before the data is tokenized with it."""
    small = train_sentencepiece("\n".join(corpus.stories(30_000, seed=2)).splitlines(), 350, tmp_path / "small.model")
    cache = source["data"][3]
    before = sorted(p.name for p in cache.iterdir())
    err = refused(capsys, "--init-from", source["run"], "--tokenizer", small.model_path, *source["data"], *EVAL,
                  "--out", tmp_path / "run")
    assert f"{small.model_path} has 350 tokens but the model's vocabulary has 400 ({source['run']})" in err
    assert not (tmp_path / "run").exists() and sorted(p.name for p in cache.iterdir()) == before


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_init_from_a_quantized_checkpoint_starts_from_its_dequantized_weights(source, tmp_path, method):
    """generate.py runs a quantized checkpoint, so --init-from takes it: each layer's weight is
    what its codes stand for, in float32, said in one line. With a learning rate of 1e-12 the
    saved weights are still those (within 1e-9), and far from the source run's own."""
    quantized = tmp_path / method
    cli("-m", "llama_mini.formats.convert", source["run"], quantized, "--to", "native", "--quantize", method)
    result = cli(ROOT / "train.py", "--init-from", quantized, *source["data"], *EVAL, "--max-steps", 1, "--lr", 1e-12,
                 "--warmup-steps", 0, "--out", tmp_path / "run")
    assert f"{quantized} holds {method} weights: fine-tuning starts from them, dequantized to float32" in result.stderr
    assert "Traceback" not in result.stderr
    codes = llama_mini.load_checkpoint(quantized)
    saved, full = load_file(tmp_path / "run" / "step-000001" / "model.safetensors"), llama_mini.load_checkpoint(source["run"])
    layers = {name.removesuffix(".weight") for name in saved if name.endswith(".weight") and saved[name].dim() == 2}
    layers.discard("tok_embeddings")
    assert len(layers) == 2 * 7 + 1  # every linear layer, the head included
    for name in layers:
        weight = codes.get_submodule(name).dequantize()
        torch.testing.assert_close(saved[f"{name}.weight"], weight, rtol=0, atol=1e-9)
        assert (weight - full.get_submodule(name).weight).abs().max() > 1e-5  # the quantized weights, not the source's
