"""Checkpoint formats in and out: native, Meta, Hugging Face, llama2.c, and GGUF export.

    load_checkpoint(path) -> Transformer      any format, told apart by content (checkpoint.py)
    save_checkpoint(model, path, format)      native, meta or hf
    python -m llama_mini.formats.convert SRC DST --to native|meta|hf|gguf

One table names the parameters in every layout (names.py); each format has a module of its
own; files.py reads files trusting nothing in them.
"""

from .checkpoint import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
