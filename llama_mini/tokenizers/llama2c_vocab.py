"""llama2.c's tokenizer.bin: a SentencePiece vocabulary flattened for C (llama2.c/tokenizer.py, export).

Layout, little-endian: uint32 max_token_length, then per token float32 score, uint32
length and that many bytes. The bytes are the piece with "▁" written as a space; BOS and
EOS are "\\n<s>\\n" and "\\n</s>\\n"; byte-fallback pieces keep their text, "<0x0A>". The
vocabulary size is not stored: it is the number of records.

Encoding is llama2.c's run.c encode, SentencePiece's BPE by scores (score_bpe.py).
"""

import os
import re
import struct

from .score_bpe import ScoreBpeTokenizer

BOS_PIECE, EOS_PIECE = b"\n<s>\n", b"\n</s>\n"
_BYTE_PIECE = re.compile(rb"<0x([0-9A-F]{2})>")


class Llama2cTokenizer(ScoreBpeTokenizer):
    def __init__(self, model_path):
        model_path = os.fspath(model_path)
        pieces, scores = read_tokenizer_bin(model_path)
        ids = {}
        for i, piece in enumerate(pieces):
            ids.setdefault(piece, i)
        if BOS_PIECE not in ids or EOS_PIECE not in ids:
            raise ValueError(f"{model_path} has no BOS/EOS pieces ({BOS_PIECE!r}, {EOS_PIECE!r}): not llama2.c's tokenizer.bin")
        bos_id, eos_id = ids[BOS_PIECE], ids[EOS_PIECE]
        self.unk_id = 0  # SentencePiece's and llama2.c's <unk>
        byte_ids = {int(m.group(1), 16): i for piece, i in ids.items() if (m := _BYTE_PIECE.fullmatch(piece))}
        super().__init__(model_path, pieces, scores, bos_id, eos_id, -1, byte_ids,
                         unspellable={self.unk_id, bos_id, eos_id, *byte_ids.values()}, silent={bos_id, eos_id})


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
