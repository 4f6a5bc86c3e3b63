"""The data pipeline: the built-in corpus, validation of --data, the token cache, windows."""

import array
import hashlib
import re

import pytest
import torch

from llama_mini.tokenizers import long_text
from llama_mini.run import corpus, data
from llama_mini.tokenizers.spm import train_sentencepiece


@pytest.fixture(scope="module")
def stories():
    return corpus.stories()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    lines = [line for story in corpus.stories(40_000) for line in story.splitlines()]
    return train_sentencepiece(lines, 400, tmp_path_factory.mktemp("tok") / "tok.model")


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


# --- The built-in corpus ------------------------------------------------------------------------


def test_builtin_corpus_is_at_least_2_mb_with_1000_distinct_words(stories):
    text = "\n\n".join(stories)
    assert len(text.encode()) >= 2_000_000
    assert len({w.lower() for w in re.findall(r"[A-Za-z]+", text)}) >= 1000


def test_builtin_corpus_is_the_same_text_every_time(stories):
    again = corpus.stories()
    assert hashlib.sha256("".join(again).encode()).digest() == hashlib.sha256("".join(stories).encode()).digest()
    assert corpus.stories(50_000, seed=1) != corpus.stories(50_000, seed=0)


def test_every_story_keeps_its_heros_name_and_has_dialogue(stories):
    for story in stories[:300]:
        hero = re.search(r"(?:named|called) (\w+)|^(\w+) was", story)
        assert hero, story[:80]
        name = hero.group(1) or hero.group(2)
        assert story.count(name) >= 3, (name, story)  # the model must learn to reuse it
        assert re.search(r'"[^"]+[,?!]" \w+ ', story), story  # "Line," said Name.


def test_builtin_stories_vary_in_plot_and_show_cause_and_effect(stories):
    sample = stories[:500]
    assert len({s.split("\n")[1][:40] for s in sample}) > 300  # second paragraphs: many different plots
    assert sum(("because" in s.lower() or " so " in s) for s in sample) > 0.6 * len(sample)


# --- Validating --data --------------------------------------------------------------------------


def test_missing_data_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data not found: .*nope\.txt; pass --data"):
        data.open_corpus(tmp_path / "nope.txt")


@pytest.mark.parametrize("content", ["", "  \n\n\t "])
def test_empty_data_is_refused(tmp_path, content):
    with pytest.raises(ValueError, match="holds no text"):
        data.open_corpus(write(tmp_path / "empty.txt", content))


@pytest.mark.parametrize("text", ["café au lait", "café"])  # é mid-file, and é as the last byte
def test_non_utf8_data_names_the_file_byte_and_offset(tmp_path, text):
    path = tmp_path / "latin1.txt"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8 text \(invalid byte 0xe9 at offset 3\)"):
        data.open_corpus(path)


def test_utf8_check_reads_in_blocks_without_splitting_characters(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "READ_BYTES", 3)  # every multi-byte character straddles a block
    path = tmp_path / "a.txt"
    path.write_bytes("héllo wörld ✓ 漢字".encode())
    assert data.open_corpus(path).digest == hashlib.sha256(b"a.txt\0" + path.read_bytes()).hexdigest()
    path.write_bytes("héllo ✓".encode() + b"\xff!")
    with pytest.raises(ValueError, match=r"invalid byte 0xff at offset 10\)"):
        data.open_corpus(path)


def test_folder_without_txt_files_is_refused(tmp_path):
    write(tmp_path / "notes.md", "text")
    with pytest.raises(ValueError, match="no .txt files in"):
        data.open_corpus(tmp_path)


def test_folder_reads_every_txt_file_in_sorted_order(tmp_path):
    write(tmp_path / "b.txt", "second")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "c.txt", "third")
    write(tmp_path / "a.txt", "first")
    write(tmp_path / "skip.md", "not text data")
    c = data.open_corpus(tmp_path)
    assert list(c.documents()) == ["first", "second", "third"]


def test_corpus_digest_changes_with_the_text(tmp_path):
    path = write(tmp_path / "a.txt", "one story")
    before = data.open_corpus(path).digest
    assert data.open_corpus(path).digest == before
    write(path, "another story")
    assert data.open_corpus(path).digest != before


# --- Tokenising once ----------------------------------------------------------------------------


def read_tokens(path):
    return data.TokenSplits(path, 0.5).splits["train"].tolist() + data.TokenSplits(path, 0.5).splits["val"].tolist()


def test_token_file_holds_bos_text_eos_for_each_document(tmp_path, tokenizer):
    write(tmp_path / "a.txt", "Lily had a red ball.")
    write(tmp_path / "b.txt", '"Hello," said Tom.\nThe end.')
    path = data.tokenize(data.open_corpus(tmp_path), tokenizer, tmp_path / "cache")
    assert path.name.endswith(".uint16.bin")
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    expected = [bos] + tokenizer.encode("Lily had a red ball.", bos=False) + [eos]
    expected += [bos] + tokenizer.encode('"Hello," said Tom.\nThe end.', bos=False) + [eos]
    assert read_tokens(path) == expected


def test_token_cache_is_reused_and_rebuilt_when_data_or_tokenizer_change(tmp_path, tokenizer):
    text = write(tmp_path / "a.txt", "Tom and Lily went to the park.")
    cache = tmp_path / "cache"
    first = data.tokenize(data.open_corpus(text), tokenizer, cache)
    stamp = first.stat().st_mtime_ns
    assert data.tokenize(data.open_corpus(text), tokenizer, cache) == first
    assert first.stat().st_mtime_ns == stamp  # found, not rewritten
    write(text, "Tom and Lily went to the beach.")
    assert data.tokenize(data.open_corpus(text), tokenizer, cache) != first
    lines = [line for s in corpus.stories(30_000, seed=3) for line in s.splitlines()]
    other = train_sentencepiece(lines, 350, tmp_path / "o.model")
    assert data.tokenize(data.open_corpus(text), other, cache) != first


def test_vocabularies_over_65536_are_stored_as_uint32(tmp_path, tokenizer):
    class Big:  # the real tokenizer, claiming a vocabulary too big for uint16
        n_words, bos_id, eos_id, sp, model_path, dummy_prefix = 70_000, 65_600, 65_601, tokenizer.sp, tokenizer.model_path, True

    path = data.tokenize(data.open_corpus(write(tmp_path / "a.txt", "The sun was warm.")), Big(), tmp_path / "cache")
    assert path.name.endswith(".uint32.bin")
    assert read_tokens(path) == [65_600] + tokenizer.encode("The sun was warm.", bos=False) + [65_601]


def test_tokenizers_of_other_families_encode_through_their_own_encode(tmp_path, monkeypatch):
    """Llama-3's tiktoken and llama2.c's tokenizers have no SentencePiece inside: their
    encode() takes each piece of a long text in turn."""

    class ByteTokenizer:  # one id per UTF-8 byte, after unk, bos and eos
        n_words, bos_id, eos_id, dummy_prefix = 259, 1, 2, False
        model_path = write(tmp_path / "bytes.model", "a tokenizer file, for the cache key")

        def encode(self, text, bos=True, eos=False):
            return [self.bos_id] * bos + [b + 3 for b in text.encode()] + [self.eos_id] * eos

    monkeypatch.setattr(long_text, "PIECE_CHARS", 8)  # many pieces
    text = "Once upon a time,\nthere was a café.\nThe end."
    path = data.tokenize(data.open_corpus(write(tmp_path / "a.txt", text)), ByteTokenizer(), tmp_path / "cache")
    assert read_tokens(path) == [1] + [b + 3 for b in text.encode()] + [2]


def test_tokenizer_is_trained_once_per_data_and_vocab_size(tmp_path):
    c = data.open_corpus(write(tmp_path / "a.txt", "\n".join(corpus.stories(30_000))))
    tok = data.load_tokenizer(c, 400, tmp_path / "cache")
    assert tok.n_words == 400
    stamp = tok.model_path, (tmp_path / "cache" / tok.model_path).stat().st_mtime_ns
    again = data.load_tokenizer(c, 400, tmp_path / "cache")
    assert (again.model_path, (tmp_path / "cache" / again.model_path).stat().st_mtime_ns) == stamp
    assert data.load_tokenizer(c, 380, tmp_path / "cache").n_words == 380


# --- Splits and windows -------------------------------------------------------------------------


@pytest.fixture
def counting(tmp_path):
    """A token file holding 0, 1, ..., 999: every window's content names its offset."""
    path = tmp_path / "count.uint16.bin"
    array.array("H", range(1000)).tofile(open(path, "wb"))
    return data.TokenSplits(path, 0.1)


def test_split_holds_the_last_fraction_for_validation(counting):
    assert counting.splits["train"].tolist() == list(range(900))
    assert counting.splits["val"].tolist() == list(range(900, 1000))


def test_windows_pair_inputs_with_next_token_targets(counting):
    x, y = counting.windows("train", torch.tensor([0, 17, 884]), 15)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, 15)
    assert x[1].tolist() == list(range(17, 32))
    assert torch.equal(y, x + 1)
    assert y[2, -1].item() == 899  # the last window ends at the split's last token


def test_random_windows_stay_inside_the_split_and_follow_the_generator(counting):
    starts = counting.random_starts("val", 500, 16, torch.Generator().manual_seed(0))
    assert starts.min() >= 0 and starts.max() <= 100 - 16 - 1
    x, y = counting.windows("val", starts, 16)
    assert x.min() >= 900 and y.max() <= 999
    assert torch.equal(starts, counting.random_starts("val", 500, 16, torch.Generator().manual_seed(0)))


def test_evaluation_windows_are_fixed_and_spread_over_the_split(counting):
    starts = counting.even_starts("val", 5, 20)
    assert starts.tolist() == [0, 19, 39, 59, 79]


def test_seq_len_longer_than_a_split_names_the_limit(counting):
    counting.check_seq_len(99, "count")
    expected = r"--seq-len 100 is longer than the data: the val split of count has 100 tokens.*at most 99"
    with pytest.raises(ValueError, match=expected):
        counting.check_seq_len(100, "count")
