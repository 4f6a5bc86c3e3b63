"""llama_mini: a compact, exact Llama-2 model codebase."""

from .checkpoint import load_checkpoint, save_checkpoint
from .generation import generate
from .model import ModelArgs, RMSNorm, Transformer
from .tokenizer import Tokenizer

__all__ = ["ModelArgs", "RMSNorm", "Transformer", "generate", "load_checkpoint", "save_checkpoint", "Tokenizer"]
