"""llama_mini: a compact, exact Llama (Llama-2, Llama-3.x, llama2.c) in PyTorch.

The core is model.py (the Transformer, torch only), generation.py (sampling) and trainer.py
(the training step). Everything else is a layer around it, in a subpackage named for its job:
formats/ (checkpoints in and out), tokenizers/, run/ (a training run's machinery), quant/ (int8
and int4 weights) and kernels/ (CPU kernels). The names below are imported on first use, so
`import llama_mini` loads none of them.
"""

import importlib

__version__ = "0.3.0"  # pyproject.toml reads it from here; checkpoints record it (formats/record.py)

_EXPORTS = {
    "ModelArgs": "model", "RMSNorm": "model", "Transformer": "model",
    "generate": "generation",
    "load_checkpoint": "formats", "save_checkpoint": "formats",
    "open_tokenizer": "tokenizers",
    "quantize": "quant",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llama_mini' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
