"""The vocabulary a GGUF file carries (tokenizer.ggml.*), as the tokenizer family it describes.

llama.cpp writes the model's tokenizer into the model file. Two kinds are Llama's:
- "llama": SentencePiece's pieces, scores and token types (Llama-2, TinyLlama, llama2.c
  exports), encoded as SentencePiece's BPE encodes, by scores (score_bpe.py).
- "gpt2" with pre-tokenizer "llama-bpe": Llama-3's byte-level BPE, its tokens and merges, read
  back as the tiktoken ranks they were made from (tokenizer_json.py) and encoded with Meta's
  pre-tokenizer and special tokens (llama3.py).
Both keep the file's BOS, EOS, end-of-turn (EOT) and end-of-message (EOM) ids, so chat, stop ids
and encode_dialog work as for Meta's files. Any other vocabulary is refused in one line.
"""

import os
import re

import numpy as np
from gguf import GGUFValueType, GGUFWriter, Keys, TokenType

from ..support.gguf_file import GGUFFile, check_llama
from .base import Tokenizer
from .llama3 import TiktokenTokenizer
from .score_bpe import ScoreBpeTokenizer
from .tokenizer_json import LLAMA3_CHAT_TOKENS, ranks_from_bpe

# The pre-tokenizer labels llama.cpp reads with Meta's Llama-3 regex (its llama-vocab.cpp):
# "llama-bpe" from its converter, "smaug-bpe" for a tokenizer.json that transformers made from
# Meta's ranks, and the others of models that share the regex. The vocabulary itself must still be
# Llama-3's byte-level BPE with its special tokens.
LLAMA3_PRE_TOKENIZERS = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "falcon-h1", "pixtral",
                         "midm-2.0", "lfm2", "jina-v5-nano")
UNKNOWN_PIECE = " \u2047 "  # what SentencePiece decodes <unk> to
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte pieces
# The ids a generation ends at, beside EOS: where the file names them, and as Llama-3 names them.
STOP_KEYS = (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)
LLAMA3_STOPS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")


def gguf_tokenizer(path) -> Tokenizer:
    """The tokenizer of the GGUF file at path, of the family its tokenizer.ggml.model names."""
    file = GGUFFile(path)
    if Keys.General.ARCHITECTURE in file.fields:  # a model llama_mini cannot run: say so, not why its vocabulary is refused
        check_llama(file.fields, path)
    kind, pre = (_name(file.fields.get(key)) for key in (Keys.Tokenizer.MODEL, Keys.Tokenizer.PRE))
    if kind == "llama":
        return GgufSentencePiece(path, Vocabulary(file))
    if kind == "gpt2" and pre in LLAMA3_PRE_TOKENIZERS:
        return GgufLlama3(path, Vocabulary(file))
    what = "no vocabulary" if kind is None else f"a {kind!r} vocabulary" + (f" with pre-tokenizer {pre!r}" if kind == "gpt2" else "")
    raise ValueError(f"{path} holds {what}; llama_mini reads GGUF vocabularies of type 'llama' (SentencePiece) and "
                     "'gpt2' with Llama-3's pre-tokenizer ('llama-bpe'); pass --tokenizer with the model's tokenizer file")


def _name(value):
    """A metadata value where a name belongs, as a string (a number or array shortened, to show)."""
    return value if value is None or isinstance(value, str) else str(value)[:40]


class Vocabulary:
    """The tokenizer.ggml.* fields of a GGUF file, checked: tokens, token types, special ids."""

    def __init__(self, file: GGUFFile):
        self.path, fields = file.path, file.fields
        self.tokens = fields.get(Keys.Tokenizer.LIST)
        if not isinstance(self.tokens, list) or not self.tokens:
            raise self.refuse(f"{Keys.Tokenizer.LIST} is not a list of strings")
        types = self.array(fields, Keys.Tokenizer.TOKEN_TYPE)
        self.types = np.full(len(self.tokens), TokenType.NORMAL) if types is None else types
        self.scores = self.array(fields, Keys.Tokenizer.SCORES)  # a numpy array: not a float object per token
        self.merges = fields.get(Keys.Tokenizer.MERGES, [])
        self.ids = {key: self.token_id(fields, key) for key in (Keys.Tokenizer.BOS_ID, *STOP_KEYS, Keys.Tokenizer.PAD_ID)}
        self.add_space_prefix = fields.get(Keys.Tokenizer.ADD_PREFIX, True)
        if not isinstance(self.add_space_prefix, bool):
            raise self.refuse(f"{Keys.Tokenizer.ADD_PREFIX} is not true or false")

    def refuse(self, why: str) -> ValueError:
        return ValueError(f"{self.path}: its vocabulary is damaged ({why}); download or convert it again")

    def array(self, fields, key):
        """The array of one number per token at key (a numpy view), or None where the file has none."""
        values = fields.get(key)
        if values is None:
            return None
        if not isinstance(values, np.ndarray) or len(values) != len(self.tokens):
            raise self.refuse(f"{key} is not one number per token")
        return values

    def token_id(self, fields, key):
        value = fields.get(key)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(self.tokens)):
            raise self.refuse(f"{key} is {str(value)[:40]}, not a token id")
        return value

    def of_type(self, *types) -> set[int]:
        return set(np.flatnonzero(np.isin(self.types, types)).tolist())


class GgufSentencePiece(ScoreBpeTokenizer):
    """A GGUF "llama" vocabulary: SentencePiece pieces ("▁" for a space), scores and token types."""

    def __init__(self, model_path, vocab: Vocabulary):
        if vocab.scores is None:
            raise vocab.refuse(f"a 'llama' vocabulary needs {Keys.Tokenizer.SCORES}")
        if not np.isfinite(vocab.scores).all():  # a NaN score would make every merge's order arbitrary
            raise vocab.refuse(f"{Keys.Tokenizer.SCORES} holds NaN or inf")
        known = set(vocab.tokens)  # SentencePiece merges by scores; merges, where present, must still name tokens
        if any(part not in known for merge in vocab.merges for part in str(merge).split(" ")):
            raise vocab.refuse(f"{Keys.Tokenizer.MERGES} names tokens that are not in the vocabulary")
        self.ids = vocab.ids  # the file's special ids; not the vocabulary, whose strings ScoreBpeTokenizer holds as it needs them
        pieces = [token.replace("\u2581", " ").encode("utf-8") for token in vocab.tokens]
        byte_ids = {}
        for i in sorted(vocab.of_type(TokenType.BYTE)):
            token = vocab.tokens[i]
            if not BYTE_TOKEN.fullmatch(token):
                raise vocab.refuse(f"byte token {i} is {token[:20]!r}, not <0xXX> with two hex digits")
            byte_ids.setdefault(int(token[3:5], 16), i)
        for i in vocab.of_type(TokenType.UNKNOWN):
            pieces[i] = UNKNOWN_PIECE.encode("utf-8")
        control = vocab.of_type(TokenType.CONTROL)
        bos, eos = vocab.ids[Keys.Tokenizer.BOS_ID], vocab.ids[Keys.Tokenizer.EOS_ID]
        if bos is None or eos is None:
            raise vocab.refuse("it names no BOS or EOS token")
        pad = vocab.ids[Keys.Tokenizer.PAD_ID]
        unspellable = control | vocab.of_type(TokenType.UNKNOWN, TokenType.BYTE, TokenType.UNUSED)
        super().__init__(os.fspath(model_path), pieces, vocab.scores, bos, eos, -1 if pad is None else pad, byte_ids,
                         unspellable, silent=control | {bos, eos}, dummy_prefix=vocab.add_space_prefix)

    @property
    def stop_ids(self) -> list[int]:
        """EOS, and the end-of-turn and end-of-message tokens where the file names them."""
        return sorted({self.ids[key] for key in STOP_KEYS} - {None})


class GgufLlama3(TiktokenTokenizer):
    """A GGUF "gpt2" vocabulary with Llama-3's pre-tokenizer: Meta's tiktoken ranks, spelled as
    byte-level BPE tokens and merges, and the special tokens after them."""

    def __init__(self, model_path, vocab: Vocabulary):
        self.vocab, self.ids = vocab, vocab.ids
        super().__init__(model_path)  # which calls read
        del self.vocab  # its strings (36 MB of them for Llama-3) are the ranks now
        for name, key in (("bos_id", Keys.Tokenizer.BOS_ID), ("eos_id", Keys.Tokenizer.EOS_ID), ("pad_id", Keys.Tokenizer.PAD_ID)):
            if self.ids[key] is not None:  # the file's word over Meta's names
                setattr(self, name, self.ids[key])

    def read(self, path):
        """(ranks, special tokens): the tokens llama.cpp marks as control or user-defined are the
        special ones; the others, with the merges, are the ranks."""
        vocab = self.vocab
        special_ids = vocab.of_type(TokenType.CONTROL, TokenType.USER_DEFINED)
        special = {vocab.tokens[i]: i for i in special_ids}
        if len(special) != len(special_ids):
            raise vocab.refuse("a token appears twice")
        try:
            ranks = ranks_from_bpe({token: i for i, token in enumerate(vocab.tokens) if i not in special_ids}, vocab.merges)
        except ValueError as e:
            raise vocab.refuse(f"not Llama-3's byte-level BPE: {e}") from None
        if not LLAMA3_CHAT_TOKENS <= special.keys():
            raise vocab.refuse("it lacks Llama-3's special tokens")
        return ranks, special

    @property
    def stop_ids(self) -> list[int]:
        """Llama-3's ends of a text, a turn and a tool call, and whatever the file names as EOS,
        EOT and EOM (an instruct model's file says its EOS is <|eot_id|>)."""
        named = {self.special_tokens[name] for name in LLAMA3_STOPS if name in self.special_tokens}
        return sorted(named | {self.ids[key] for key in STOP_KEYS} - {None})


# --- Writing --------------------------------------------------------------------------------


def copy_vocabulary(file: GGUFFile, writer: GGUFWriter) -> None:
    """Every tokenizer.* field of a GGUF file, with its GGUF type, into writer."""
    for key, value in file.fields.items():
        if key.startswith("tokenizer."):
            kind, item = file.value_types[key]
            if kind == GGUFValueType.ARRAY:
                value = value if isinstance(value, list) else value.tolist()
                if not value:
                    continue  # the writer refuses empty arrays, and they say nothing
            writer.add_key_value(key, value, kind, item)


def write_vocabulary_file(path, dst) -> None:
    """A GGUF file holding only the vocabulary of the GGUF file at path, as llama.cpp's
    ggml-vocab-*.gguf files do: what a checkpoint keeps as its tokenizer."""
    file = GGUFFile(path)
    writer = GGUFWriter(dst, str(file.fields.get(Keys.General.ARCHITECTURE, "llama")))
    copy_vocabulary(file, writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
