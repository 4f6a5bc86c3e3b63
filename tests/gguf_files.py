"""GGUF files written for tests with gguf's own writer, as llama.cpp's tools write them, and read
back by transformers (an independent GGUF reader), for checking llama_mini's reader against both;
and the command lines the GGUF tests run."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter, TokenType
from gguf import GGMLQuantizationType as T

from llama_mini.formats.names import to_format

ROOT = Path(__file__).resolve().parents[1]
# The evaluation windows of tests/formats/conftest.py's trained run, which a run fine-tuned from it shares.
EVAL = ["--seq-len", 128, "--batch-size", 4, "--eval-iters", 2, "--sample-tokens", 0, "--device", "cpu"]


def cli(*args, check=True) -> subprocess.CompletedProcess:
    """python *args in the repository, on one thread."""
    result = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert not check or result.returncode == 0, result.stderr
    return result


def llama_cpp_permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: Hugging Face's q/k rows -> the order llama.cpp reads."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def random_blocks(shape, qtype, generator: np.random.Generator) -> np.ndarray:
    """Random bytes in qtype's block layout for a (rows, cols) tensor. Every byte is below 0x20, so
    every float16 scale in a block is below 1/64 (never inf or NaN) and the weights stay small."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    return generator.integers(0, 0x20, size=(rows, cols // block * block_bytes), dtype=np.uint8)


def add_llama_hyperparameters(writer: GGUFWriter, args) -> None:
    """The llama.* keys convert_hf_to_gguf.py writes for a Llama (args: our ModelArgs)."""
    writer.add_context_length(args.max_seq_len)
    writer.add_embedding_length(args.dim)
    writer.add_block_count(args.n_layers)
    writer.add_feed_forward_length(args.ffn_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.n_kv_heads)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_vocab_size(args.vocab_size)


def add_tiny_vocabulary(writer: GGUFWriter, n: int) -> None:
    """A "llama" vocabulary of n tokens: <unk>, <s>, </s>, then single letters and pairs."""
    letters = [f"\u2581{chr(97 + i % 26)}{chr(97 + i // 26) if i >= 26 else ''}" for i in range(n - 3)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", *letters])
    writer.add_token_scores([0.0, 0.0, 0.0, *(-float(i) for i in range(n - 3))])
    writer.add_token_types([TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.NORMAL] * (n - 3)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_gguf(path, args, tensors: dict, vocabulary=True, fields=None):
    """A llama GGUF file of tensors ({GGUF name: (array, GGML type)}: float arrays, or raw
    block bytes for quantized types), with args' hyperparameters and a tiny vocabulary."""
    writer = GGUFWriter(str(path), "llama")
    add_llama_hyperparameters(writer, args)
    if vocabulary:
        add_tiny_vocabulary(writer, args.vocab_size)
    for key, (value, kind) in (fields or {}).items():
        writer.add_key_value(key, value, kind)
    for name, (array, qtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)  # floats: by their dtype
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_names(model) -> dict:
    """Our state dict in llama.cpp's names, as float32 numpy arrays (a tied head left out)."""
    state = dict(model.state_dict())
    if model.args.tie_embeddings:
        del state["output.weight"]
    return {to_format(name, "gguf"): tensor.detach().float().numpy() for name, tensor in state.items()}


def transformers_model(path):
    """transformers' own reading of a GGUF file (its config, dequantization and q/k
    permutation), as LlamaForCausalLM in float32: an independent reader."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=not config.get("tie_word_embeddings"))
    if config.get("tie_word_embeddings"):
        model.tie_weights()
    return model
