"""llama_mini: a compact, exact Llama model codebase (Llama-2, Llama-3.x, llama2.c)."""

from .checkpoint import load_checkpoint, save_checkpoint
from .generation import generate
from .model import ModelArgs, RMSNorm, Transformer
from .tokenizer import Tokenizer

__all__ = ["ModelArgs", "RMSNorm", "Transformer", "generate", "load_checkpoint", "save_checkpoint", "Tokenizer"]
