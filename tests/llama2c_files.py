"""llama2.c's tokenizer.bin, written as llama2.c's tokenizer.py exports it (for tests)."""

import struct

import sentencepiece as spm

BYTE_PIECES = [f"<0x{b:02X}>" for b in range(256)]


def write_tokenizer_bin(path, pieces, scores):
    """llama2.c's layout: uint32 max_token_length, then per token float32 score, uint32 length, bytes."""
    data = [piece.encode("utf-8") for piece in pieces]
    with open(path, "wb") as f:
        f.write(struct.pack("<I", max(len(b) for b in data)))
        for b, score in zip(data, scores):
            f.write(struct.pack("<fI", score, len(b)) + b)
    return path


def export_sentencepiece(model_path, out):
    """llama2.c's tokenizer.py export: BOS/EOS become "\\n<s>\\n" and "\\n</s>\\n", "▁" a space."""
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    pieces = []
    for i in range(sp.vocab_size()):
        piece = {sp.bos_id(): "\n<s>\n", sp.eos_id(): "\n</s>\n"}.get(i, sp.id_to_piece(i))
        pieces.append(piece.replace("▁", " "))
    return write_tokenizer_bin(out, pieces, [sp.get_score(i) for i in range(sp.vocab_size())])
