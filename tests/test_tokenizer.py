"""llama_mini.Tokenizer: a BPE trained on our text, and Meta's Llama-2 tokenizer.model."""

from pathlib import Path

import pytest

from llama_mini import corpus
from llama_mini.tokenizer import Tokenizer

META_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "llama2-tokenizer.model"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    lines = [line for story in corpus.stories(40_000) for line in story.splitlines()]
    return Tokenizer.train(lines, 400, tmp_path_factory.mktemp("tok") / "tok.model")


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
    if not META_TOKENIZER.is_file():
        pytest.skip(f"Meta's tokenizer fixture is not at {META_TOKENIZER}")
    tok = Tokenizer(META_TOKENIZER)
    assert tok.encode("Hello world") == [1, 15043, 3186]
    assert (tok.n_words, tok.bos_id, tok.eos_id, tok.pad_id) == (32000, 1, 2, -1)
    assert tok.decode([1, 15043, 3186]) == "Hello world"


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        Tokenizer(tmp_path / "nope.model")
