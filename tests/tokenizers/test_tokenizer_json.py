"""Llama-3's tokenizer read from Hugging Face's tokenizer.json, checked against Meta's tokenizer.model.

The tokenizer.json is made here the way transformers made the Hub's Llama-3 files, by
transformers' TikTokenConverter from Meta's ranks (the fixture). Read back, it must give
exactly Meta's ranks and special tokens, hence Meta's ids; a file made any other way is
refused in one line.
"""

import json

import pytest
from generate_cli_helpers import LLAMA3_TOKENIZER, write_llama3_tokenizer_json

from llama_mini.tokenizers import open_tokenizer
from llama_mini.tokenizers.tokenizer_json import LLAMA3_CHAT_TOKENS, HfTokenizerJson


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(Meta's tokenizer.model, the tokenizer.json transformers makes of it, that JSON parsed)."""
    path = write_llama3_tokenizer_json(tmp_path_factory.mktemp("hf") / "tokenizer.json")
    return LLAMA3_TOKENIZER, path, json.loads(path.read_text())


def edited(files, tmp_path, edit):
    config = json.loads(json.dumps(files[2]))
    edit(config)
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    return tmp_path / "tokenizer.json"


def test_tokenizer_json_gives_metas_ranks_and_special_tokens(files):
    meta, hf = open_tokenizer(files[0]), open_tokenizer(files[1])
    assert isinstance(hf, HfTokenizerJson)
    assert hf.model._mergeable_ranks == meta.model._mergeable_ranks
    assert hf.special_tokens == meta.special_tokens
    assert (hf.n_words, hf.bos_id, hf.eos_id, hf.pad_id, hf.stop_ids) == (128256, 128000, 128001, 128004, [128001, 128008, 128009])


def test_tokenizer_json_encodes_metas_known_answers(files):
    hf = open_tokenizer(files[1])
    assert hf.encode("This is a test sentence.", bos=True, eos=True) == [128000, 2028, 374, 264, 1296, 11914, 13, 128001]
    dialog = [{"role": "system", "content": "This is a test sentence."}, {"role": "user", "content": "This is a response."}]
    assert hf.encode_dialog(dialog) == open_tokenizer(files[0]).encode_dialog(dialog)


def test_a_llama30_tokenizer_json_has_no_eom_stop_id(files, tmp_path):
    def rename_eom(config):
        for token in config["added_tokens"]:
            if token["content"] == "<|eom_id|>":
                token["content"] = "<|reserved_special_token_4|>"

    assert open_tokenizer(edited(files, tmp_path, rename_eom)).stop_ids == [128001, 128009]


def swap_merges_of_different_tokens(config):
    merges = config["model"]["merges"]
    merges[0], merges[-1] = merges[-1], merges[0]


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda c: c["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\w+|\s+"), "Meta's pre-tokenizer"),
        pytest.param(swap_merges_of_different_tokens, "merge rules", marks=pytest.mark.slow),  # each 2-3 s: CI's
        pytest.param(lambda c: c["model"]["merges"].pop(5), "merge rules", marks=pytest.mark.slow),
        pytest.param(lambda c: c.update(added_tokens=[]), "special tokens", marks=pytest.mark.slow),
        (lambda c: c.pop("model"), "layout"),
    ],
    ids=["another pattern", "merges reordered", "a merge missing", "no special tokens", "no model"],
)
def test_a_tokenizer_json_made_another_way_is_refused_in_one_line(files, tmp_path, edit, why):
    with pytest.raises(ValueError, match=f"tokenizer.json is not a Llama-3 tokenizer.json .*{why}.*original/"):
        open_tokenizer(edited(files, tmp_path, edit))


def test_a_llama2_style_tokenizer_json_is_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {}, "merges": []},
                                                         "pre_tokenizer": None, "normalizer": {"type": "Sequence"}}))
    with pytest.raises(ValueError, match="not the layout transformers writes for Llama-3"):
        open_tokenizer(tmp_path / "tokenizer.json")


def test_a_tokenizer_json_that_cannot_spell_every_byte_is_refused_in_one_line(files, tmp_path):
    """Its BPE lacks one byte: tiktoken would panic (an exception past every handler) on text with it."""
    byte_level = files[2]["pre_tokenizer"]
    alphabet = [token for token in files[2]["model"]["vocab"] if len(token) == 1][:256]
    kept = [token for token in alphabet if token != "z"]
    config = {"model": {"type": "BPE", "vocab": {token: i for i, token in enumerate(kept)}, "merges": []},
              "pre_tokenizer": byte_level, "normalizer": None,
              "added_tokens": [{"content": name, "id": len(kept) + i} for i, name in enumerate(LLAMA3_CHAT_TOKENS)]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="tokenizer.json is not a Llama-3 tokenizer.json .*not every single byte is a token"):
        open_tokenizer(tmp_path / "tokenizer.json")


def test_merge_rules_must_be_every_split_of_every_token_once_in_rank_order():
    """ranks_from_bpe, on a vocabulary of the 256 bytes, "ab" and "abc": its splits are a|b and
    ab|c (bc is no token). Those rules, as strings or pairs, give the ranks; any other set is
    refused, including one of as many rules that repeats one and lacks another."""
    from llama_mini.tokenizers.tokenizer_json import _byte_alphabet, ranks_from_bpe

    spell = {b: c for c, b in _byte_alphabet().items()}
    vocab = {spell[b]: b for b in range(256)} | {"ab": 256, "abc": 257}
    assert ranks_from_bpe(vocab, ["a b", "ab c"])[b"abc"] == 257
    assert ranks_from_bpe(vocab, [["a", "b"], ["ab", "c"]])[b"ab"] == 256
    for merges in (["ab c", "a b"], ["a b", "a b"], ["a b"], ["a b", "ab c", "a bc"], ["a b", "ab c", "b c"],
                   ["a b c", "ab c"], ["a b", "abc"], [["a", "b", "c"], ["ab", "c"]], ["a b", None]):
        with pytest.raises(ValueError, match="merge rules"):
            ranks_from_bpe(vocab, merges)
