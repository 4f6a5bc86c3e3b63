"""SentencePiece's BPE, encoded from a vocabulary of pieces and scores alone.

SentencePiece's BPE encoder, llama2.c's run.c encode and llama.cpp's llama tokenizer all do
the same: a leading space (the dummy prefix), one piece per character (or, where the
vocabulary has no piece for it, its UTF-8 bytes), then the adjacent pair whose merge is the
highest-scoring piece is merged, the leftmost on ties, until no pair merges. Vocabularies that
hold only pieces and scores (llama2.c's tokenizer.bin, a GGUF file's "llama" vocabulary) are
encoded with it here; SentencePiece's own model files are read by SentencePiece (spm.py).
"""

import codecs
import heapq
from array import array

from .base import Tokenizer

_NO_MERGE = -1e10  # run.c's starting best score: a merge must score above it
# SentencePiece decodes each byte that is not part of a character as one U+FFFD; Python's
# "replace" makes one of a whole broken sequence.
codecs.register_error("sentencepiece", lambda e: ("\ufffd" * (e.end - e.start), e.end))


class ScoreBpeTokenizer(Tokenizer):
    """pieces: each id's text as UTF-8 bytes, a space where SentencePiece writes "▁"; scores:
    each piece's merge priority; byte_ids: byte value -> the id of its byte piece ("<0x41>").

    unspellable ids never come from text (as in SentencePiece, text that spells "<s>" or
    "<0x41>" is those characters, not the control or byte token); silent ids decode to
    nothing (BOS, EOS and other control tokens). dummy_prefix: a space is put before the text
    when encoding, and taken off the first piece when decoding.
    """

    def __init__(self, model_path: str, pieces: list[bytes], scores, bos_id: int, eos_id: int, pad_id: int,
                 byte_ids: dict[int, int], unspellable: set[int], silent: set[int], dummy_prefix: bool = True):
        self.model_path = model_path
        self.pieces, self.scores = pieces, array("d", scores)  # not a float object per piece
        self.n_words = len(pieces)
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.byte_ids, self.silent, self.dummy_prefix = byte_ids, silent, dummy_prefix
        self.byte_of = {i: b for b, i in byte_ids.items()}
        self.unspellable = unspellable
        self.text_ids = {}
        for i, piece in enumerate(pieces):
            if i not in unspellable:
                self.text_ids.setdefault(piece, i)

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = []
        for char in (" " + text if self.dummy_prefix and text else text):
            utf8 = char.encode("utf-8")
            ids += [self.text_ids[utf8]] if utf8 in self.text_ids else [self._byte_id(b) for b in utf8]
        return [self.bos_id] * bos + self._merge(ids) + [self.eos_id] * eos

    def decode(self, ids) -> str:
        """The text of ids, as SentencePiece decodes it: control tokens vanish, byte pieces become
        their byte, the first piece's leading space (the dummy prefix) is dropped, and each
        byte that is not part of a character becomes U+FFFD."""
        out, first = bytearray(), True
        for i in ids:
            if i in self.silent:
                continue
            piece = self.pieces[i]
            byte = self.byte_of.get(i)
            if byte is not None:
                out.append(byte)
            else:
                dummy = first and self.dummy_prefix and piece.startswith(b" ") and i not in self.unspellable
                out += piece[1:] if dummy else piece  # an unknown token's " ⁇ " keeps its space
            first = False
        return out.decode("utf-8", errors="sentencepiece")

    def token_bytes(self) -> list[bytes]:
        return [bytes([self.byte_of[i]]) if i in self.byte_of else b"" if i in self.silent or i in self.unspellable
                else piece for i, piece in enumerate(self.pieces)]

    def _byte_id(self, byte: int) -> int:
        if byte not in self.byte_ids:
            raise ValueError(f"{self.model_path} has no byte piece <0x{byte:02X}> to spell a character it lacks")
        return self.byte_ids[byte]

    def _merge(self, ids: list[int]) -> list[int]:
        """run.c's merge loop, with a heap instead of a rescan after every merge: each live
        pair waits in the heap under (-score, position), so the pop is the pair run.c's scan
        would pick. A popped pair whose tokens changed since it was pushed is stale and skipped."""
        pieces = [self.pieces[i] for i in ids]
        nxt = list(range(1, len(ids))) + [None]
        prv = [None] + list(range(len(ids) - 1))
        heap = []

        def push(left):
            right = nxt[left] if left is not None else None
            if right is not None:
                merged = pieces[left] + pieces[right]
                i = self.text_ids.get(merged)
                if i is not None and self.scores[i] > _NO_MERGE:
                    heapq.heappush(heap, (-self.scores[i], left, merged))

        for pos in range(len(ids) - 1):
            push(pos)
        while heap:
            _, left, merged = heapq.heappop(heap)
            right = nxt[left]
            if pieces[left] is None or right is None or pieces[left] + pieces[right] != merged:
                continue
            ids[left], pieces[left], pieces[right] = self.text_ids[merged], merged, None
            nxt[left] = nxt[right]
            if nxt[left] is not None:
                prv[nxt[left]] = left
            push(prv[left])
            push(left)
        return [i for i, piece in zip(ids, pieces) if piece is not None]
