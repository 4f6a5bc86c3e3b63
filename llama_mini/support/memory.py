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


def _libc_madvise():
    """The C library's madvise, or None where there is none to call (Windows)."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return madvise


_TRIM = _glibc_trim() if sys.platform.startswith("linux") else None
_MADVISE = _libc_madvise() if sys.platform.startswith("linux") else None
MADV_DONTNEED = 4  # Linux's number


def return_freed_memory() -> None:
    """Give the heap's freed pages back to the system. Converting a file tensor by tensor frees
    a few megabytes of temporaries at a time among the tensors kept, and glibc keeps those pages
    for later allocations: without this, loading a GGUF file peaks at 1.2-1.4x what it keeps."""
    if _TRIM is not None:
        _TRIM(0)


def release_file_pages(tensor: torch.Tensor) -> None:
    """Drop the pages of a tensor read from a mapped file once a copy of it is what is used (a
    weight laid out again for the kernels): they leave this process's memory, and are read from
    the file again should the tensor be touched. Without this, a mapped checkpoint's pages stay
    resident beside the copy, and loading peaks at twice the file. Memory of the process's own
    (not a file's) is left alone: freeing the tensor frees it."""
    if _MADVISE is None or not tensor.is_cpu or tensor.numel() == 0:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    first, end = -(-start // page) * page, (start + tensor.numel() * tensor.element_size()) // page * page
    if end > first and _in_a_file_mapping(first, end):
        _MADVISE(first, end - first, MADV_DONTNEED)


def _in_a_file_mapping(first: int, end: int) -> bool:
    """Whether addresses [first, end) lie in one mapping of a file (/proc/self/maps: a path, not
    the heap, a stack or anonymous memory)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                low, high = (int(a, 16) for a in fields[0].split("-"))
                if low <= first and end <= high:
                    return len(fields) == 6 and fields[5].startswith("/")
    except (OSError, ValueError):
        pass
    return False
