"""llama2.c's files, written as llama2.c's scripts export them (for tests): tokenizer.bin as
tokenizer.py writes it, and a model's .bin as export.py writes it (v0, v1, v2)."""

import struct

import sentencepiece as spm
import torch

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


def fp32(tensor) -> bytes:
    d = tensor.detach().reshape(-1).to(torch.float32).tolist()
    return struct.pack(f"{len(d)}f", *d)


def int8(tensor) -> bytes:
    d = tensor.detach().reshape(-1).tolist()
    return struct.pack(f"{len(d)}b", *d)


def quantize_q80(w, group_size):
    """export.py's quantize_q80: symmetric int8 per group of group_size, scale = max|w| / 127."""
    w = w.float().reshape(-1, group_size)
    scale = torch.abs(w).max(dim=1).values / 127.0
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def header7(model, vocab_size):
    p = model.args
    hidden_dim = model.layers[0].feed_forward.w1.weight.shape[0]
    return struct.pack("iiiiiii", p.dim, hidden_dim, p.n_layers, p.n_heads, p.n_kv_heads, vocab_size, p.max_seq_len)


def export(model, path, version, group_size=64):
    """Write model as llama2.c's export.py writes .bin version `version`."""
    layers = model.layers
    shared = torch.equal(model.tok_embeddings.weight, model.output.weight)
    out = bytearray()
    if version == 0:  # legacy_export: negative vocab_size flags an unshared classifier
        out += header7(model, model.args.vocab_size if shared else -model.args.vocab_size)
        out += fp32(model.tok_embeddings.weight)
        for get in (lambda l: l.attention_norm.weight, lambda l: l.attention.wq.weight, lambda l: l.attention.wk.weight,
                    lambda l: l.attention.wv.weight, lambda l: l.attention.wo.weight, lambda l: l.ffn_norm.weight,
                    lambda l: l.feed_forward.w1.weight, lambda l: l.feed_forward.w2.weight, lambda l: l.feed_forward.w3.weight):
            for layer in layers:
                out += fp32(get(layer))
        out += fp32(model.norm.weight)
        head_dim, seq = model.args.head_dim, model.args.max_seq_len  # llama2.c's precompute_freqs_cis
        freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
        angles = torch.outer(torch.arange(seq), freqs).float()
        out += fp32(torch.cos(angles)) + fp32(torch.sin(angles))
        if not shared:
            out += fp32(model.output.weight)
        path.write_bytes(bytes(out))
        return
    out += struct.pack("I", 0x616B3432) + struct.pack("i", version) + header7(model, model.args.vocab_size)
    out += struct.pack("B", int(shared))
    if version == 2:
        while model.args.dim % group_size != 0:
            group_size //= 2
        out += struct.pack("i", group_size)
    out += b"\0" * (256 - len(out))
    norms = [*[l.attention_norm.weight for l in layers], *[l.ffn_norm.weight for l in layers], model.norm.weight]
    matrices = [model.tok_embeddings.weight, *[l.attention.wq.weight for l in layers], *[l.attention.wk.weight for l in layers],
                *[l.attention.wv.weight for l in layers], *[l.attention.wo.weight for l in layers],
                *[l.feed_forward.w1.weight for l in layers], *[l.feed_forward.w2.weight for l in layers],
                *[l.feed_forward.w3.weight for l in layers]]
    if not shared:
        matrices.append(model.output.weight)
    if version == 1:
        for w in (*norms, *matrices):
            out += fp32(w)
    else:
        for w in norms:
            out += fp32(w)
        for w in matrices:
            q, s = quantize_q80(w, group_size)
            out += int8(q) + fp32(s)
    path.write_bytes(bytes(out))
