"""llama_mini.Tokenizer: a BPE trained on our text, Meta's Llama-2 tokenizer.model, and how a
file's family is told from its content. The Llama-3 and llama2.c families have test files of their own."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm

from llama_mini.run import corpus
from llama_mini.tokenizers import open_tokenizer
from llama_mini.tokenizers.spm import SentencePieceTokenizer, train_sentencepiece
from fixtures import LLAMA2_TOKENIZER, LLAMA3_TOKENIZER, require

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    lines = [line for story in corpus.stories(40_000) for line in story.splitlines()]
    return train_sentencepiece(lines, 400, tmp_path_factory.mktemp("tok") / "tok.model")


def test_trained_tokenizer_has_the_asked_vocabulary_and_llama_special_ids(trained):
    assert trained.n_words == 400
    assert (trained.bos_id, trained.eos_id, trained.pad_id) == (1, 2, -1)


def test_trained_tokenizer_round_trips_text_it_never_saw_through_byte_fallback(trained):
    text = 'Ünïcödé façade, 漢字 and 🙂 emoji;\n"quotes" — tabs\there.'
    ids = trained.encode(text, bos=False)
    assert trained.decode(ids) == text
    # Characters outside the training text become UTF-8 bytes: 🙂 is 4 byte tokens.
    assert len(trained.encode("🙂", bos=False)) >= 4


def test_encode_adds_bos_and_eos_only_when_asked(trained):
    body = trained.encode("Lily smiled.", bos=False)
    assert trained.encode("Lily smiled.") == [trained.bos_id] + body
    assert trained.encode("Lily smiled.", bos=True, eos=True) == [trained.bos_id] + body + [trained.eos_id]
    assert trained.decode([trained.bos_id] + body + [trained.eos_id]) == "Lily smiled."


def test_trained_tokenizer_learns_whole_words_of_its_text(trained):
    # A word that occurs thousands of times in the stories is a single piece.
    assert len(trained.encode("the", bos=False)) == 1  # "▁the"


def test_meta_llama2_tokenizer_encodes_hello_world_as_meta_does():
    require(LLAMA2_TOKENIZER)
    tok = open_tokenizer(LLAMA2_TOKENIZER)
    assert tok.encode("Hello world") == [1, 15043, 3186]
    assert (tok.n_words, tok.bos_id, tok.eos_id, tok.pad_id) == (32000, 1, 2, -1)
    assert tok.decode([1, 15043, 3186]) == "Hello world"


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        open_tokenizer(tmp_path / "nope.model")


def test_stop_ids_of_a_sentencepiece_model_are_its_eos(trained):
    assert trained.stop_ids == [trained.eos_id] == [2]


def test_the_family_is_told_by_content_not_by_name(trained, tmp_path):
    require(LLAMA3_TOKENIZER)
    shutil.copyfile(LLAMA3_TOKENIZER, tmp_path / "tokenizer.bin")
    shutil.copyfile(trained.model_path, tmp_path / "tiktoken.model")
    assert open_tokenizer(tmp_path / "tokenizer.bin").encode("This is a test sentence.", bos=False) == [2028, 374, 264, 1296, 11914, 13]
    assert isinstance(open_tokenizer(tmp_path / "tiktoken.model"), SentencePieceTokenizer)


@pytest.mark.parametrize("content", [b"", b"hello, I am a text file\n", bytes(range(256)) * 4], ids=["empty", "text", "binary"])
def test_a_file_of_no_known_family_is_refused_in_one_line(tmp_path, content):
    (tmp_path / "tokenizer.model").write_bytes(content)
    with pytest.raises(ValueError, match="tokenizer.model is not a tokenizer llama_mini reads"):
        open_tokenizer(tmp_path / "tokenizer.model")


def test_a_sentencepiece_model_without_bos_and_eos_is_refused_naming_the_file(tmp_path):
    lines = [line for story in corpus.stories(2000) for line in story.splitlines()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(tmp_path / "nobos"), vocab_size=200,
        bos_id=-1, eos_id=-1, unk_id=0, minloglevel=2,
    )
    with pytest.raises(ValueError, match="nobos.model is a SentencePiece model without BOS/EOS"):
        open_tokenizer(tmp_path / "nobos.model")


def test_a_failed_tokenizer_write_leaves_no_file_behind(tmp_path):
    """A full disk, as `ulimit -f` makes one: the write fails with OSError and leaves nothing,
    neither the tokenizer nor a temporary file."""
    code = (
        "import sys; from llama_mini.tokenizers.spm import train_sentencepiece\n"
        "try:\n"
        "    train_sentencepiece(['Tom had a red ball.', 'Sue was glad.'] * 200, 300, sys.argv[1])\n"
        "except OSError as e:\n"
        "    print('OSError', e.errno)\n"
    )

    def limit_file_size():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))

    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run(
        [sys.executable, "-B", "-c", code, str(out / "tok.model")], capture_output=True, text=True,
        cwd=ROOT, preexec_fn=limit_file_size, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120,
    )
    assert result.stdout.startswith("OSError"), result.stdout + result.stderr
    assert list(out.iterdir()) == []
