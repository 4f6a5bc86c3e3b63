"""llama_mini: a compact, exact Llama-2 model codebase."""

from .model import ModelArgs, RMSNorm, Transformer

__all__ = ["ModelArgs", "RMSNorm", "Transformer"]
