"""Long texts encoded a piece at a time, with the ids the whole text would get.

A text of gigabytes cannot go to one encode call. Every Llama tokenizer starts a word at a
space that follows a non-space: SentencePiece splits at "▁", and Llama-3's pre-tokenizer
keeps the space with the word after it. Cut there, the pieces encode to the ids of the whole
text; a SentencePiece family's dummy prefix stands in for the space it drops.
"""

import os
from typing import Iterable, Iterator

from .base import Tokenizer

PIECE_CHARS = 1 << 20  # encode about 1 MB at a time
MAX_CARRY_CHARS = 16 * PIECE_CHARS  # text without a word break this long is cut anyway (no Llama vocabulary spans it)


def text_pieces(tokenizer: Tokenizer, blocks: Iterable[str]) -> Iterator[str]:
    """The text of blocks in pieces of about PIECE_CHARS that encode, each on its own, to the
    ids of the whole text (without a BOS)."""
    carry, first = "", True
    for block in blocks:
        carry += block
        while len(carry) > PIECE_CHARS:
            cut = word_break(carry, PIECE_CHARS)
            if cut is None:
                if len(carry) <= MAX_CARRY_CHARS:
                    break
                cut = len(carry) - 1
            yield piece_text(tokenizer, carry[:cut], first)
            carry, first = carry[cut:], False
    if carry:
        yield piece_text(tokenizer, carry, first)


def word_break(text: str, start: int):
    """The index of a space between two non-spaces at or after start, else None."""
    i = text.find(" ", start)
    while 0 < i < len(text) - 1:
        if not text[i - 1].isspace() and not text[i + 1].isspace():
            return i
        i = text.find(" ", i + 1)
    return None


def piece_text(tokenizer: Tokenizer, piece: str, first: bool) -> str:
    return piece[1:] if tokenizer.dummy_prefix and not first and piece.startswith(" ") else piece


def encode_long(tokenizer: Tokenizer, blocks: Iterable[str]) -> Iterator[list[int]]:
    """The ids of the text of blocks, a piece at a time (no BOS); SentencePiece's own models
    encode a batch of pieces on every core at once."""
    pieces = text_pieces(tokenizer, blocks)
    if hasattr(tokenizer, "sp"):
        batch = []
        for piece in pieces:
            batch.append(piece)
            if len(batch) == (os.cpu_count() or 1):
                yield from tokenizer.sp.encode(batch, num_threads=len(batch))
                batch = []
        if batch:
            yield from tokenizer.sp.encode(batch, num_threads=len(batch))
    else:
        for piece in pieces:
            yield tokenizer.encode(piece, bos=False)
