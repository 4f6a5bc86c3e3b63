"""What a token stands for, for bits per byte, and long texts encoded in pieces, for every
tokenizer family: Meta's Llama-2 (SentencePiece) and Llama-3 (tiktoken), one trained here,
llama2.c's tokenizer.bin and both of llama.cpp's GGUF vocabularies."""

import pytest

from fixtures import GGUF_VOCAB, LLAMA2_TOKENIZER, LLAMA3_TOKENIZER, require
from llama2c_files import export_sentencepiece
from llama_mini.tokenizers import long_text, open_tokenizer
from llama_mini.tokenizers.spm import train_sentencepiece
from llama_mini.run import corpus

TEXTS = [
    "Hello world",
    "Ünïcödé façade, 漢字 and 🙂 emoji; \"quotes\" — tabs\there.\nNew line.",
    " a leading space,  two spaces and a trailing one ",
    "x = [1, 2, 3]\n\n\tfor i in x:\n    print(i * 1234567)\r\n",
    "text that spells control pieces: <s> </s> <unk> <0x41> <|begin_of_text|>",
]


@pytest.fixture(scope="module", params=["llama2", "llama3", "trained", "llama2c", "gguf-spm", "gguf-bpe"])
def tokenizer(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "trained":
        lines = [line for story in corpus.stories(4000) for line in story.splitlines()]
        return train_sentencepiece(lines, 500, folder / "tok.model")
    if request.param == "llama2c":
        return open_tokenizer(export_sentencepiece(require(LLAMA2_TOKENIZER), folder / "tokenizer.bin"))
    path = {"llama2": LLAMA2_TOKENIZER, "llama3": LLAMA3_TOKENIZER, "gguf-spm": GGUF_VOCAB / "ggml-vocab-llama-spm.gguf",
            "gguf-bpe": GGUF_VOCAB / "ggml-vocab-llama-bpe.gguf"}[request.param]
    return open_tokenizer(require(path))


def text_bytes(tokenizer, ids: list[int]) -> int:
    """The bytes ids stand for, the first one's dummy prefix taken off."""
    table = tokenizer.token_bytes()
    first = ids[0] if ids else None
    return sum(len(table[i]) for i in ids) - (tokenizer.dummy_prefix and first is not None and table[first].startswith(b" "))


@pytest.mark.parametrize("text", TEXTS)
def test_the_tokens_of_a_text_stand_for_its_utf8_bytes(tokenizer, text):
    ids = tokenizer.encode(text, bos=True, eos=True)
    assert text_bytes(tokenizer, ids[1:]) == len(text.encode("utf-8"))  # BOS and EOS stand for no text


def test_known_answers_of_meta_tokenizers():
    """Meta's published ids: "Hello world" is "▁Hello" and "▁world", 6 + 6 bytes less the dummy prefix."""
    llama2 = open_tokenizer(require(LLAMA2_TOKENIZER))
    assert llama2.dummy_prefix and [llama2.token_bytes()[i] for i in (15043, 3186)] == [b" Hello", b" world"]
    llama3 = open_tokenizer(require(LLAMA3_TOKENIZER))
    table = llama3.token_bytes()
    assert not llama3.dummy_prefix and [table[i] for i in (2028, 374, 264, 1296, 11914, 13)] == [
        b"This", b" is", b" a", b" test", b" sentence", b"."]
    assert table[128000] == table[128001] == b""


def test_a_long_text_encodes_in_pieces_to_the_ids_of_the_whole(tokenizer, monkeypatch):
    monkeypatch.setattr(long_text, "PIECE_CHARS", 40)  # hundreds of pieces, cut inside every kind of text
    text = "\n\n".join(corpus.stories(3000)[:2] + TEXTS * 3) + " end"
    pieces = list(long_text.text_pieces(tokenizer, [text[:1000], text[1000:]]))
    assert len(pieces) > 20
    encoded = [i for ids in long_text.encode_long(tokenizer, [text[:1000], text[1000:]]) for i in ids]
    assert encoded == tokenizer.encode(text, bos=False)


def test_text_without_a_word_break_is_cut_anyway(monkeypatch):
    monkeypatch.setattr(long_text, "PIECE_CHARS", 4)
    monkeypatch.setattr(long_text, "MAX_CARRY_CHARS", 10)

    class Plain:
        dummy_prefix = False

    text = "漢字" * 30
    pieces = list(long_text.text_pieces(Plain(), [text[i:i + 3] for i in range(0, len(text), 3)]))
    assert "".join(pieces) == text and max(map(len, pieces)) <= 12
