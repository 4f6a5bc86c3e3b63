"""Where and in what to compute: the device (CUDA, then Apple's MPS, then the CPU, unless one
is named) and the dtypes the command lines offer."""

from typing import Optional

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
