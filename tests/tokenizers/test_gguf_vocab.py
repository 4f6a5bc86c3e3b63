"""The vocabulary inside a GGUF file: llama.cpp's own test vectors, Meta's tokenizers, and export.

llama.cpp's vocabulary-only files (Llama-2's SentencePiece vocabulary, Llama-3's BPE) come with
test texts and the ids llama.cpp gives them (shared/fixtures/gguf-vocab/). Read here, each
vocabulary must give those ids for every text and decode them back to it, and must be Meta's
tokenizer: the same ranks, special tokens, stop ids and chat prompt. Exported from Meta's files,
a vocabulary must read back (here and with gguf's reader) with the same ids.
"""

import gc
import shutil
import tracemalloc

import gguf
import numpy as np
import pytest
import sentencepiece as spm
from gguf import GGUFValueType as V
from gguf import Keys

from fixtures import GGUF_VOCAB, LLAMA2_TOKENIZER, LLAMA3_TOKENIZER, require
from llama_mini.formats.gguf import write_vocabulary
from llama_mini.support.gguf_file import GGUFFile
from llama_mini.tokenizers import copy_tokenizer, open_tokenizer
from llama_mini.tokenizers.gguf_vocab import GgufLlama3, GgufSentencePiece

SPM, BPE = "ggml-vocab-llama-spm.gguf", "ggml-vocab-llama-bpe.gguf"
SEPARATOR = "\n__ggml_vocab_test__\n"
DIALOG = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Who are you?"}]


def vectors(name):
    """llama.cpp's test texts and the ids it gives them (test-tokenizer-0's file layout: texts
    each followed by the separator; one line of space-separated ids per text)."""
    texts = (require(GGUF_VOCAB / name).parent / f"{name}.inp").read_text(encoding="utf-8").split(SEPARATOR)
    lines = (GGUF_VOCAB / f"{name}.out").read_text(encoding="utf-8").split("\n")
    assert texts[-1] == "" and lines[-1] == "" and len(texts) == len(lines)
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts[:-1], lines[:-1])]


@pytest.fixture(scope="module", params=[SPM, BPE])
def vocab(request):
    return request.param, open_tokenizer(require(GGUF_VOCAB / request.param))


def test_every_test_text_encodes_to_llama_cpps_ids_and_decodes_back(vocab):
    name, tokenizer = vocab
    cases = vectors(name)
    assert len(cases) == 46
    for text, ids in cases:
        assert tokenizer.encode(text, bos=False) == ids, text
        assert tokenizer.decode(ids) == text, text


def test_the_family_and_its_ids_are_the_files(vocab):
    name, tokenizer = vocab
    if name == SPM:
        assert isinstance(tokenizer, GgufSentencePiece)
        assert (tokenizer.n_words, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, tokenizer.stop_ids) == (32000, 1, 2, -1, [2])
    else:
        assert isinstance(tokenizer, GgufLlama3)
        # Llama-3.0's names: no <|eom_id|> (128008 was a reserved token), no pad token
        assert (tokenizer.n_words, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (128256, 128000, 128001, -1)
        assert tokenizer.stop_ids == [128001, 128009]


def test_the_llama2_vocabulary_is_metas_sentencepiece_model():
    tokenizer = open_tokenizer(require(GGUF_VOCAB / SPM))
    sp = spm.SentencePieceProcessor(model_file=str(require(LLAMA2_TOKENIZER)))
    texts = ["Once upon a time, there was a little girl named Lily.", "  two spaces, a\ttab\nand 漢字 🙂",
             "text that spells control pieces: <s> </s> <unk> <0x41>"]
    for text in texts:
        assert tokenizer.encode(text, bos=True, eos=True) == [1] + sp.encode(text) + [2]
    meta = open_tokenizer(LLAMA2_TOKENIZER)
    assert tokenizer.encode_dialog(DIALOG) == meta.encode_dialog(DIALOG)
    assert tokenizer.decode([0, 15043]) == sp.decode([0, 15043])  # <unk> as SentencePiece writes it


def test_the_llama3_vocabulary_is_metas_tiktoken_ranks():
    tokenizer, meta = open_tokenizer(require(GGUF_VOCAB / BPE)), open_tokenizer(require(LLAMA3_TOKENIZER))
    assert tokenizer.ranks == meta.ranks
    named = {name for name in tokenizer.special_tokens if "reserved" not in name}  # 3.0 reserved what 3.1 named
    assert {"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"} <= named
    assert {name: tokenizer.special_tokens[name] for name in named} == {name: meta.special_tokens[name] for name in named}
    assert tokenizer.encode_dialog(DIALOG) == meta.encode_dialog(DIALOG)



def test_a_llama3_gguf_vocabulary_once_read_holds_what_metas_file_does():
    """The file's token and merge lists (400,000 strings, 36 MB of Python objects) are let go
    once they are ranks: the tokenizer then holds as much as Meta's own file's."""
    def held(path):
        gc.collect()
        tracemalloc.start()
        try:
            tokenizer = open_tokenizer(path)
            gc.collect()
            return tokenizer, tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()

    (tokenizer, from_gguf), (_, from_meta) = held(require(GGUF_VOCAB / BPE)), held(require(LLAMA3_TOKENIZER))
    assert tokenizer.stop_ids == [128001, 128009]  # the file's ids, kept
    assert from_gguf < 1.05 * from_meta, (from_gguf, from_meta)

# --- Export: Meta's files written as GGUF vocabularies, read back -------------------------------


def exported(tmp_path, tokenizer_path, vocab_size):
    """A vocabulary-only GGUF file holding what export_gguf writes for tokenizer_path."""
    writer = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")
    write_vocabulary(writer, tokenizer_path, vocab_size)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return tmp_path / "vocab.gguf"


@pytest.fixture(scope="module", params=[pytest.param(BPE, marks=pytest.mark.slow), SPM])  # BPE: a 128,256-token export
def export(request, tmp_path_factory):
    """(llama.cpp's file, Meta's tokenizer exported as a GGUF vocabulary, gguf's reader of it)."""
    meta, vocab_size = (LLAMA3_TOKENIZER, 128256) if request.param == BPE else (LLAMA2_TOKENIZER, 32000)
    path = exported(tmp_path_factory.mktemp("export"), require(meta), vocab_size)
    return request.param, path, gguf.GGUFReader(path)


def test_an_exported_vocabulary_reads_back_with_llama_cpps_ids(export):
    name, path, reader = export
    tokenizer = open_tokenizer(path)
    for text, ids in vectors(name):
        assert tokenizer.encode(text, bos=False) == ids, text
        assert tokenizer.decode(ids) == text, text
    # gguf's own reader finds each token at llama.cpp's id (Llama-3's special tokens aside: 3.1's
    # names where 3.0 said reserved)
    ours, theirs = reader.fields[Keys.Tokenizer.LIST].contents(), GGUFFile(GGUF_VOCAB / name).fields[Keys.Tokenizer.LIST]
    assert len(ours) == len(theirs)
    assert ours[: 128000 if name == BPE else None] == theirs[: 128000 if name == BPE else None]


def test_an_exported_vocabulary_holds_what_llama_cpps_converter_writes(export):
    """Meta's tokenizer exported as GGUF: the same model, types, scores or merges and special ids
    as the file llama.cpp's converter made from Meta's Hugging Face repository."""
    name, _, ours = export
    theirs = GGUFFile(GGUF_VOCAB / name).fields
    keys = [Keys.Tokenizer.MODEL, Keys.Tokenizer.TOKEN_TYPE, Keys.Tokenizer.BOS_ID, Keys.Tokenizer.EOS_ID]
    keys += [Keys.Tokenizer.PRE, Keys.Tokenizer.MERGES] if name == BPE else [Keys.Tokenizer.SCORES, Keys.Tokenizer.UNK_ID]
    for key in keys:
        value = theirs[key].tolist() if isinstance(theirs[key], np.ndarray) else theirs[key]
        assert ours.fields[key].contents() == value, key
    if name == BPE:
        assert ours.fields[Keys.Tokenizer.EOT_ID].contents() == 128009


def test_a_gguf_vocabulary_is_copied_whole_by_export_and_alone_by_copy_tokenizer(tmp_path):
    source = require(GGUF_VOCAB / SPM)
    with_weights = tmp_path / "model.gguf"
    shutil.copyfile(source, with_weights)
    with open(with_weights, "ab") as f:  # not a valid model, but copy_tokenizer reads only the vocabulary
        f.write(b"\0" * 4096)
    copy_tokenizer(with_weights, tmp_path / "tokenizer.model")
    exported_copy = exported(tmp_path, source, 32000)
    fields = gguf.GGUFReader(source).fields
    for copy in (tmp_path / "tokenizer.model", exported_copy):
        theirs = gguf.GGUFReader(copy).fields
        for key in (k for k in fields if k.startswith("tokenizer.")):
            assert theirs[key].types == fields[key].types and theirs[key].contents() == fields[key].contents(), key
    assert (tmp_path / "tokenizer.model").stat().st_size < source.stat().st_size


def test_a_non_gguf_tokenizer_is_copied_as_it_is(tmp_path):
    copy_tokenizer(require(LLAMA3_TOKENIZER), tmp_path / "tokenizer.model")
    assert (tmp_path / "tokenizer.model").read_bytes() == LLAMA3_TOKENIZER.read_bytes()


# --- Vocabularies refused in one line ----------------------------------------------------------


def changed_vocabulary(path, source, change):
    """The fixture source's vocabulary, changed, written to path: change(fields) edits a dict of
    its tokenizer fields, key -> (value, type, array item type)."""
    file = GGUFFile(require(GGUF_VOCAB / source))
    fields = {}
    for key, value in file.fields.items():
        if key.startswith("tokenizer."):
            fields[key] = (value if not isinstance(value, np.ndarray) else value.tolist(), *file.value_types[key])
    change(fields)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, kind, item) in fields.items():
        writer.add_key_value(key, value, kind, item)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def vocabulary_file(tmp_path, source, change) -> str:
    """The one-line refusal of the fixture source's vocabulary, changed (changed_vocabulary)."""
    changed_vocabulary(tmp_path / "vocab.gguf", source, change)
    with pytest.raises(ValueError) as e:
        open_tokenizer(tmp_path / "vocab.gguf")
    message = str(e.value)
    assert "\n" not in message and str(tmp_path / "vocab.gguf") in message, message
    return message


def set_field(key, value, kind=V.STRING, item=None):
    return lambda fields: fields.__setitem__(key, (value, kind, item))


def drop(*keys):
    return lambda fields: [fields.pop(key, None) for key in keys]


@pytest.mark.parametrize("source, change, fragment", [
    (SPM, set_field(Keys.Tokenizer.MODEL, "bert"), "holds a 'bert' vocabulary; llama_mini reads GGUF vocabularies of type 'llama'"),
    (BPE, set_field(Keys.Tokenizer.PRE, "qwen2"), "holds a 'gpt2' vocabulary with pre-tokenizer 'qwen2'"),
    (BPE, drop(Keys.Tokenizer.PRE), "holds a 'gpt2' vocabulary with pre-tokenizer None"),
    (SPM, drop(Keys.Tokenizer.MODEL, Keys.Tokenizer.LIST), "holds no vocabulary"),
    (SPM, drop(Keys.Tokenizer.SCORES), "a 'llama' vocabulary needs tokenizer.ggml.scores"),
    (SPM, set_field(Keys.Tokenizer.SCORES, [0.0] * 10, V.ARRAY, V.FLOAT32), "tokenizer.ggml.scores is not one number per token"),
    (SPM, set_field(Keys.Tokenizer.LIST, 7, V.UINT32), "tokenizer.ggml.tokens is not a list of strings"),
    (SPM, set_field(Keys.Tokenizer.EOS_ID, 32000, V.UINT32), "tokenizer.ggml.eos_token_id is 32000, not a token id"),
    (SPM, drop(Keys.Tokenizer.BOS_ID), "it names no BOS or EOS token"),
    (BPE, lambda f: f.__setitem__(Keys.Tokenizer.MERGES, (f[Keys.Tokenizer.MERGES][0][::-1], V.ARRAY, V.STRING)),
     "not Llama-3's byte-level BPE: its merge rules are not every split of every token, in the order"),
    (BPE, lambda f: f[Keys.Tokenizer.LIST][0].__setitem__(128002, "<|begin_of_text|>"), "a token appears twice"),
    (SPM, lambda f: f[Keys.Tokenizer.SCORES][0].__setitem__(5, float("nan")), "tokenizer.ggml.scores holds NaN or inf"),
    (SPM, lambda f: f[Keys.Tokenizer.LIST][0].__setitem__(3, "<0xZZ>"), "byte token 3 is '<0xZZ>', not <0xXX> with two hex digits"),
    (SPM, lambda f: f[Keys.Tokenizer.LIST][0].__setitem__(3, "<0x-1>"), "byte token 3 is '<0x-1>', not <0xXX> with two hex digits"),
    (SPM, set_field(Keys.Tokenizer.MERGES, ["zzzq qqqz"], V.ARRAY, V.STRING), "tokenizer.ggml.merges names tokens that are not in"),
    (SPM, set_field(Keys.Tokenizer.EOS_ID, -1, V.INT32), "tokenizer.ggml.eos_token_id is -1, not a token id"),
    (BPE, lambda f: f[Keys.Tokenizer.LIST][0].__setitem__(1000, "a" * 400_000),  # checking its splits took 30 s
     "not Llama-3's byte-level BPE: a token of 400000 characters, longer than any of Llama-3's (128 bytes)"),
])
def test_a_vocabulary_llama_mini_cannot_encode_exactly_is_refused_in_one_line(tmp_path, source, change, fragment):
    assert fragment in vocabulary_file(tmp_path, source, change)


# The tokenizer.ggml.pre labels llama.cpp 0.3.36's src/llama-vocab.cpp reads with Llama-3's regex
# (LLAMA_VOCAB_PRE_TYPE_LLAMA3, and SMAUG and DBRX, whose regex is "same as llama3").
LLAMA_CPP_LLAMA3_REGEX_LABELS = ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                                 "jina-v5-nano", "smaug-bpe", "dbrx"]


# The quick suite reads the label Meta's converter writes; CI reads them all.
@pytest.mark.parametrize("label", ["llama-bpe", *(pytest.param(label, marks=pytest.mark.slow)
                                                 for label in LLAMA_CPP_LLAMA3_REGEX_LABELS if label != "llama-bpe")])
def test_every_label_llama_cpp_reads_with_llama3s_regex_reads_as_llama3(tmp_path, label):
    """llama.cpp's converter labels a tokenizer.json that transformers made from Meta's ranks
    "smaug-bpe"; llama.cpp reads it, and the others here, with Llama-3's pre-tokenizer."""
    path = changed_vocabulary(tmp_path / "vocab.gguf", BPE, set_field(Keys.Tokenizer.PRE, label))
    tokenizer = open_tokenizer(path)
    assert isinstance(tokenizer, GgufLlama3)
    for text, ids in vectors(BPE):
        assert tokenizer.encode(text, bos=False) == ids, text


def test_a_vocabulary_of_more_strings_than_any_tokenizers_is_refused_before_they_are_read(tmp_path):
    """Three million one-letter tokens (27 MB) would take about 14 times their bytes as Python
    strings; the count is refused from the array's header."""
    from llama_mini.support.gguf_file import MAX_STRINGS

    count = MAX_STRINGS + 1
    key = Keys.Tokenizer.LIST.encode()
    header = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
    entry = len(key).to_bytes(8, "little") + key + int(V.ARRAY).to_bytes(4, "little") + int(V.STRING).to_bytes(4, "little")
    (tmp_path / "v.gguf").write_bytes(header + entry + count.to_bytes(8, "little")
                                      + b"\x01\x00\x00\x00\x00\x00\x00\x00a" * count)
    with pytest.raises(ValueError) as e:
        open_tokenizer(tmp_path / "v.gguf")
    assert str(e.value) == (f"{tmp_path / 'v.gguf'} is truncated or corrupt ('tokenizer.ggml.tokens' holds {count} strings, "
                            f"more than any tokenizer's vocabulary or merges ({MAX_STRINGS})); download or convert it again")
