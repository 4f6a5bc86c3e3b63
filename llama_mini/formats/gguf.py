"""GGUF, llama.cpp's file: models of its "llama" architecture read (read_gguf) and written
(export_gguf), so that a model held as GGUF runs here and a model trained here runs in llama.cpp.

Written with the `gguf` package, llama.cpp's own writer; read with llama_mini/support/gguf_file.py and dequantized
with gguf's own quants code. The two directions are one mapping, each fact with its inverse:
- Tensor names are llama.cpp's (token_embd, blk.N.attn_q, ..., output_norm, output: names.py).
- Hyperparameters are llama.cpp's llama.* keys (write_hyperparameters, args_from_gguf).
- q and k rows stay as they are: llama.cpp's "llama" rope rotates adjacent pairs, Meta's
  layout, which is ours; its convert_hf_to_gguf.py permutes Hugging Face's q/k back to it.
- Llama-3.1 RoPE scaling is stored as llama.cpp does: a `rope_freqs` tensor of per-frequency
  divisors (ggml_rope_ext divides each frequency by its factor), read back as the scaling
  parameters that give those divisors.
- A tied output head is left out; llama.cpp then uses token_embd.
- The vocabulary is the model's tokenizer in llama.cpp's keys: SentencePiece (tokenizer.ggml.model
  "llama"), Llama-3's tiktoken ranks ("gpt2", pre-tokenizer "llama-bpe"), or another GGUF's
  vocabulary copied as it is (llama_mini/tokenizers/gguf_vocab.py reads them back).

Types: 1-D tensors (norms, rope_freqs) are F32 in every file, as llama.cpp writes them. q8_0 and
q4_0 quantize the matrices in blocks of 32 (a matrix whose rows do not split into blocks falls
back to F16, as in convert_hf_to_gguf.py); under q4_0 the output head is Q8_0, for the reason
llama_mini/quant/ keeps it at int8.
"""

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import Keys

from ..support.files import atomic_write, brief
from ..support.gguf_file import FLOATS, GGUFFile, check_llama
from ..support.memory import check_free_memory, return_freed_memory
from ..model import ModelArgs, Transformer, rope_frequencies
from ..quant.gguf_blocks import TYPES, held_bytes, layer_from_blocks
from ..quant import layer_method
from ..quant.held import layer_record
from ..quant.k_quants import KQuantLinear
from ..quant.layers import QuantizedEmbedding
from ..quant.mapped_q8_0 import MappedQ8_0Linear
from ..tokenizers import open_tokenizer
from ..tokenizers.gguf_vocab import GgufLlama3, GgufSentencePiece, copy_vocabulary
from ..tokenizers.llama3 import TiktokenTokenizer
from ..tokenizers.spm import SentencePieceTokenizer
from ..tokenizers.tokenizer_json import bpe_from_ranks
from .config_check import check_fields, model_args
from .names import from_format, to_format
from .state_dict import check_fits_config

TENSOR_TYPES = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
BLOCK = 32  # weights per Q8_0 / Q4_0 block
ROPE_FREQS = "rope_freqs.weight"

def export_gguf(model: Transformer, path, tokenizer_path, type: str = "f16") -> Path:
    """Write model and its vocabulary (from tokenizer_path, see write_vocabulary) to the GGUF file path; returns path."""
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


def _llama(key: str) -> str:
    """gguf's key template ("{arch}.block_count") for the llama architecture."""
    return key.format(arch="llama")


# ModelArgs fields read from llama.cpp's keys, the keys write_hyperparameters writes, with their
# types and whether llama.cpp requires them for the llama architecture.
HYPERPARAMETERS = {
    "max_seq_len": (_llama(Keys.LLM.CONTEXT_LENGTH), int, True),
    "dim": (_llama(Keys.LLM.EMBEDDING_LENGTH), int, True),
    "n_layers": (_llama(Keys.LLM.BLOCK_COUNT), int, True),
    "hidden_dim": (_llama(Keys.LLM.FEED_FORWARD_LENGTH), int, True),
    "n_heads": (_llama(Keys.Attention.HEAD_COUNT), int, True),
    "n_kv_heads": (_llama(Keys.Attention.HEAD_COUNT_KV), int, False),
    "rope_theta": (_llama(Keys.Rope.FREQ_BASE), float, False),
    "norm_eps": (_llama(Keys.Attention.LAYERNORM_RMS_EPS), float, True),
}
# The other keys read, each checked against what Llama's architecture implies.
OTHER_KEYS = {
    _llama(Keys.LLM.VOCAB_SIZE): int, _llama(Keys.Rope.DIMENSION_COUNT): int, _llama(Keys.Attention.KEY_LENGTH): int,
    _llama(Keys.Attention.VALUE_LENGTH): int, _llama(Keys.Rope.SCALING_TYPE): str, _llama(Keys.Rope.SCALING_FACTOR): float,
    _llama(Keys.Rope.SCALING_ORIG_CTX_LEN): int,
}


def args_from_gguf(fields: dict, vocab_size: int, source) -> dict:
    """The ModelArgs fields a GGUF file's metadata states, checked; vocab_size is token_embd's rows."""
    check_llama(fields, source)
    missing = [key for key, _, required in HYPERPARAMETERS.values() if required and key not in fields]
    if missing:
        raise ValueError(f"{source} lacks {', '.join(missing)}, which llama.cpp's llama architecture requires")
    check_fields(fields, {**{key: kind for key, kind, _ in HYPERPARAMETERS.values()}, **OTHER_KEYS}, source)
    args = {name: fields[key] for name, (key, _, _) in HYPERPARAMETERS.items() if key in fields}
    stated = fields.get(_llama(Keys.LLM.VOCAB_SIZE), vocab_size)
    if stated != vocab_size:
        raise ValueError(f"{source} states a vocabulary of {brief(stated)} tokens but token_embd has {vocab_size} rows")
    head_dim = args["dim"] // args["n_heads"]
    for key in (Keys.Rope.DIMENSION_COUNT, Keys.Attention.KEY_LENGTH, Keys.Attention.VALUE_LENGTH):
        if fields.get(_llama(key), head_dim) != head_dim:
            raise ValueError(f"{source}: {_llama(key)} is {brief(fields[_llama(key)])}, not the head size {head_dim} "
                             "(embedding_length / head_count) that Llama's attention has")
    scaling = fields.get(_llama(Keys.Rope.SCALING_TYPE), "none")
    if scaling != "none" and not (scaling == "linear" and fields.get(_llama(Keys.Rope.SCALING_FACTOR)) == 1):
        raise ValueError(f"{source} asks for {brief(scaling)} RoPE scaling, which llama_mini does not implement "
                         "(it has Llama-3.1's, which llama.cpp stores as a rope_freqs tensor)")
    return {**args, "vocab_size": vocab_size}


def rope_freq_factors(args: ModelArgs) -> torch.Tensor:
    """llama.cpp's rope_freqs: what each unscaled frequency is divided by under Llama-3.1 scaling."""
    unscaled = rope_frequencies(dataclasses.replace(args, use_scaled_rope=False))
    return unscaled / rope_frequencies(args)


def rope_scaling_from_factors(factors: torch.Tensor, args: ModelArgs, fields: dict, source) -> ModelArgs:
    """args with the Llama-3.1 scaling whose rope_freq_factors are the file's rope_freqs.

    The longest wavelengths are divided by the factor itself; the smoothing constants are
    Meta's published ones (low 1, high 4, original context 8192 unless the file says), the
    only ones Llama-3.x uses. Divisors no such scaling gives are refused, not approximated.
    """
    if tuple(factors.shape) != (args.head_dim // 2,):
        raise ValueError(f"{source}: rope_freqs has shape {tuple(factors.shape)}, not ({args.head_dim // 2},), one per frequency")
    factors = factors.float()
    if torch.equal(factors, torch.ones_like(factors)):
        return args
    original = fields.get(_llama(Keys.Rope.SCALING_ORIG_CTX_LEN), 8192)  # checked by args_from_gguf
    try:
        scaled = dataclasses.replace(args, use_scaled_rope=True, rope_scaling_factor=factors.max().item(),
                                     rope_original_max_seq_len=original)
    except ValueError as e:
        raise ValueError(f"{source}: its rope_freqs are not Llama-3.1's RoPE scaling ({e})") from None
    if not torch.allclose(rope_freq_factors(scaled), factors, rtol=1e-5, atol=0):
        raise ValueError(f"{source}: its rope_freqs are not Llama-3.1's RoPE scaling (factor {scaled.rope_scaling_factor:g}, "
                         f"low 1, high 4, original context {original}), the only scaling llama_mini computes")
    return scaled


def gguf_tensors(model: Transformer, type: str):
    """(llama.cpp name, numpy array as the writer takes it, GGML type) for every tensor of the file."""
    tensors = dict(model.state_dict())
    if model.args.tie_embeddings:
        del tensors["output.weight"]  # llama.cpp uses token_embd for a missing output
    for name, tensor in tensors.items():
        qtype = tensor_type(name, tensor, type)
        yield to_format(name, "gguf"), encode(tensor, qtype), qtype
    if model.args.use_scaled_rope:
        yield ROPE_FREQS, rope_freq_factors(model.args).numpy(), T.F32


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


def read_gguf(path: Path, dtype=None):
    """(ModelArgs, state dict in our names) of a GGUF file of llama.cpp's llama architecture.

    Names and shapes are checked against the metadata before any tensor is read. F32, F16 and
    BF16 tensors stay views of the mapped file; quantized ones are dequantized one at a time,
    to dtype (default float32, which holds every dequantized value exactly).
    """
    file = GGUFFile(path, string_arrays=False)
    args, names, _ = _gguf_args(file, path)
    state = {ours: file.tensor(theirs, dtype) for ours, theirs in names.items()}
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return args, state


def load_gguf_blocks(path: Path, converter=None):
    """The model of a GGUF file at the file's precision, or None where it holds no quantized
    tensor (read_gguf maps its float tensors as they are). Each quantized matrix becomes an
    integer layer (int8, int4, Q5_K, Q6_K) as it is read (quant/gguf_blocks.py), the token embedding a
    QuantizedEmbedding over its rows (the head's, when tied), and the float tensors (the norms)
    float32. No float copy of a quantized matrix is ever made; activations are float32.
    converter: layer_from_blocks', the CPU kernels' where they run."""
    file = GGUFFile(path, string_arrays=False)
    if all(info.type in FLOATS for info in file.tensors.values()):
        return None
    args, names, model = _gguf_args(file, path)
    infos = [file.tensors[theirs] for theirs in names.values()]
    if unread := next((theirs for theirs in names.values() if file.tensors[theirs].type not in (*FLOATS, *TYPES)), None):
        readable = ", ".join(t.name for t in (*FLOATS, *TYPES))
        raise ValueError(f"{path} stores tensor {unread} as {file.tensors[unread].type.name}; llama_mini reads {readable}")
    needed = sum(4 * info.numel if info.type in FLOATS else held_bytes(info.type, info.shape) for info in infos)
    check_free_memory(needed, f"{path} at its own precision", torch.device("cpu"),
                      "close what else holds memory, or take a smaller file (a lower-bit type or a smaller model)")
    floats, kinds, layers, mapped = {}, {}, {}, []
    for ours, theirs in names.items():
        info = file.tensors[theirs]
        if info.type in FLOATS:  # a norm: a copy of its own, so that a forward reads no page but the mapped layers'
            floats[ours] = file.tensor(theirs).to(torch.float32, copy=True)
            file.release(theirs)
            continue
        try:
            layer = layer_from_blocks(info.type, file.blocks(theirs), info.shape, converter)
        except ValueError as e:  # a block no layer holds exactly
            raise ValueError(f"{path}: tensor {theirs}: {e}") from None
        if isinstance(layer, (MappedQ8_0Linear, KQuantLinear)):  # the file's pages are the layer's
            file.map_pages(theirs)
            mapped.append(theirs)
        else:  # a copy of its own: the file's pages are not read again
            file.release(theirs)
        return_freed_memory()
        kinds.setdefault(info.type.name, layer_method(layer))
        layers[ours.removesuffix(".weight")] = layer_record(layer)
        parent, _, child = ours.removesuffix(".weight").rpartition(".")
        if child == "tok_embeddings":
            layer = QuantizedEmbedding(layer)
        setattr(model.get_submodule(parent), child, layer)
    file.keep_only(mapped)
    model.load_state_dict(floats, strict=False, assign=True)
    if args.tie_embeddings:  # the head is the embedding's own table, one copy of it
        if isinstance(model.tok_embeddings, QuantizedEmbedding):
            model.output = model.tok_embeddings.table
        else:
            model.output.weight = model.tok_embeddings.weight
    held = ", ".join(kind if kind == layer else f"{kind} as {layer}" for kind, layer in sorted(kinds.items()))
    model.quantization = {"method": "gguf", "held": f"the file's blocks ({held})", "layers": layers}
    return model.eval()


def gguf_args(path: Path) -> ModelArgs:
    """The ModelArgs of a GGUF file, from its metadata and tensor list (and the small rope_freqs)."""
    return _gguf_args(GGUFFile(path, string_arrays=False), path)[0]


def _gguf_args(file: GGUFFile, path: Path):
    """(ModelArgs, our tensor names to the file's, the empty model they were checked against) of
    an open GGUF file, its names and shapes checked against its metadata."""
    names = {}
    for name in file.tensors:
        if name != ROPE_FREQS:
            try:
                names[from_format(name, "gguf")] = name
            except KeyError:
                raise ValueError(f"{path} holds tensor {name[:80]!r}, which is not part of a Llama model") from None
    if "tok_embeddings.weight" not in names:
        raise ValueError(f"{path} has no token_embd.weight; it is not a whole Llama model")
    fields = args_from_gguf(file.fields, file.tensors[names["tok_embeddings.weight"]].shape[0], path)
    tied = "output.weight" not in names  # llama.cpp then uses token_embd as the head
    args = model_args({**fields, "tie_embeddings": tied}, path)
    if ROPE_FREQS in file.tensors:
        args = rope_scaling_from_factors(file.tensor(ROPE_FREQS), args, file.fields, path)
    model = check_fits_config(args, {ours: file.tensors[theirs] for ours, theirs in names.items()}, path, layout="gguf")
    return args, names, model


def write_vocabulary(writer, tokenizer_path, vocab_size: int) -> None:
    """The model's vocabulary in llama.cpp's keys, from its tokenizer file: a SentencePiece
    model, Llama-3's tiktoken ranks (or its tokenizer.json), or a GGUF file's vocabulary."""
    if tokenizer_path is None:
        raise FileNotFoundError("GGUF export needs the model's tokenizer (llama.cpp reads the vocabulary "
                                "from the file); pass --tokenizer PATH")
    tokenizer = open_tokenizer(tokenizer_path)
    if tokenizer.n_words != vocab_size:
        raise ValueError(f"{tokenizer_path} has {tokenizer.n_words} tokens but the model has {vocab_size}; "
                         "pass the tokenizer.model that belongs to this model (--tokenizer)")
    if isinstance(tokenizer, (GgufSentencePiece, GgufLlama3)):
        copy_vocabulary(GGUFFile(tokenizer_path), writer)
    elif isinstance(tokenizer, TiktokenTokenizer):
        write_llama3_vocabulary(writer, tokenizer)
    elif isinstance(tokenizer, SentencePieceTokenizer):
        write_sentencepiece_vocabulary(writer, tokenizer.sp)
    else:
        raise ValueError(f"{tokenizer_path} is llama2.c's tokenizer.bin, which GGUF export does not write; pass "
                         "--tokenizer with the SentencePiece tokenizer.model it was exported from")


def write_llama3_vocabulary(writer, tokenizer: TiktokenTokenizer) -> None:
    """Llama-3's vocabulary as convert_hf_to_gguf.py writes it from Meta's Hugging Face files:
    byte-level BPE tokens and merges (as transformers made them from Meta's ranks), the
    special tokens after them as control tokens, and pre-tokenizer "llama-bpe"."""
    tokens, merges = bpe_from_ranks(tokenizer.ranks)
    specials = sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    if [i for _, i in specials] != list(range(len(tokens), tokenizer.n_words)):
        raise ValueError(f"{tokenizer.model_path}: its special tokens do not follow its ranks; GGUF numbers tokens in order")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens + [name for name, _ in specials])
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(specials))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_eot_token_id(tokenizer.special_tokens["<|eot_id|>"])
    if "<|eom_id|>" in tokenizer.special_tokens:
        writer.add_eom_token_id(tokenizer.special_tokens["<|eom_id|>"])
    if tokenizer.pad_id >= 0:
        writer.add_pad_token_id(tokenizer.pad_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)


def write_sentencepiece_vocabulary(writer, sp) -> None:
    """The SentencePiece vocabulary as convert_hf_to_gguf.py writes it: pieces, scores, token types."""
    vocab_size = sp.vocab_size()
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
