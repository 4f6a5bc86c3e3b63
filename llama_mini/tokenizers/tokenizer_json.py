"""Hugging Face's tokenizer.json of a Llama-3 model, read back as the tiktoken ranks it was made from.

transformers made the Hub's Llama-3 tokenizer.json from Meta's tokenizer.model: the rank of
a token became its id, its bytes were spelled in GPT-2's byte-to-character alphabet, and
every split of a token into two tokens became a merge rule, ordered by the rank of the
token it makes. Reading that back gives Meta's ranks, so encoding is exactly Meta's. A file
that was not made that way (another pre-tokenizer, merges in another order) is refused,
because BPE by merge rules and BPE by ranks would then tokenize differently.
"""

import json
from pathlib import Path

from .llama3 import PAT_STR, TiktokenTokenizer

MAX_FILE_BYTES = 256 << 20  # the Llama-3 file is 9 MB; a bigger one is not a tokenizer.json we read
# The special tokens Meta's chat format (chat_format.llama3_dialog) and a text's end are made of.
LLAMA3_CHAT_TOKENS = {"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"}


class HfTokenizerJson(TiktokenTokenizer):
    """Llama-3's tokenizer, from Hugging Face's tokenizer.json instead of Meta's tokenizer.model."""

    @staticmethod
    def read(path):
        return read_tokenizer_json(path)


def read_tokenizer_json(path) -> tuple[dict[bytes, int], dict[str, int]]:
    """(mergeable ranks, special tokens) of a Llama-3-style tokenizer.json, or one line saying why not."""
    path = Path(path)

    def refuse(why):
        return ValueError(
            f"{path} is not a Llama-3 tokenizer.json that llama_mini reads exactly ({why}); pass --tokenizer with "
            "Meta's tokenizer.model (Meta's Hugging Face repositories keep it in original/)"
        )

    if path.stat().st_size > MAX_FILE_BYTES:
        raise refuse(f"{path.stat().st_size} bytes")
    try:
        config = json.loads(path.read_bytes())
        model, pre = config["model"], config["pre_tokenizer"]
        steps = pre["pretokenizers"] if pre["type"] == "Sequence" else [pre]
        split, byte_level = steps
    except (ValueError, KeyError, TypeError):
        raise refuse("not the layout transformers writes for Llama-3") from None
    if model.get("type") != "BPE" or config.get("normalizer") is not None or split.get("pattern") != {"Regex": PAT_STR}:
        raise refuse("not byte-level BPE with Meta's pre-tokenizer")
    if byte_level.get("type") != "ByteLevel" or byte_level.get("add_prefix_space"):
        raise refuse("not byte-level BPE with Meta's pre-tokenizer")
    try:
        ranks = ranks_from_bpe(model["vocab"], model["merges"])
        special = {t["content"]: t["id"] for t in config["added_tokens"] if t["id"] >= len(ranks)}
    except (KeyError, TypeError, AttributeError):
        raise refuse("its merge rules are not every split of every token") from None
    except ValueError as e:
        raise refuse(str(e)) from None
    if not LLAMA3_CHAT_TOKENS <= special.keys():
        raise refuse("it lacks Llama-3's special tokens")
    return ranks, special


# Meta's Llama-3 ranks hold tokens of up to 128 bytes; a byte-level BPE token of more than twice
# that is not Llama-3's (each is one character per byte).
LLAMA3_LONGEST_TOKEN = 128
MAX_TOKEN_BYTES = 2 * LLAMA3_LONGEST_TOKEN


def ranks_from_bpe(vocab: dict[str, int], merges: list) -> dict[bytes, int]:
    """The tiktoken ranks that byte-level BPE tokens (GPT-2's alphabet, token -> id) and merge
    rules ("a b" or [a, b]) were made from, or ValueError(why not): the ids must be 0..n-1 and
    merging by the rules must be merging by rank."""
    alphabet = _byte_alphabet()
    if not set("".join(vocab)) <= alphabet.keys():
        raise ValueError("a token outside the byte-level alphabet")
    longest = max(map(len, vocab), default=0)
    if longest > MAX_TOKEN_BYTES:  # each token's splits are checked below: a long one would take long
        raise ValueError(f"a token of {longest} characters, longer than any of Llama-3's ({LLAMA3_LONGEST_TOKEN} bytes)")
    table = str.maketrans(alphabet)
    spelled = {token: token.translate(table).encode("latin-1") for token in vocab}
    ranks = {spelled[token]: i for token, i in vocab.items()}
    try:
        merges = [(spelled[a], spelled[b]) for a, b in (m.split(" ") if isinstance(m, str) else m for m in merges)]
    except (KeyError, TypeError, ValueError):  # a part that is no token, or not two parts
        raise ValueError("its merge rules are not every split of every token") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("its token ids are not 0..n-1 once each")
    if any(bytes([b]) not in ranks for b in range(256)):  # tiktoken spells any text with them
        raise ValueError("not every single byte is a token")
    if not _merges_follow_ranks(ranks, merges):
        raise ValueError("its merge rules are not every split of every token, in the order of the token's rank")
    return ranks


def bpe_from_ranks(ranks: dict[bytes, int]) -> tuple[list[str], list[str]]:
    """The inverse of ranks_from_bpe: each rank's token in GPT-2's alphabet, and the merge rules
    "a b" as transformers' TikTokenConverter makes them (every split of every token into two
    tokens, ordered by the rank of the token made, then of its left and right parts)."""
    spell = {b: c for c, b in _byte_alphabet().items()}
    text = {token: "".join(spell[b] for b in token) for token in ranks}
    splits = [(ranks[t], ranks[t[:i]], ranks[t[i:]], t[:i], t[i:]) for t in ranks for i in range(1, len(t))
              if t[:i] in ranks and t[i:] in ranks]
    merges = [f"{text[left]} {text[right]}" for *_, left, right in sorted(splits)]
    return [text[token] for token in sorted(ranks, key=ranks.get)], merges


def _merges_follow_ranks(ranks: dict[bytes, int], merges: list[tuple[bytes, ...]]) -> bool:
    """Whether merging by these rules is merging by rank, as tiktoken does: the rules are
    exactly the splits of tokens into two tokens, ordered by the rank of the merged token."""
    try:
        made = [ranks[a + b] for a, b in merges]
    except KeyError:  # a rule making no token
        return False
    if made != sorted(made) or len(set(merges)) != len(merges):
        return False
    # Each rule is a split of the token it makes, and none twice: they are every split if they
    # are as many (counted, not collected: a vocabulary has hundreds of thousands).
    return len(merges) == sum(t[:i] in ranks and t[i:] in ranks for t in ranks for i in range(1, len(t)))


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes are their own
    character, the others are spelled from U+0100 upwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
