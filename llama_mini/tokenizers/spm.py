"""SentencePiece tokenizers: Meta's Llama-2 tokenizer.model, and the BPE trained on the user's text."""

import io
import os
from pathlib import Path
from typing import Iterable

import sentencepiece as spm

from ..support.files import atomic_write
from .base import Tokenizer


class SentencePieceTokenizer(Tokenizer):
    """Meta's Llama-2 tokenizer.model, or one written by train_sentencepiece."""

    def __init__(self, model_path):
        self.model_path = os.fspath(model_path)
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(self.model_path)
        except (OSError, RuntimeError) as e:
            raise ValueError(
                f"{model_path} is not a tokenizer llama_mini reads: not a SentencePiece model ({e}), nor "
                "Llama-3's tiktoken ranks or tokenizer.json, nor llama2.c's tokenizer.bin"
            ) from None
        self.n_words: int = self.sp.vocab_size()
        self.bos_id: int = self.sp.bos_id()
        self.eos_id: int = self.sp.eos_id()
        self.pad_id: int = self.sp.pad_id()  # -1 in Meta's tokenizer: there is no pad token
        if self.bos_id < 0 or self.eos_id < 0:
            raise ValueError(
                f"{model_path} is a SentencePiece model without BOS/EOS tokens (bos_id {self.bos_id}, "
                f"eos_id {self.eos_id}); Llama needs both: train it with bos_id and eos_id set, as train_sentencepiece does"
            )
        self.dummy_prefix = "".join(self.sp.encode("a", out_type=str)).startswith("\u2581")  # the model's normalizer's choice

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + self.sp.encode(text) + [self.eos_id] * eos

    def decode(self, ids) -> str:
        return self.sp.decode(list(ids))

    def token_bytes(self) -> list[bytes]:
        sp, out = self.sp, []
        for i in range(self.n_words):
            piece = sp.id_to_piece(i)
            if sp.is_byte(i):
                out.append(bytes([int(piece[3:5], 16)]))  # "<0x0A>"
            elif sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
                out.append(b"")
            else:
                out.append(piece.replace("\u2581", " ").encode("utf-8"))
        return out


def train_sentencepiece(lines: Iterable[str], vocab_size: int, model_path) -> SentencePieceTokenizer:
    """Train a BPE tokenizer with byte fallback, Llama-style (no normalisation, digits
    split, unk/bos/eos = 0/1/2), write it to model_path and load it.

    Byte fallback means any UTF-8 text round-trips, even characters never seen in training.
    """
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        split_digits=True,
        character_coverage=1.0,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        max_sentence_length=1 << 16,
        input_sentence_size=200_000,
        shuffle_input_sentence=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )
    atomic_write(model_path, lambda tmp: Path(tmp).write_bytes(model.getvalue()))
    return SentencePieceTokenizer(model_path)
