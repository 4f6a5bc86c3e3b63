"""llama2.c's tokenizer.bin: a SentencePiece vocabulary flattened for C (llama2.c/tokenizer.py, export).

Layout, little-endian: uint32 max_token_length, then per token float32 score, uint32
length and that many bytes. The bytes are the piece with "▁" written as a space; BOS and
EOS are "\\n<s>\\n" and "\\n</s>\\n"; byte-fallback pieces keep their text, "<0x0A>". The
vocabulary size is not stored: it is the number of records.

Encoding is llama2.c's run.c encode, a greedy BPE over the scores: a leading space (the
dummy prefix), one token per character (or its UTF-8 bytes), then the adjacent pair whose
merge has the highest score is merged, the leftmost on ties, until no pair merges.
"""

import codecs
import heapq
import os
import re
import struct

from .base import Tokenizer

BOS_PIECE, EOS_PIECE = b"\n<s>\n", b"\n</s>\n"
_BYTE_PIECE = re.compile(rb"<0x([0-9A-F]{2})>")
_NO_MERGE = -1e10  # run.c's starting best score: a merge must score above it
# SentencePiece decodes each byte that is not part of a character as one U+FFFD; Python's
# "replace" makes one of a whole broken sequence.
codecs.register_error("sentencepiece", lambda e: ("\ufffd" * (e.end - e.start), e.end))


class Llama2cTokenizer(Tokenizer):
    def __init__(self, model_path):
        self.model_path = os.fspath(model_path)
        self.pieces, self.scores = read_tokenizer_bin(self.model_path)
        self.n_words = len(self.pieces)
        ids = {}
        for i, piece in enumerate(self.pieces):
            ids.setdefault(piece, i)
        if BOS_PIECE not in ids or EOS_PIECE not in ids:
            raise ValueError(f"{model_path} has no BOS/EOS pieces ({BOS_PIECE!r}, {EOS_PIECE!r}): not llama2.c's tokenizer.bin")
        self.bos_id, self.eos_id, self.pad_id = ids[BOS_PIECE], ids[EOS_PIECE], -1
        self.unk_id = 0  # SentencePiece's and llama2.c's <unk>
        # Raw bytes, for decoding byte-fallback pieces and encoding what no piece spells.
        self.byte_ids = {}
        for piece, i in ids.items():
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                self.byte_ids[int(m.group(1), 16)] = i
        # Pieces text can spell. As in SentencePiece, text never becomes a control token or
        # a byte piece by spelling "<s>" or "<0x41>".
        control = {self.unk_id, self.bos_id, self.eos_id, *self.byte_ids.values()}
        self.text_ids = {piece: i for piece, i in ids.items() if i not in control}

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = []
        for char in (" " + text if text else ""):  # the dummy prefix, as SentencePiece adds it
            utf8 = char.encode("utf-8")
            ids += [self.text_ids[utf8]] if utf8 in self.text_ids else [self._byte_id(b) for b in utf8]
        return [self.bos_id] * bos + self._merge(ids) + [self.eos_id] * eos

    def decode(self, ids) -> str:
        """The text of ids, as SentencePiece decodes it: BOS and EOS vanish, byte pieces become
        their byte, the first piece's leading space (the dummy prefix) is dropped, and each
        byte that is not part of a character becomes U+FFFD."""
        out, first = bytearray(), True
        for i in ids:
            if i in (self.bos_id, self.eos_id):
                continue
            piece = self.pieces[i]
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                out.append(int(m.group(1), 16))
            else:
                out += piece[1:] if first and piece.startswith(b" ") else piece
            first = False
        return out.decode("utf-8", errors="sentencepiece")

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


def read_tokenizer_bin(path) -> tuple[list[bytes], list[float]]:
    """The pieces and scores of a llama2.c tokenizer.bin, each length checked before it is used."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 4:
        raise ValueError(f"{path} is too short to be llama2.c's tokenizer.bin")
    (max_len,) = struct.unpack_from("<I", data)
    pieces, scores, pos = [], [], 4
    while pos < len(data):
        if pos + 8 > len(data):
            raise ValueError(f"{path} is truncated: a record header ends past the end of the file")
        score, length = struct.unpack_from("<fI", data, pos)
        if length > max_len or pos + 8 + length > len(data):
            raise ValueError(f"{path} is truncated or corrupt: token {len(pieces)} claims {length} bytes")
        pieces.append(data[pos + 8 : pos + 8 + length])
        scores.append(score)
        pos += 8 + length
    return pieces, scores
