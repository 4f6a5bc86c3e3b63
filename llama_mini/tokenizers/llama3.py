"""Llama-3's tokenizer: Meta's tokenizer.model is tiktoken BPE ranks, not SentencePiece.

The file holds 128,000 "base64-bytes rank" lines; the 256 special tokens that follow them
(ids 128000-128255), the pre-tokenizing regex, and the cutting of very long inputs are not
in it: they are Meta's code, llama-models/models/llama3/tokenizer.py, restated here.
"""

import base64
import binascii
import os
import re
from pathlib import Path
from typing import Iterator

import tiktoken

from . import chat_format
from .base import Tokenizer

# Meta's pre-tokenizer (pat_str): contractions, words, numbers of at most 3 digits,
# punctuation runs, newlines and other whitespace.
PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The Llama-3.1+ names (llama-models); Llama-3.0 called 128004, 128005, 128008, 128010 and
# 128011 reserved tokens, which its models never produce, so the names fit both.
_NAMED_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>",  # end of message: the model calls a tool and waits for its answer
    "<|eot_id|>",  # end of turn
    "<|python_tag|>", "<|image|>",
]
SPECIAL_TOKENS = _NAMED_SPECIALS + [f"<|reserved_special_token_{i}|>" for i in range(2, 2 + 256 - len(_NAMED_SPECIALS))]

# Meta cuts the text before tiktoken sees it: tiktoken panics on more than 400k characters
# at once, and is very slow on runs of more than 25k whitespace or non-whitespace characters
# (openai/tiktoken#195). Where the cuts fall changes the tokens, so we cut where Meta does.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_RUNS = re.compile(r"\s+|\S+")  # \s is exactly str.isspace, Meta's test


class TiktokenTokenizer(Tokenizer):
    def __init__(self, model_path):
        self.model_path = os.fspath(model_path)
        self.ranks, self.special_tokens = self.read(self.model_path)  # the ranks: bytes -> id
        self.model = tiktoken.Encoding(
            name=Path(model_path).name, pat_str=PAT_STR, mergeable_ranks=self.ranks, special_tokens=self.special_tokens
        )
        self.n_words: int = self.model.n_vocab
        self.bos_id: int = self.special_tokens["<|begin_of_text|>"]
        self.eos_id: int = self.special_tokens["<|end_of_text|>"]
        self.pad_id: int = self.special_tokens.get("<|finetune_right_pad_id|>", -1)

    @staticmethod
    def read(path) -> tuple[dict[bytes, int], dict[str, int]]:
        """Meta's file holds the ranks; Meta's code numbers the special tokens after them."""
        ranks = read_ranks(path)
        return ranks, {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}

    @property
    def stop_ids(self) -> list[int]:
        """A text ends with <|end_of_text|>, a chat turn with <|eot_id|>, a tool call with
        <|eom_id|> (Llama-3.1 on; a Llama-3.0 tokenizer.json does not name it)."""
        names = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
        return [self.special_tokens[name] for name in names if name in self.special_tokens]

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Text that spells a special token ("<|eot_id|>") is encoded as plain text, as Meta's default does."""
        ids = [self.bos_id] * bos
        for piece in meta_pieces(text):
            ids += self.model.encode_ordinary(piece)
        return ids + [self.eos_id] * eos

    def decode(self, ids) -> str:
        return self.model.decode(list(ids))

    def token_bytes(self) -> list[bytes]:
        out = [b""] * self.n_words  # the special tokens stand for no text
        for piece, i in self.ranks.items():
            out[i] = piece
        return out

    def encode_dialog(self, dialog: list[dict]) -> list[int]:
        return chat_format.llama3_dialog(self, dialog)


def meta_pieces(text: str) -> Iterator[str]:
    """text in the pieces Meta's encode hands to tiktoken: chunks of MAX_ENCODE_CHARS, each
    cut again after every MAX_RUN_CHARS characters of one whitespace or non-whitespace run."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        chunk, cut = text[start : start + MAX_ENCODE_CHARS], 0
        for run in _RUNS.finditer(chunk):
            for end in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield chunk[cut:end]
                cut = end
        yield chunk[cut:]


def read_ranks(path) -> dict[bytes, int]:
    """The mergeable ranks of a tiktoken file, checked: ranks 0..n-1 once each, every byte a token."""
    ranks = {}
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            try:
                token, rank = fields
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise ValueError(f"{path} line {line_no} is not 'base64-token rank': not a tiktoken ranks file") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path} is not a tiktoken ranks file: its ranks are not 0..n-1 once each")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ValueError(f"{path} is not a tiktoken ranks file: not every single byte is a token")
    return ranks
