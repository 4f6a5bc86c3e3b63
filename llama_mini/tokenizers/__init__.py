"""Tokenizers of the Llama families, opened by what the file holds, not by its name.

    open_tokenizer(path)  ->  SentencePieceTokenizer  Llama-2's tokenizer.model, or a BPE trained on our data (spm.py)
                          ->  TiktokenTokenizer       Llama-3's tokenizer.model, tiktoken BPE ranks (llama3.py)
                          ->  HfTokenizerJson         Llama-3's tokenizer.json, read as those ranks (tokenizer_json.py)
                          ->  Llama2cTokenizer        llama2.c's tokenizer.bin (llama2c.py)
                          ->  GgufSentencePiece, GgufLlama3   the vocabulary inside a GGUF file (gguf.py)

Every family is a Tokenizer (base.py): Meta's encode/decode interface, stop_ids and
encode_dialog (chat_format.py, Meta's chat prompt for that family).
"""

import re
import shutil
import struct
from pathlib import Path

from ..support.files import is_gguf
from .base import Tokenizer

# A tiktoken ranks file is text, one "base64-token rank" pair per line: "IQ== 0\n".
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=* [0-9]+\r?\n")


def open_tokenizer(path) -> Tokenizer:
    """The tokenizer in the file at path, of the family its first bytes say."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer not found: {path}; pass --tokenizer PATH/tokenizer.model")
    with open(path, "rb") as f:
        head = f.read(64)
    if is_gguf(path):
        from .gguf_vocab import gguf_tokenizer

        return gguf_tokenizer(path)
    if _TIKTOKEN_LINE.match(head):
        from .llama3 import TiktokenTokenizer

        return TiktokenTokenizer(path)
    if head.lstrip().startswith(b"{"):
        from .tokenizer_json import HfTokenizerJson

        return HfTokenizerJson(path)
    if _looks_like_llama2c(head):
        from .llama2c_vocab import Llama2cTokenizer

        return Llama2cTokenizer(path)
    from .spm import SentencePieceTokenizer

    return SentencePieceTokenizer(path)


def check_vocab_size(tokenizer: Tokenizer, vocab_size: int, model) -> None:
    """Refuse a tokenizer whose vocabulary is not the model's: its ids would index another
    embedding table, or run past it."""
    if tokenizer.n_words != vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.model_path} has {tokenizer.n_words} tokens but the model's vocabulary has "
            f"{vocab_size} ({model}); pass the tokenizer that belongs to this checkpoint (--tokenizer)"
        )


def copy_tokenizer(path, dst) -> None:
    """Copy the tokenizer file at path to dst; of a GGUF model, only its vocabulary (a
    vocabulary-only GGUF file, as llama.cpp's ggml-vocab-*.gguf), not gigabytes of weights."""
    if is_gguf(path):
        from .gguf_vocab import write_vocabulary_file

        write_vocabulary_file(path, dst)
    else:
        shutil.copyfile(path, dst)


def _looks_like_llama2c(head: bytes) -> bool:
    """llama2.c's tokenizer.bin starts with its longest token's length, then the first
    token's float score and length. A SentencePiece file (protobuf) starts with bytes
    0x0a, n, 0x0a, which read as that length give millions."""
    if len(head) < 12:
        return False
    max_len, score, first_len = struct.unpack_from("<IfI", head)
    return 0 < max_len <= 1 << 16 and first_len <= max_len and score == score
