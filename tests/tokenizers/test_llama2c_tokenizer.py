"""llama2.c's tokenizer.bin: written here as llama2.c's tokenizer.py exports it, read by open_tokenizer(path).

The reference is the SentencePiece model the file was exported from: llama2.c's encoder is
SentencePiece's BPE redone in C (run.c, encode), so both must give the same ids and text.
Its merge order (highest score first, leftmost on ties) is checked on a vocabulary small
enough to work out by hand.
"""

from pathlib import Path

import pytest
import sentencepiece as spm
from llama2c_files import BYTE_PIECES, export_sentencepiece, write_tokenizer_bin

from llama_mini.run import corpus
from llama_mini.tokenizers.llama2c_vocab import Llama2cTokenizer
from llama_mini.tokenizers import open_tokenizer
from llama_mini.tokenizers.spm import train_sentencepiece
from fixtures import LLAMA2_TOKENIZER, require



@pytest.fixture(scope="module", params=["trained", "meta"])
def pair(request, tmp_path_factory):
    """(the SentencePiece model, the same vocabulary as llama2.c's tokenizer.bin)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "meta":
        require(LLAMA2_TOKENIZER)
        model = LLAMA2_TOKENIZER
    else:
        lines = [line for story in corpus.stories(4000) for line in story.splitlines()]
        model = train_sentencepiece(lines, 500, folder / "tok.model").model_path
    return spm.SentencePieceProcessor(model_file=str(model)), open_tokenizer(export_sentencepiece(model, folder / "tokenizer.bin"))


TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Ünïcödé façade, 漢字 and 🙂 emoji; \"quotes\" — tabs\there.\nNew line.",
    "x = [1, 2, 3]\nfor i in x:\n    print(i * 1234567)",
    " a leading space and a trailing one ",
    "text that spells control pieces: \n<s>\n <unk> <0x41>",
]


def test_the_file_is_recognised_by_its_content(pair):
    sp, tokenizer = pair
    assert isinstance(tokenizer, Llama2cTokenizer)
    assert (tokenizer.n_words, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (sp.vocab_size(), 1, 2, -1)
    assert tokenizer.stop_ids == [2]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_sentencepiece(pair, text):
    sp, tokenizer = pair
    ids = tokenizer.encode(text, bos=True, eos=True)
    assert ids == [1] + sp.encode(text) + [2]
    assert tokenizer.decode(ids) == sp.decode(ids) == text


def test_decode_drops_only_the_first_pieces_leading_space(pair):
    sp, tokenizer = pair
    ids = sp.encode("so it goes")
    for cut in range(1, len(ids)):
        assert tokenizer.decode(ids[cut:]) == sp.decode(ids[cut:])
    assert tokenizer.decode([1] + ids) == "so it goes"


def test_bytes_that_form_no_character_decode_as_sentencepiece_decodes_them(pair):
    sp, tokenizer = pair
    byte = lambda b: tokenizer.byte_ids[b]  # noqa: E731
    a = tokenizer.encode("a", bos=False)
    for ids in ([byte(0xE2), byte(0x82)] + a, [byte(0xF0), byte(0x9F), byte(0x99)], [byte(0x80), byte(0xFF)] + a):
        assert tokenizer.decode(ids) == sp.decode(ids)
    assert tokenizer.decode([byte(0xE2), byte(0x82)]) == "\ufffd\ufffd"  # one per byte


# --- run.c's merge order, on a vocabulary small enough to follow by hand ---------------------


@pytest.fixture
def tiny(tmp_path):
    words = [" ", "a", "b", "c", "ab", "bc", " ab"]
    scores = [-1e9, -10, -10, -10, -2, -2, -5]
    pieces = ["<unk>", "\n<s>\n", "\n</s>\n"] + BYTE_PIECES + words
    tokenizer = open_tokenizer(write_tokenizer_bin(tmp_path / "tiny.bin", pieces, [0.0] * 259 + scores))
    ids = {piece: i for i, piece in enumerate(pieces)}
    return tokenizer, lambda *names: [ids[n] for n in names]


def test_the_leftmost_of_equal_scores_merges_first(tiny):
    tokenizer, ids = tiny
    # " ", a, b, c: "ab" and "bc" both score -2; the leftmost, "ab", wins, and then " ab"
    # (-5) merges. Had "bc" won, no pair of " ", a, bc would be in the vocabulary.
    assert tokenizer.encode("abc", bos=False) == ids(" ab", "c")


def test_the_highest_score_merges_first(tmp_path):
    pieces = ["<unk>", "\n<s>\n", "\n</s>\n"] + BYTE_PIECES + [" ", "a", "b", "c", "ab", "bc"]
    scores = [0.0] * 259 + [-1e9, -10, -10, -10, -3, -2]
    tokenizer = open_tokenizer(write_tokenizer_bin(tmp_path / "t.bin", pieces, scores))
    assert tokenizer.encode("abc", bos=False) == [259, 260, 264]  # " ", "a", "bc"


def test_characters_outside_the_vocabulary_become_their_utf8_bytes(tiny):
    tokenizer, ids = tiny
    assert tokenizer.encode("aé", bos=True, eos=True) == [1] + ids(" ", "a") + [3 + 0xC3, 3 + 0xA9] + [2]
    assert tokenizer.decode(tokenizer.encode("aé")) == "aé"


# --- Bad files -------------------------------------------------------------------------------


def test_a_truncated_file_is_refused_in_one_line(pair, tmp_path):
    data = Path(pair[1].model_path).read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.bin is truncated"):
        open_tokenizer(tmp_path / "cut.bin")


def test_a_file_without_bos_and_eos_pieces_is_refused(tmp_path):
    path = write_tokenizer_bin(tmp_path / "plain.bin", ["<unk>", "a", "b"], [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="plain.bin has no BOS/EOS pieces"):
        open_tokenizer(path)
