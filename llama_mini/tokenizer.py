"""Tokenizers of the Llama families, opened by what the file holds, not by its name.

    Tokenizer(path)  ->  SentencePieceTokenizer  Llama-2's tokenizer.model, or a BPE trained on our data
                     ->  TiktokenTokenizer       Llama-3's tokenizer.model (tiktoken BPE ranks)
                     ->  HfTokenizerJson         Llama-3's tokenizer.json (Hugging Face), read as those ranks
                     ->  Llama2cTokenizer        llama2.c's tokenizer.bin

Every family has Meta's interface: encode(text, bos, eos), decode(ids), bos_id, eos_id,
pad_id (-1: none), n_words and model_path; and stop_ids (every id that ends a generation)
and encode_dialog(dialog) (Meta's chat prompt for that family).
"""

import io
import os
import re
import struct
from pathlib import Path
from typing import Iterable

import sentencepiece as spm

from . import chat_format
from .files import atomic_write

# A tiktoken ranks file is text, one "base64-token rank" pair per line: "IQ== 0\n".
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=* [0-9]+\r?\n")


class Tokenizer:
    """Tokenizer(path) opens any family; the subclass is chosen by the file's first bytes.

    Each family defines encode(text, bos=True, eos=False) -> ids and decode(ids) -> text.
    """

    model_path: str
    n_words: int
    bos_id: int
    eos_id: int
    pad_id: int

    def __new__(cls, model_path):
        if cls is Tokenizer:
            cls = _family(model_path)
        return super().__new__(cls)

    @property
    def stop_ids(self) -> list[int]:
        """The ids that end a generation: Llama-2 has one, its EOS."""
        return [self.eos_id]

    def encode_dialog(self, dialog: list[dict]) -> list[int]:
        """The prompt ids of Meta's chat_completion for a list of {"role", "content"} turns."""
        return chat_format.llama2_dialog(self, dialog)

    @classmethod
    def train(cls, lines: Iterable[str], vocab_size: int, model_path) -> "SentencePieceTokenizer":
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


class SentencePieceTokenizer(Tokenizer):
    """Meta's Llama-2 tokenizer.model, or one trained by Tokenizer.train."""

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
                f"eos_id {self.eos_id}); Llama needs both: train it with bos_id and eos_id set, as Tokenizer.train does"
            )

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + self.sp.encode(text) + [self.eos_id] * eos

    def decode(self, ids) -> str:
        return self.sp.decode(list(ids))


def _family(model_path) -> type:
    """The tokenizer class for the file at model_path, decided by its first bytes."""
    path = Path(model_path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer not found: {path}; pass --tokenizer PATH/tokenizer.model")
    with open(path, "rb") as f:
        head = f.read(64)
    if _TIKTOKEN_LINE.match(head):
        from .tiktoken_tokenizer import TiktokenTokenizer

        return TiktokenTokenizer
    if head.lstrip().startswith(b"{"):
        from .tokenizer_json import HfTokenizerJson

        return HfTokenizerJson
    if _looks_like_llama2c(head):
        from .llama2c_tokenizer import Llama2cTokenizer

        return Llama2cTokenizer
    return SentencePieceTokenizer


def _looks_like_llama2c(head: bytes) -> bool:
    """llama2.c's tokenizer.bin starts with its longest token's length, then the first
    token's float score and length. A SentencePiece file (protobuf) starts with bytes
    0x0a, n, 0x0a, which read as that length give millions."""
    if len(head) < 12:
        return False
    max_len, score, first_len = struct.unpack_from("<IfI", head)
    return 0 < max_len <= 1 << 16 and first_len <= max_len and score == score
