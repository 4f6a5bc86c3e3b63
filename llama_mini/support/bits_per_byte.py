"""Bits per byte: a loss that runs with different tokenizers (and other projects) can be set beside.

A loss in nats per token depends on how much text a token holds. Divided by ln 2 and by the
UTF-8 bytes of the text the scored tokens stand for, it is the bits the model needs per
byte of text, whatever the tokenizer. Where each character is one byte (plain ASCII) it is
bits per character: nanoGPT's nats per character divided by ln 2.
"""

import math

import torch


class TextBytes:
    """Counts the bytes of text that target tokens stand for, from the tokenizer's table
    (Tokenizer.token_bytes). A token right after BOS starts a text, so with SentencePiece's
    dummy prefix its leading space is not in the text."""

    def __init__(self, tokenizer):
        table = tokenizer.token_bytes()
        self.bytes = torch.tensor([len(piece) for piece in table])
        prefix = torch.tensor([tokenizer.dummy_prefix and piece.startswith(b" ") for piece in table])
        self.bytes_first = self.bytes - prefix.long()
        self.bos_id = tokenizer.bos_id

    def count(self, x: torch.Tensor, y: torch.Tensor) -> int:
        """The bytes the targets y stand for, where x holds the token before each of them."""
        x, y = x.cpu(), y.cpu()
        return int(torch.where(x == self.bos_id, self.bytes_first[y], self.bytes[y]).sum())


def bits_per_byte(nats: float, n_bytes: int) -> float:
    """The total nats of some tokens, in bits per byte of the text they stand for."""
    return nats / math.log(2) / n_bytes if n_bytes else math.nan
