"""GGUF export, so that a model trained or converted here runs in llama.cpp and the tools built on it.

Written with the `gguf` package, llama.cpp's own writer, for architecture "llama":
- Tensor names are llama.cpp's (token_embd, blk.N.attn_q, ..., output_norm, output: names.py).
- q and k rows stay as they are: llama.cpp's "llama" rope rotates adjacent pairs, Meta's
  layout, which is ours; its convert_hf_to_gguf.py permutes Hugging Face's q/k back to it.
- Llama-3.1 RoPE scaling is stored as llama.cpp does: a `rope_freqs` tensor of per-frequency
  divisors (ggml_rope_ext divides each frequency by its factor).
- The vocabulary comes from the SentencePiece tokenizer.model (tokenizer.ggml.model "llama").

Types: 1-D tensors (norms, rope_freqs) are F32 in every file, as llama.cpp writes them. q8_0 and
q4_0 quantize the matrices in blocks of 32 (a matrix whose rows do not split into blocks falls
back to F16, as in convert_hf_to_gguf.py); under q4_0 the output head is Q8_0, for the reason
llama_mini/quant/ keeps it at int8.
"""

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import sentencepiece as spm
import torch
from gguf import GGMLQuantizationType as T

from ..files import atomic_write
from ..model import ModelArgs, Transformer, rope_frequencies
from .names import to_format

TENSOR_TYPES = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
BLOCK = 32  # weights per Q8_0 / Q4_0 block

def export_gguf(model: Transformer, path, tokenizer_path, type: str = "f16") -> Path:
    """Write model and its SentencePiece vocabulary to the GGUF file path; returns path."""
    if type not in TENSOR_TYPES:
        raise ValueError(f"unknown GGUF type {type!r}; choose one of {', '.join(TENSOR_TYPES)}")
    check_exportable(model)
    path = Path(path)

    def write(tmp):
        writer = gguf.GGUFWriter(tmp, "llama")
        write_hyperparameters(writer, model.args, FILE_TYPES[type])
        write_vocabulary(writer, tokenizer_path, model.args.vocab_size)
        for name, array, qtype in gguf_tensors(model, type):
            writer.add_tensor(name, array, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write(path, write)
    return path


def check_exportable(model: Transformer) -> None:
    if getattr(model, "quantization", None):
        raise ValueError("GGUF export reads full-precision weights; export the checkpoint that was quantized, "
                         "with --type q8_0 or q4_0")
    if model.args.norm != "rmsnorm":
        raise ValueError(f"llama.cpp's llama architecture has RMSNorm only; this model uses {model.args.norm!r}")


def write_hyperparameters(writer, args: ModelArgs, file_type) -> None:
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_vocab_size(args.vocab_size)
    writer.add_file_type(file_type)


def rope_freq_factors(args: ModelArgs) -> torch.Tensor:
    """llama.cpp's rope_freqs: what each unscaled frequency is divided by under Llama-3.1 scaling."""
    unscaled = rope_frequencies(dataclasses.replace(args, use_scaled_rope=False))
    return unscaled / rope_frequencies(args)


def gguf_tensors(model: Transformer, type: str):
    """(llama.cpp name, numpy array as the writer takes it, GGML type) for every tensor of the file."""
    tensors = dict(model.state_dict())
    if model.args.tie_embeddings:
        del tensors["output.weight"]  # llama.cpp uses token_embd for a missing output
    for name, tensor in tensors.items():
        qtype = tensor_type(name, tensor, type)
        yield to_format(name, "gguf"), encode(tensor, qtype), qtype
    if model.args.use_scaled_rope:
        yield "rope_freqs.weight", rope_freq_factors(model.args).numpy(), T.F32


def tensor_type(name: str, tensor: torch.Tensor, type: str):
    if tensor.dim() == 1:
        return T.F32
    if type in ("q8_0", "q4_0") and tensor.shape[-1] % BLOCK:
        return T.F16
    if type == "q4_0" and name == "output.weight":
        return T.Q8_0
    return TENSOR_TYPES[type]


def encode(tensor: torch.Tensor, qtype) -> np.ndarray:
    """tensor as the bytes (or float array) of qtype, through gguf's own quantizers."""
    data = tensor.detach().float().numpy()
    if qtype == T.F32:
        return data
    if qtype == T.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)


def write_vocabulary(writer, tokenizer_path, vocab_size: int) -> None:
    """The SentencePiece vocabulary as convert_hf_to_gguf.py writes it: pieces, scores, token types."""
    if tokenizer_path is None:
        raise FileNotFoundError("GGUF export needs the model's tokenizer.model (llama.cpp reads the vocabulary "
                                "from the file); pass --tokenizer PATH")
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(tokenizer_path))
    except (OSError, RuntimeError):
        raise ValueError(f"{tokenizer_path} is not a SentencePiece model; GGUF export writes SentencePiece "
                         "vocabularies only (a Llama-3 tiktoken vocabulary is not supported yet)") from None
    if sp.vocab_size() != vocab_size:
        raise ValueError(f"{tokenizer_path} has {sp.vocab_size()} tokens but the model has {vocab_size}; "
                         "pass the tokenizer.model that belongs to this model (--tokenizer)")
    pieces = [sp.IdToPiece(i) for i in range(vocab_size)]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(pieces)
    writer.add_token_scores([sp.GetScore(i) for i in range(vocab_size)])
    writer.add_token_types([token_type(sp, i) for i in range(vocab_size)])
    for add, token_id in ((writer.add_bos_token_id, sp.bos_id()), (writer.add_eos_token_id, sp.eos_id()),
                          (writer.add_unk_token_id, sp.unk_id()), (writer.add_pad_token_id, sp.pad_id())):
        if token_id >= 0:
            add(token_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    # The normaliser settings llama.cpp reads, found by behaviour (reading them from the model
    # proto needs protobuf): a dummy "▁" before the first word, runs of spaces squeezed.
    writer.add_add_space_prefix(sp.EncodeAsPieces("a")[0].startswith("\u2581"))
    writer.add_remove_extra_whitespaces(sp.DecodePieces(sp.EncodeAsPieces("a  b")) == "a b")


def token_type(sp, i: int) -> int:
    if sp.IsUnknown(i):
        return gguf.TokenType.UNKNOWN
    if sp.IsControl(i):
        return gguf.TokenType.CONTROL
    if sp.IsUnused(i):
        return gguf.TokenType.UNUSED
    if sp.IsByte(i):
        return gguf.TokenType.BYTE
    return gguf.TokenType.NORMAL
