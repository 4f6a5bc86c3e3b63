"""generate.py as a user runs it: a subprocess, its stdout, stderr and exit code."""

import io
import os
import subprocess
import sys

import pytest
import torch
from llama2c_files import export_sentencepiece
from generate_cli_helpers import (
    LLAMA2_TOKENIZER as LLAMA2_TOKENIZER, ROOT, assert_clean_error, expected_samples, favour_token, load_cli, run,
    run_in_process,
)

from llama_mini import ModelArgs, Transformer, generate, save_checkpoint
from llama_mini.tokenizers import open_tokenizer
from llama_mini.tokenizers.spm import train_sentencepiece
from fixtures import require


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random model over Meta's 32000-token vocabulary, saved with its tokenizer."""
    require(LLAMA2_TOKENIZER)
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=32000, multiple_of=16, max_seq_len=64))
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt"), tokenizer_path=LLAMA2_TOKENIZER)


@pytest.fixture(scope="module")
def eos_ckpt(tmp_path_factory):
    """A tiny model whose samples end with EOS after about ten tokens, or run to the limit."""
    root = tmp_path_factory.mktemp("eos")
    text = "Tom had a red ball. He gave it to Sue, and she was glad. 'Thank you,' said Sue. " * 40
    tokenizer = train_sentencepiece(text.split(". "), vocab_size=300, model_path=root / "tok.model")
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=tokenizer.n_words, max_seq_len=64))
    return save_checkpoint(favour_token(model, tokenizer.eos_id, 2.1), root / "ckpt", tokenizer_path=tokenizer.model_path)


def test_prompt_is_continued_with_exactly_the_decoded_tokens(ckpt):
    from llama_mini import load_checkpoint

    result = run("--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 24, "--temperature", 0)
    assert result.returncode == 0, result.stderr
    tokenizer = open_tokenizer(ckpt / "tokenizer.model")
    prompt = tokenizer.encode("Once upon a time")
    new = generate(load_checkpoint(ckpt), [prompt], 24, temperature=0, eos_id=tokenizer.eos_id)[0]
    assert result.stdout == tokenizer.decode(prompt + new) + "\n"


@pytest.mark.slow
def test_samples_that_reach_eos_print_what_generate_returns(eos_ckpt):
    texts, lengths = expected_samples(eos_ckpt, open_tokenizer(eos_ckpt / "tokenizer.model"), "Tom", 16, 24, seed=0)
    assert 0 in lengths and 24 in lengths and any(0 < n < 24 for n in lengths)  # EOS first, never, midway
    result = run("--ckpt", eos_ckpt, "--prompt", "Tom", "--max-new-tokens", 24, "--seed", 0, "--num-samples", 16)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == "".join(f"--- sample {i + 1}/16\n{text}\n" for i, text in enumerate(texts))


def test_one_sample_that_ends_at_eos_prints_its_text(eos_ckpt):
    texts, lengths = expected_samples(eos_ckpt, open_tokenizer(eos_ckpt / "tokenizer.model"), "Tom", 1, 24, seed=3)
    assert 0 < lengths[0] < 24  # this seed ends at EOS
    result = run("--ckpt", eos_ckpt, "--prompt", "Tom", "--max-new-tokens", 24, "--seed", 3)
    assert (result.returncode, result.stderr.count("Traceback")) == (0, 0), result.stderr
    assert result.stdout == texts[0] + "\n"


def test_llama2c_tokenizer_bin_encodes_the_prompt_and_prints_the_text(eos_ckpt, tmp_path):
    """llama2.c's tokenizer.bin of the checkpoint's own vocabulary: the same ids, so the same text."""
    tokenizer = open_tokenizer(eos_ckpt / "tokenizer.model")
    texts, _ = expected_samples(eos_ckpt, tokenizer, "Tom and Sue", 3, 24, seed=0)
    tokenizer_bin = export_sentencepiece(eos_ckpt / "tokenizer.model", tmp_path / "tokenizer.bin")
    result = run("--ckpt", eos_ckpt, "--tokenizer", tokenizer_bin, "--prompt", "Tom and Sue", "--max-new-tokens", 24,
                 "--seed", 0, "--num-samples", 3)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "".join(f"--- sample {i + 1}/3\n{text}\n" for i, text in enumerate(texts))


def test_chat_sends_the_whole_dialog_each_turn(ckpt, monkeypatch, capsys):
    cli = load_cli()
    prompts, answers = [], iter([[450, 1234], [3869]])  # ▁The ..., ▁Yes
    monkeypatch.setattr("llama_mini.inference.chat.generate_stream", lambda model, p, *a: prompts.append(p[0]) or ([t] for t in next(answers)))
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"Hi\nWhy?\n")))
    # The second prompt is 39 tokens: with 8 new ones it fits the 64-token context whole.
    cli.main(["--ckpt", str(ckpt), "--chat", "--system", "Be brief.", "--max-new-tokens", "8"])
    tokenizer = open_tokenizer(ckpt / "tokenizer.model")
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
    assert_clean_error(run("--ckpt", ckpt, "--prompt", " ".join(["word"] * 80), "--max-new-tokens", 4), "prompt of 81 tokens", "exceeds max_seq_len 64, the model's context",
                       "shorten the prompt (or raise --max-seq-len)")


def test_tokenizer_of_another_vocabulary_is_refused(tmp_path):
    require(LLAMA2_TOKENIZER)
    save_checkpoint(Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=500, multiple_of=16)), tmp_path)
    result = run("--ckpt", tmp_path, "--tokenizer", LLAMA2_TOKENIZER, "--prompt", "Hi")
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


def test_a_sentencepiece_tokenizer_without_bos_and_eos_is_refused_in_one_line(eos_ckpt, tmp_path, capsys):
    import sentencepiece as spm

    from llama_mini.run import corpus

    lines = [line for story in corpus.stories(2000) for line in story.splitlines()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(tmp_path / "nobos"), vocab_size=200,
        bos_id=-1, eos_id=-1, unk_id=0, minloglevel=2,
    )
    result = run_in_process("--ckpt", eos_ckpt, "--tokenizer", tmp_path / "nobos.model", "--prompt", "Hi", capsys=capsys)
    assert_clean_error(result, "nobos.model is a SentencePiece model without BOS/EOS")


# --- Issue 13's bad input: one `error:` line that names the flag or the file, never a traceback ---

BAD_INPUT = {
    # name: (arguments after --ckpt, stdin, words the message must hold)
    "temperature nan": (["--prompt", "Hi", "--temperature", "nan"], "", ["--temperature must be a finite number >= 0", "got nan"]),
    "temperature inf": (["--prompt", "Hi", "--temperature", "inf"], "", ["--temperature must be a finite number >= 0", "got inf"]),
    "top-p nan": (["--prompt", "Hi", "--top-p", "nan"], "", ["--top-p must be a finite number in (0, 1]"]),
    "seed past 2**64": (["--prompt", "Hi", "--seed", 10**24], "", ["--seed must be in [0, 2**64)"]),
    "seed 1e24": (["--prompt", "Hi", "--seed", "1e24"], "", ["--seed", "invalid int value: '1e24'"]),
    "max-seq-len absurd": (["--prompt", "Hi", "--max-seq-len", 10**10], "", ["--max-seq-len must be in [1, 16777216] tokens", "got 10000000000"]),
    "max-seq-len negative": (["--prompt", "Hi", "--max-seq-len", -4], "", ["--max-seq-len must be in [1, 16777216] tokens", "got -4"]),
    "device meta": (["--prompt", "Hi", "--device", "meta"], "", ["unknown device 'meta'", "use cpu, cuda"]),
    "device xla": (["--prompt", "Hi", "--device", "xla"], "", ["unknown device 'xla'", "use cpu, cuda"]),
    "prompt not UTF-8": (["--prompt", b"caf\xe9"], "", ["--prompt is not UTF-8 text (byte 0xe9 at offset 3)"]),
    "system not UTF-8": (["--prompt", "Hi", "--system", b"\xff!"], "", ["--system is not UTF-8 text (byte 0xff"]),
    "prompt file not UTF-8": (["--prompt-file", "{latin1.txt}"], "", ["latin1.txt is not UTF-8 text (byte 0xe9"]),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_refused_in_one_line(eos_ckpt, tmp_path, monkeypatch, capsys, case):
    """In this process (generate.py's __main__ block): bytes arguments are decoded as Python
    decodes argv (os.fsdecode), stdin is bytes."""
    args, stdin, words = BAD_INPUT[case]
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    args = [str(tmp_path / a[1:-1]) if isinstance(a, str) and a.startswith("{") else a for a in args]
    args = [os.fsdecode(a) if isinstance(a, bytes) else a for a in args]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8", "surrogateescape"))))
    assert_clean_error(run_in_process("--ckpt", eos_ckpt, *args, "--max-new-tokens", 4, capsys=capsys), *words)


@pytest.mark.parametrize("flags, positions", [(["--prompt", "Hi", "--max-new-tokens", 16777000], 16777004),
                                              (["--chat"], 16777216)])
def test_a_kv_cache_the_device_cannot_hold_is_refused_in_one_line_before_it_is_allocated(eos_ckpt, monkeypatch, capsys,
                                                                                      flags, positions):
    """A 16M-position cache of this model is 4 GiB; with 1 GiB free it is refused, naming both ("Hi" is 4 tokens)."""
    from llama_mini.support import memory

    monkeypatch.setattr(memory, "free_bytes", lambda device: 2**30)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"Hi\n")))
    result = run_in_process("--ckpt", eos_ckpt, *flags, "--max-seq-len", 16777216, capsys=capsys)
    assert_clean_error(result, f"error: a KV cache of {positions} positions needs at least 4.0 GiB, and cpu has 1.0 GiB "
                               "free; lower --max-seq-len or --max-new-tokens")


@pytest.mark.parametrize("case", ["prompt not UTF-8", "system not UTF-8"])
def test_bytes_that_are_not_utf8_are_refused_by_the_real_cli(eos_ckpt, case):
    args, stdin, words = BAD_INPUT[case]
    assert_clean_error(run("--ckpt", eos_ckpt, *args, "--max-new-tokens", 4, stdin=stdin), *words)


@pytest.mark.parametrize("on_kernels", [False, True])
def test_bf16_off_the_kernels_on_a_cpu_without_fast_bf16_products_says_what_it_costs(ckpt, capsys, monkeypatch, on_kernels):
    """--compile (or a CPU the kernels do not run on) leaves bf16 products to torch: where they are
    slow, one line says how slow and what to use. On the kernels bf16 runs in float32 tiles."""
    from llama_mini.support import device
    from llama_mini.inference import loading as inference

    cli = load_cli()
    monkeypatch.setattr(device, "bfloat16_slowdown", lambda: 14.6)
    monkeypatch.setattr(inference, "on_kernels", lambda model: on_kernels)
    cli.main(["--ckpt", str(ckpt), "--prompt", "Hi", "--max-new-tokens", "2", "--dtype", "bfloat16"])
    note = ("note: on this CPU torch multiplies bfloat16 matrices 15x slower than float32 ones (it has no AVX-512 "
            "BF16 or AMX); --dtype float32 runs faster here")
    assert capsys.readouterr().err.count(note) == (not on_kernels)


def test_kernels_off_runs_model_pys_own_code_and_gives_transformers_greedy_tokens(tmp_path):
    """--kernels off: the plain model, nothing compiled or loaded (an empty kernel cache and a
    compiler that fails stay untouched), and the greedy text of transformers' reading of the weights."""
    transformers = pytest.importorskip("transformers")
    from llama_mini.formats.hf import hf_config_from_args, to_hf_state_dict

    fixture = require(LLAMA2_TOKENIZER)
    torch.manual_seed(3)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32000, multiple_of=32, max_seq_len=128)).eval()
    save_checkpoint(model, tmp_path / "ckpt", tokenizer_path=fixture)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config_from_args(model.args))).eval()
    theirs.load_state_dict(to_hf_state_dict(model.state_dict(), model.args), strict=False)
    theirs.generation_config.eos_token_id = None
    tokenizer = open_tokenizer(fixture)
    prompt = tokenizer.encode("Hello", bos=True)
    expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0)[0].tolist()
    env = {"LLAMA_MINI_CACHE": str(tmp_path / "cache"), "CXX": "/bin/false"}
    result = subprocess.run([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(tmp_path / "ckpt"), "--prompt", "Hello",
                             "--max-new-tokens", "30", "--temperature", "0", "--kernels", "off"],
                            capture_output=True, text=True, env={**os.environ, **env}, cwd=ROOT, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout == tokenizer.decode(expected) + "\n"
    assert "llama_mini:" not in result.stderr and not (tmp_path / "cache").exists()
