"""What a model, a training run or a KV cache will take in memory, checked before it is allocated.

torch asked for more memory than the machine has fails after the work before it (a tokenizer
trained, gigabytes touched) with an allocator's traceback, or not at all until the system kills
the process. Here the bytes are counted from the shape alone, in Python integers (no size
overflows), and set against what the device has free now: over it is one line naming both.
The counts are lower bounds (the largest allocations, not every temporary), so a run refused
would not have fitted.
"""

import ctypes
import os
import sys
from typing import Optional

import torch

from ..model import ModelArgs

GiB = 2**30


def training_bytes(args: ModelArgs, batch_size: int, seq_len: int) -> int:
    """A training step's floor in float32: weights, gradients and AdamW's two moments (16 bytes
    a parameter), each block's input and the logits of one micro-batch (the logits twice: their
    values and their gradient)."""
    tokens = batch_size * seq_len
    return 16 * args.n_parameters + 4 * tokens * (args.n_layers * args.dim + 2 * args.vocab_size)


def kv_cache_bytes(args: ModelArgs, batch_size: int, max_seq_len: int, dtype: torch.dtype) -> int:
    """The keys and values of every layer for batch_size sequences of max_seq_len positions."""
    return 2 * args.n_layers * batch_size * max_seq_len * args.n_kv_heads * args.head_dim * dtype.itemsize


def free_bytes(device: torch.device) -> Optional[int]:
    """Memory the device can give now: a GPU's free memory, MPS's working set less what it
    holds, the CPU's available memory (Linux's MemAvailable, else all of it); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "mps":
        return torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration, ValueError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_free_memory(needed: int, what: str, device: torch.device, fix: str) -> None:
    """Refuse, in one line naming both figures and fix, what needs more than device has free."""
    free = free_bytes(device)
    if free is not None and needed > free:
        raise ValueError(f"{what} needs at least {shown(needed)}, and {device.type} has {shown(free)} free; {fix}")


def shown(n: int) -> str:
    """Bytes as a user reads them: 3.2 GiB, 17 TiB, 2**70 bytes."""
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}" if n < 1024 * 2**50 else f"2**{n.bit_length() - 1} bytes"
    return f"{n} bytes"


def _glibc_trim():
    """glibc's malloc_trim, or None where the C library is another (macOS, musl, Windows)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _glibc_trim() if sys.platform.startswith("linux") else None


def return_freed_memory() -> None:
    """Give the heap's freed pages back to the system. Converting a file tensor by tensor frees
    a few megabytes of temporaries at a time among the tensors kept, and glibc keeps those pages
    for later allocations: without this, loading a GGUF file peaks at 1.2-1.4x what it keeps."""
    if _TRIM is not None:
        _TRIM(0)
