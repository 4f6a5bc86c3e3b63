"""Checkpoint formats in and out: native, Meta, Hugging Face, GGUF, and llama2.c's files (read only).

    load_checkpoint(path) -> Transformer      any format, told apart by content (checkpoint.py)
    save_checkpoint(model, path, format)      native, meta or hf
    python -m llama_mini.formats.convert SRC DST --to native|meta|hf|gguf

One table names the parameters in every layout (names.py); each format has a module of its
own; reading.py reads files trusting nothing in them. GGUF's container is read by
llama_mini/support/gguf_file.py, outside this package: tokenizers/ reads a GGUF file's vocabulary with
it, and this package imports tokenizers/.
"""

from .checkpoint import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
