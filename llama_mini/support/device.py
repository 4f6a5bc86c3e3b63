"""Where and in what to compute: the device (CUDA, then Apple's MPS, then the CPU, unless one
is named), the dtypes the command lines offer, what bfloat16 costs on this CPU, and the timer
that measures such costs."""

import functools
import time
from typing import Callable, Optional

import torch

# The device types the package runs on. torch knows more names (meta, xla, ...), but a
# model there either holds no data (meta) or needs a backend this package does not set up.
DEVICE_TYPES = ("cpu", "cuda", "mps")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # --dtype's names


def default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def pick_device(name: Optional[str] = None, local_rank: int = 0) -> torch.device:
    """The device called name (default: the best available), checked to exist here.
    A bare "cuda" under torchrun means this process's own GPU, cuda:local_rank."""
    try:
        device = torch.device(name or default_device())
    except RuntimeError:
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise ValueError(f"unknown device {name!r}; use cpu, cuda, cuda:N or mps")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but no CUDA GPU is available; use --device cpu")
        return torch.device("cuda", local_rank if device.index is None else device.index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps was asked for but MPS is not available; use --device cpu")
    return device


def fastest_time(step: Callable[[], object], device: torch.device, runs: int = 3) -> float:
    """The shortest of runs timings of step() on device, in seconds, after one run untimed (the
    first pays for allocations and caches); on a GPU each waits for the device to finish."""

    def finished():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()
    times = []
    for _ in range(runs):
        finished()
        start = time.perf_counter()
        step()
        finished()
        times.append(time.perf_counter() - start)
    return min(times)


@functools.cache
def bfloat16_slowdown() -> float:
    """How many times longer torch takes to multiply bfloat16 matrices than float32 ones on this
    CPU, measured (a few milliseconds, once per process): about 1 on CPUs with AVX-512 BF16 or
    AMX, which multiply bf16 natively, and ten or more on others, where torch converts
    element by element."""
    cpu = torch.device("cpu")
    a, b = torch.randn(256, 512), torch.randn(512, 512)
    bf16_a, bf16_b = a.bfloat16(), b.bfloat16()
    return fastest_time(lambda: bf16_a @ bf16_b, cpu) / fastest_time(lambda: a @ b, cpu)


def bfloat16_notice(device: torch.device, dtype: torch.dtype, flag: str) -> Optional[str]:
    """One line for computing in dtype on device where that is bfloat16 on a CPU whose torch
    multiplies bf16 matrices several times slower than float32 ones: what it costs and what to
    use instead; None where it costs nothing."""
    if dtype != torch.bfloat16 or device.type != "cpu" or (slowdown := bfloat16_slowdown()) < 2:
        return None
    return (f"note: on this CPU torch multiplies bfloat16 matrices {slowdown:.0f}x slower than float32 ones "
            f"(it has no AVX-512 BF16 or AMX); {flag} float32 runs faster here")
