"""generate.py as a user runs it: a subprocess, its stdout, stderr and exit code."""

import importlib.util
import io
import runpy
import subprocess
import sys
from unittest import mock
from pathlib import Path

import pytest
import torch

from llama_mini import ModelArgs, Transformer, generate, save_checkpoint
from llama_mini.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_TOKENIZER = Path("/work/shared/fixtures/llama2-tokenizer.model")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random model over Meta's 32000-token vocabulary, saved with its tokenizer."""
    if not FIXTURE_TOKENIZER.is_file():
        pytest.skip("Meta's Llama-2 tokenizer fixture is absent")
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=32000, multiple_of=16, max_seq_len=64))
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt"), tokenizer_path=FIXTURE_TOKENIZER)


@pytest.fixture(scope="module")
def eos_ckpt(tmp_path_factory):
    """A tiny model whose samples end with EOS after about ten tokens, or run to the limit.

    Every token embedding carries a constant 1 in feature 0, so the final RMSNorm output has
    a large positive feature 0 at every position; only EOS's output row reads it, which
    gives EOS a steady logit of about 2 above the near-uniform rest of the vocabulary.
    """
    root = tmp_path_factory.mktemp("eos")
    text = "Tom had a red ball. He gave it to Sue, and she was glad. 'Thank you,' said Sue. " * 40
    tokenizer = Tokenizer.train(text.split(". "), vocab_size=300, model_path=root / "tok.model")
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=tokenizer.n_words, max_seq_len=64))
    with torch.no_grad():
        model.tok_embeddings.weight[:, 0] = 1.0
        model.output.weight[:, 0] = 0.0
        model.output.weight[tokenizer.eos_id, 0] = 0.37
    return save_checkpoint(model, root / "ckpt", tokenizer_path=tokenizer.model_path)


def expected_samples(ckpt, prompt, n_samples, max_new_tokens, seed):
    """What generate.py must print: each sample as generate() returns it for seed + i, decoded."""
    from llama_mini import load_checkpoint

    tokenizer, model = Tokenizer(ckpt / "tokenizer.model"), load_checkpoint(ckpt)
    ids = tokenizer.encode(prompt)
    news = [generate(model, [ids], max_new_tokens, eos_id=tokenizer.eos_id, seed=seed + i)[0] for i in range(n_samples)]
    return [tokenizer.decode(ids + new) for new in news], [len(new) for new in news]


def run(*args, stdin=""):
    return subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), *map(str, args)],
        input=stdin, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )


def test_prompt_is_continued_with_exactly_the_decoded_tokens(ckpt):
    from llama_mini import load_checkpoint

    result = run("--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 24, "--temperature", 0)
    assert result.returncode == 0, result.stderr
    tokenizer = Tokenizer(ckpt / "tokenizer.model")
    prompt = tokenizer.encode("Once upon a time")
    new = generate(load_checkpoint(ckpt), [prompt], 24, temperature=0, eos_id=tokenizer.eos_id)[0]
    assert result.stdout == tokenizer.decode(prompt + new) + "\n"


def test_samples_that_reach_eos_print_what_generate_returns(eos_ckpt):
    texts, lengths = expected_samples(eos_ckpt, "Tom", 16, 24, seed=0)
    assert 0 in lengths and 24 in lengths and any(0 < n < 24 for n in lengths)  # EOS first, never, midway
    result = run("--ckpt", eos_ckpt, "--prompt", "Tom", "--max-new-tokens", 24, "--seed", 0, "--num-samples", 16)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == "".join(f"--- sample {i + 1}/16\n{text}\n" for i, text in enumerate(texts))


def test_one_sample_that_ends_at_eos_prints_its_text(eos_ckpt):
    texts, lengths = expected_samples(eos_ckpt, "Tom", 1, 24, seed=3)
    assert 0 < lengths[0] < 24  # this seed ends at EOS
    result = run("--ckpt", eos_ckpt, "--prompt", "Tom", "--max-new-tokens", 24, "--seed", 3)
    assert (result.returncode, result.stderr.count("Traceback")) == (0, 0), result.stderr
    assert result.stdout == texts[0] + "\n"


def load_cli():
    spec = importlib.util.spec_from_file_location("generate_cli", ROOT / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chat_sends_the_whole_dialog_each_turn(ckpt, monkeypatch, capsys):
    cli = load_cli()
    prompts, answers = [], iter([[450, 1234], [3869]])  # ▁The ..., ▁Yes
    monkeypatch.setattr(cli, "generate_stream", lambda model, p, *a: prompts.append(p[0]) or ([t] for t in next(answers)))
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nWhy?\n"))
    cli.main(["--ckpt", str(ckpt), "--chat", "--system", "Be brief."])
    tokenizer = Tokenizer(ckpt / "tokenizer.model")
    first_answer = tokenizer.decode([450, 1234])
    assert prompts == [
        tokenizer.encode_dialog([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]),
        tokenizer.encode_dialog([
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": first_answer}, {"role": "user", "content": "Why?"},
        ]),
    ]
    # each answer prints as Meta's chat_completion returns it, tokenizer.decode(answer):
    # no leading space from the "▁" of its first piece
    assert capsys.readouterr().out == f"> {first_answer}\n> {tokenizer.decode([3869])}\n> \n"
    assert not first_answer.startswith(" ")


def test_chat_runs_to_the_end_of_stdin(ckpt):
    result = run("--ckpt", ckpt, "--chat", "--max-new-tokens", 5, "--seed", 0, stdin="Hi\nAnd then?\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("> ") == 3  # two answered turns, then the prompt that met end of input


def run_in_process(*args, capsys):
    """generate.py's __main__ block, run here: the same error handling without a new interpreter."""
    with pytest.raises(SystemExit) as exit_info:
        with mock.patch("sys.argv", ["generate.py", *map(str, args)]):
            runpy.run_path(str(ROOT / "generate.py"), run_name="__main__")
    return subprocess.CompletedProcess(args, exit_info.value.code, "", capsys.readouterr().err)


def assert_clean_error(result, *words):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "error:" in result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def test_negative_temperature_is_refused(ckpt):
    assert_clean_error(run("--ckpt", ckpt, "--prompt", "Hi", "--temperature", -1), "--temperature", ">= 0")


@pytest.mark.parametrize(
    "flags, words",
    [(["--top-p", 1.5], ["--top-p", "(0, 1]"]), (["--top-p", 0], ["--top-p"]), (["--top-k", -2], ["--top-k", ">= 0"]),
     (["--max-new-tokens", 0], ["--max-new-tokens", ">= 1"])],
    ids=["top_p_above_1", "top_p_0", "top_k", "max_new_tokens"],
)
def test_bad_flags_are_refused(ckpt, flags, words, capsys):
    assert_clean_error(run_in_process("--ckpt", ckpt, "--prompt", "Hi", *flags, capsys=capsys), *words)


def test_missing_checkpoint_is_named(tmp_path, capsys):
    result = run_in_process("--ckpt", tmp_path / "nope", "--prompt", "Hi", capsys=capsys)
    assert_clean_error(result, "checkpoint not found", "nope")


def test_prompt_longer_than_context_gives_length_and_limit(ckpt):
    assert_clean_error(run("--ckpt", ckpt, "--prompt", " ".join(["word"] * 80), "--max-new-tokens", 4), "81 tokens", "context is 64 tokens")


def test_tokenizer_of_another_vocabulary_is_refused(tmp_path):
    if not FIXTURE_TOKENIZER.is_file():
        pytest.skip("Meta's Llama-2 tokenizer fixture is absent")
    save_checkpoint(Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=500, multiple_of=16)), tmp_path)
    result = run("--ckpt", tmp_path, "--tokenizer", FIXTURE_TOKENIZER, "--prompt", "Hi")
    assert_clean_error(result, "has 32000 tokens but the model's vocabulary has 500")


def test_truncated_weights_are_reported(ckpt, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.model"):
        (broken / name).write_bytes((ckpt / name).read_bytes())
    (broken / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:1000])
    assert_clean_error(run("--ckpt", broken, "--prompt", "Hi"), "model.safetensors is truncated or corrupt")


def test_unknown_format_is_reported(tmp_path, capsys):
    (tmp_path / "tokenizer.model").write_bytes(b"")
    assert_clean_error(run_in_process("--ckpt", tmp_path, "--prompt", "Hi", capsys=capsys), "not a checkpoint folder")
