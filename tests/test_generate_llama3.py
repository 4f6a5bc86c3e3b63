"""generate.py on a Hugging Face Llama-3 folder: Meta's tokenizer found in original/, sampling
that stops at <|eot_id|>, Meta's chat format for --system, and the context of the checkpoint
with memory for the tokens actually used."""

import shutil

import pytest
from generate_cli_helpers import (
    assert_clean_error, expected_samples, favour_token, load_cli, run, tiny_llama3, write_llama3_tokenizer_json,
)

from llama_mini import generate, load_checkpoint
from llama_mini.model import Transformer
from llama_mini.tokenizers import open_tokenizer

BOS, EOS, START_HEADER, END_HEADER, EOT, NEWLINES = 128000, 128001, 128006, 128007, 128009, 271


@pytest.fixture(scope="module")
def hf_llama3(tmp_path_factory):
    """Ends a text with <|eot_id|> about one time in seven."""
    return tiny_llama3(tmp_path_factory.mktemp("llama3") / "hf", change=lambda model: favour_token(model, EOT, 5.0))


@pytest.fixture(scope="module")
def tokenizer(hf_llama3):
    return open_tokenizer(hf_llama3 / "original" / "tokenizer.model")


@pytest.mark.slow
def test_samples_stop_at_eot_and_print_what_generate_returns(hf_llama3, tokenizer):
    texts, lengths = expected_samples(hf_llama3, tokenizer, "Hello", 6, 12, seed=0)
    assert min(lengths) < 12 and max(lengths) == 12  # stopped at a stop id, and ran to the limit
    eos_only = expected_samples(hf_llama3, tokenizer, "Hello", 6, 12, seed=0, stop_ids=[EOS])[0]
    assert eos_only != texts and "<|eot_id|>" in "".join(eos_only)  # <|eot_id|> is what stops them
    result = run("--ckpt", hf_llama3, "--prompt", "Hello", "--max-new-tokens", 12, "--seed", 0, "--num-samples", 6)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "".join(f"--- sample {i + 1}/6\n{text}\n" for i, text in enumerate(texts))


def test_system_prompt_sends_metas_llama3_dialog(hf_llama3, tokenizer, monkeypatch, capsys):
    cli, prompts = load_cli(), []
    monkeypatch.setattr("llama_mini.inference.chat.generate_stream", lambda model, p, *a: prompts.append(p[0]) or iter([[13347], [None]]))  # None: the stop id
    cli.main(["--ckpt", str(hf_llama3), "--prompt", "Hi", "--system", "Be brief."])
    header = lambda role: [START_HEADER, *tokenizer.encode(role, bos=False), END_HEADER, NEWLINES]  # noqa: E731
    assert prompts == [
        [BOS] + header("system") + tokenizer.encode("Be brief.", bos=False) + [EOT]
        + header("user") + [13347] + [EOT] + header("assistant")  # "Hi" is 13347
    ]
    assert capsys.readouterr().out == "Hi\n"  # the answer alone, as Meta's chat_completion returns it


def test_the_context_is_the_checkpoints_and_the_cache_holds_only_the_tokens_used(hf_llama3, tokenizer, monkeypatch, capsys):
    cli, contexts, cache_shapes = load_cli(), [], []
    setup_cache = Transformer.setup_cache

    def recording_setup_cache(self, *args):
        setup_cache(self, *args)
        contexts.append(self.args.max_seq_len)
        cache_shapes.append(tuple(self.layers[0].attention.cache.k.shape))

    monkeypatch.setattr(Transformer, "setup_cache", recording_setup_cache)
    cli.main(["--ckpt", str(hf_llama3), "--prompt", "Hello there", "--max-new-tokens", "5", "--temperature", "0"])
    prompt = tokenizer.encode("Hello there")
    assert contexts == [131072]  # max_position_embeddings
    assert cache_shapes == [(1, 2, len(prompt) + 5, 8)]  # batch, KV heads, positions, head dim
    new = generate(load_checkpoint(hf_llama3), [prompt], 5, temperature=0, eos_id=tokenizer.stop_ids)[0]
    assert capsys.readouterr().out == "Hello there" + tokenizer.decode(new) + "\n"


@pytest.mark.slow
def test_a_folder_with_only_tokenizer_json_reads_it_as_metas_tokenizer(hf_llama3, tokenizer, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(hf_llama3, folder, ignore=shutil.ignore_patterns("original"))
    write_llama3_tokenizer_json(folder / "tokenizer.json")
    texts, _ = expected_samples(hf_llama3, tokenizer, "Hello", 2, 12, seed=0)
    result = run("--ckpt", folder, "--prompt", "Hello", "--max-new-tokens", 12, "--seed", 0, "--num-samples", 2)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "".join(f"--- sample {i + 1}/2\n{text}\n" for i, text in enumerate(texts))


def test_a_tokenizer_json_it_cannot_read_exactly_says_what_to_pass(hf_llama3, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(hf_llama3, folder, ignore=shutil.ignore_patterns("original"))
    (folder / "tokenizer.json").write_text('{"model": {"type": "Unigram"}}')
    result = run("--ckpt", folder, "--prompt", "Hi")
    assert_clean_error(result, "tokenizer.json is not a Llama-3 tokenizer.json", "--tokenizer", "original/")
