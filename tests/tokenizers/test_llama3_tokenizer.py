"""The Llama-3 tokenizer (tiktoken BPE ranks) against Meta's published answers and transformers.

Meta's known answers are those of meta-llama/llama3, llama/test_tokenizer.py (also
llama-models, models/llama3/tests/api/test_tokenizer.py): test_encode, test_decode,
test_encode_message and test_encode_dialog. Our own texts are checked against an independent
implementation: transformers' TikTokenConverter turns the same ranks into a Hugging Face
`tokenizers` BPE (merge rules, Rust), which is how the Hub's Llama-3 tokenizer.json was made.
"""

import base64

import pytest

from llama_mini.tokenizers.llama3 import MAX_ENCODE_CHARS, MAX_RUN_CHARS, TiktokenTokenizer, meta_pieces
from llama_mini.tokenizers import open_tokenizer
from fixtures import LLAMA3_TOKENIZER, require

BOS, EOS, START_HEADER, END_HEADER, EOM, EOT = 128000, 128001, 128006, 128007, 128008, 128009
SENTENCE = [2028, 374, 264, 1296, 11914, 13]  # "This is a test sentence."
USER, SYSTEM, ASSISTANT, NEWLINES = 882, 9125, 78191, 271  # "user", "system", "assistant", "\n\n"


@pytest.fixture(scope="module")
def tokenizer():
    require(LLAMA3_TOKENIZER)
    return open_tokenizer(LLAMA3_TOKENIZER)


@pytest.fixture(scope="module")
def hf_reference():
    """The same ranks as a Hugging Face BPE tokenizer, built by transformers' converter."""
    require(LLAMA3_TOKENIZER)
    from transformers.convert_slow_tokenizer import TikTokenConverter

    return TikTokenConverter(vocab_file=str(LLAMA3_TOKENIZER)).converted()


# --- Meta's known answers --------------------------------------------------------------------


def test_the_file_is_recognised_by_its_content_and_has_metas_vocabulary(tokenizer):
    assert isinstance(tokenizer, TiktokenTokenizer)
    assert (tokenizer.n_words, tokenizer.bos_id, tokenizer.eos_id) == (128256, BOS, EOS)
    assert tokenizer.special_tokens["<|begin_of_text|>"] == 128000  # Meta's test_special_tokens
    assert tokenizer.pad_id == tokenizer.special_tokens["<|finetune_right_pad_id|>"] == 128004


def test_encode_matches_metas_test_encode(tokenizer):
    assert tokenizer.encode("This is a test sentence.", bos=True, eos=True) == [BOS, *SENTENCE, EOS]


def test_decode_matches_metas_test_decode(tokenizer):
    text = "<|begin_of_text|>This is a test sentence.<|end_of_text|>"
    assert tokenizer.decode([BOS, *SENTENCE, EOS]) == text


def test_a_user_message_matches_metas_test_encode_message(tokenizer):
    # Meta's encode_message is a dialog prompt without BOS and without the open assistant header.
    message = [START_HEADER, USER, END_HEADER, NEWLINES, *SENTENCE, EOT]
    assistant_header = [START_HEADER, ASSISTANT, END_HEADER, NEWLINES]
    assert tokenizer.encode_dialog([{"role": "user", "content": "This is a test sentence."}]) == [BOS, *message, *assistant_header]


def test_dialog_matches_metas_test_encode_dialog(tokenizer):
    dialog = [{"role": "system", "content": "This is a test sentence."}, {"role": "user", "content": "This is a response."}]
    assert tokenizer.encode_dialog(dialog) == [
        BOS,
        START_HEADER, SYSTEM, END_HEADER, NEWLINES, *SENTENCE, EOT,
        START_HEADER, USER, END_HEADER, NEWLINES, 2028, 374, 264, 2077, 13, EOT,  # "This is a response."
        START_HEADER, ASSISTANT, END_HEADER, NEWLINES,
    ]


def test_stop_ids_end_a_text_a_turn_and_a_tool_call(tokenizer):
    assert tokenizer.stop_ids == [EOS, EOM, EOT]
    assert [tokenizer.decode([i]) for i in tokenizer.stop_ids] == ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]


# --- Our own texts, against transformers' conversion -----------------------------------------

TEXTS = {
    "unicode": "Ünïcödé façade, 漢字とかな, Ελληνικά, русский, עברית, 🙂👍🏽 and a ZWJ family 👨‍👩‍👧",
    "digits": "1 12 123 1234 12345 3.14159 1,000,000 ٣٤٥ 2024-06-01",
    "code": 'def f(x):\n\treturn {"a": x ** 2}  # square\n\nif __name__ == "__main__":\n    print(f(3))\n',
    "whitespace": "a  b   c\t\td\n\n\ne \r\n f" + " " * 40 + "\n" * 7 + "end   ",
    "contractions": "I'm sure you'll see they're right, it's what we'd've DONE'S",
    "special-token look-alikes": "<|begin_of_text|> <|eot_id|><|start_header_id|>user<|end_header_id|> <|reserved_special_token_7|>",
}


@pytest.mark.parametrize("name", TEXTS)
def test_encoding_equals_transformers_and_decoding_round_trips(tokenizer, hf_reference, name):
    text = TEXTS[name]
    ids = tokenizer.encode(text, bos=False)
    assert ids == hf_reference.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text


def test_text_that_spells_a_special_token_stays_plain_text(tokenizer):
    ids = tokenizer.encode("<|eot_id|>", bos=False)
    assert ids == [27, 91, 68, 354, 851, 91, 29]  # "<", "|", "e", "ot", "_id", "|", ">"
    assert all(i < 128000 for i in ids)


def test_digits_are_split_into_groups_of_at_most_three(tokenizer):
    assert [tokenizer.decode([i]) for i in tokenizer.encode("1234567", bos=False)] == ["123", "456", "7"]


def test_empty_text_is_no_tokens(tokenizer):
    assert tokenizer.encode("", bos=False) == [] and tokenizer.encode("") == [BOS]


# --- Long inputs are cut where Meta's encode cuts them ---------------------------------------


def test_runs_longer_than_25k_characters_are_cut_every_25k():
    text = "x" * 60_000 + "   " + "y" * 10
    assert [len(p) for p in meta_pieces(text)] == [MAX_RUN_CHARS, MAX_RUN_CHARS, 10_000 + 3 + 10]
    assert "".join(meta_pieces(text)) == text


def test_a_cut_keeps_the_text_before_the_long_run_in_the_same_piece():
    spaces = " " * (MAX_RUN_CHARS + 5)
    assert list(meta_pieces("ab" + spaces + "c")) == ["ab" + spaces[:MAX_RUN_CHARS], spaces[MAX_RUN_CHARS:] + "c"]


def test_runs_are_counted_afresh_in_every_400k_chunk():
    # 390k words of "a " then 30k x's: the x-run crosses the 400k boundary with 10k x's
    # before it and 20k after, so no run inside one chunk exceeds 25k and nothing else is cut.
    text = "a " * 195_000 + "x" * 30_000
    assert [len(p) for p in meta_pieces(text)] == [MAX_ENCODE_CHARS, 20_000]


def test_long_inputs_encode_as_their_pieces(tokenizer):
    text = "word " * 1000 + "z" * 30_000 + " tail"
    pieces = list(meta_pieces(text))
    assert len(pieces) == 2
    assert tokenizer.encode(text, bos=False) == [i for p in pieces for i in tokenizer.model.encode_ordinary(p)]
    assert tokenizer.decode(tokenizer.encode(text, bos=False)) == text


# --- Bad files -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, message",
    [
        (b"IQ== 0\nIg== x\n", "line 2 is not 'base64-token rank'"),
        (b"IQ== 0\nIg== 5\n", "ranks are not 0..n-1"),
        (b"".join(b"%s %d\n" % (base64.b64encode(bytes([b])), b) for b in range(255)), "not every single byte is a token"),
    ],
    ids=["rank not a number", "gap in ranks", "a byte missing"],
)
def test_a_damaged_ranks_file_is_refused_in_one_line(tmp_path, content, message):
    (tmp_path / "tokenizer.model").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        open_tokenizer(tmp_path / "tokenizer.model")
