"""Fused RMSNorm, applied from outside: use_fused_rmsnorm(model).

Meta's eager RMSNorm launches a kernel per operation (float, pow, mean, add, rsqrt, mul,
type_as, mul), each reading and writing the whole activation, and autograd replays as many
in backward: on CPU it is several times slower than torch's fused nn.LayerNorm, which turns
the RMSNorm paper's speed claim upside down. The fused norm gives RMSNorm a kernel at least as
fused as LayerNorm's, so the ablation compares like with like:

- CPU: FusedRMSNorm, whose forward is the torch operator `llama_mini::rms_norm`
  (`csrc/rms_norm_op.cpp`, with its autograd node in C++) over the kernels of
  `csrc/rms_norm.cpp`, compiled once per machine (build.py).
- CUDA: each RMSNorm is compiled (nn.Module.compile): Inductor fuses model.py's code into one
  Triton kernel each way.

The CPU forward pass is model.RMSNorm's result bit for bit: it rounds where Meta's code rounds
(x * rstd to the input dtype, then the product with the weight) and adds the squares in the
order torch's sum kernel does (CpuKernel.calibrate checks this at load time; where the order
cannot be matched the statistic may differ in its last float32 bit). The backward pass keeps
float32 throughout and rounds each gradient once, so it is at least as accurate as
autograd's op-by-op chain.
"""

import functools
import logging

import torch
from torch import nn

from ..model import RMSNorm
from . import build
from .fingerprints import changed, notice_changed
from .operators import swap_classes

# (input dtype, weight dtype) pairs the CPU kernel implements (csrc/rms_norm.h); the output
# dtype is their promotion, as in Meta's `type_as(x) * weight`. Other pairs use the reference.
CPU_DTYPES = {
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
}

log = logging.getLogger(__name__)


def model_rms_norm(x, weight, eps: float, n_rms: int):
    """model.RMSNorm on these tensors (RMSNorm's own code, through torch.func.functional_call):
    the known answer the CPU kernel is held to."""
    norm = RMSNorm(x.shape[-1], eps)
    norm.n_rms = n_rms
    return torch.func.functional_call(norm, {"weight": weight}, (x,))


# --- The module --------------------------------------------------------------------------------


class FusedRMSNorm(RMSNorm):
    """RMSNorm computed by the CPU kernel: RMSNorm's numbers, in one pass over memory.

    Tensors the kernel does not take (another device, another dtype pair) run RMSNorm's own
    code, after one notice per process, or raise with fallback=False. Under torch.compile
    RMSNorm's code is traced instead: Inductor fuses it by itself, and an opaque operator would
    break the graph.
    """

    layer, computes = "fused RMSNorm", ("model:RMSNorm.forward", "model:RMSNorm._norm")

    def __init__(self, dim: int, eps: float = 1e-6, p: float = 1.0, fallback: bool = True):
        super().__init__(dim, eps, p)
        self.fallback = fallback

    def forward(self, x):
        if torch.compiler.is_compiling():
            return super().forward(x)
        kernel, reason = kernel_for(x.device.type, x.dtype, self.weight.dtype)
        if kernel is not None:
            return kernel(x, self.weight, self.eps, self.n_rms)
        if not self.fallback:
            raise RuntimeError(f"FusedRMSNorm cannot run here: {reason}; apply use_fused_rmsnorm with fallback=True to fall back")
        notice_fallback(reason)
        return super().forward(x)


def use_fused_rmsnorm(model: nn.Module, fallback: bool = True) -> nn.Module:
    """Run model's RMSNorms fused; returns model.

    On CPU each RMSNorm becomes a FusedRMSNorm (its class is swapped: the weight, the state-dict
    names and the numbers stay), and the kernel is compiled (once per machine) or loaded now,
    so a one-time build comes before any training starts, where RMSNorm's code is the one the kernel
    was written for (fingerprints.py; edited, it stays, with one line). On CUDA each RMSNorm is
    compiled, whatever its code.
    Where neither can run, fallback=True leaves the model's own RMSNorm after one notice, and
    fallback=False raises. Apply it after the model is on its device.
    """
    norms = [m for m in model.modules() if type(m) is RMSNorm]
    if not norms:  # LayerNorm or no norm: nothing to fuse, nothing to build
        return model
    device = norms[0].weight.device.type
    if device == "cuda" and _cuda_fusable():
        for norm in norms:
            norm.compile()
        return model
    if edited := changed(FusedRMSNorm.computes):  # before the kernel's check, which holds it to the edited code
        notice_changed(FusedRMSNorm.layer, edited)
        return model
    reason = cpu_kernel()[1] if device == "cpu" else f"no fused kernel for device {device}"
    if reason is not None:
        if not fallback:
            raise RuntimeError(f"fused RMSNorm cannot run here: {reason}; apply it with fallback=True to keep the reference")
        notice_fallback(reason)
        return model
    swap_classes(model, {RMSNorm: FusedRMSNorm})
    for norm in norms:
        norm.fallback = fallback
    return model


@functools.cache
def kernel_for(device_type: str, x_dtype: torch.dtype, weight_dtype: torch.dtype):
    """(the CPU kernel for such tensors, None), or (None, why there is none)."""
    if device_type != "cpu":
        return None, f"no fused kernel for device {device_type}"
    if (x_dtype, weight_dtype) not in CPU_DTYPES:
        return None, f"no CPU kernel for {x_dtype} input with {weight_dtype} weight"
    return cpu_kernel()


@functools.cache
def notice_fallback(reason: str) -> None:
    """Say once per process (per reason) that the reference code runs instead of the kernel."""
    log.warning("llama_mini: fused RMSNorm unavailable (%s); using the reference implementation", reason)


def _cuda_fusable() -> bool:
    if not torch.cuda.is_available():
        return False
    from torch.utils._triton import has_triton

    return has_triton()


# --- Loading the CPU kernel ------------------------------------------------------------------


@functools.cache
def cpu_kernel():
    """The loaded and self-checked CPU kernel as (CpuKernel, None), or (None, why not)."""
    return build.checked(_checked_kernel)


def _checked_kernel():
    # A model built on the meta device (load_checkpoint) asks for the kernel too, and the
    # checks below need real tensors (build.checked runs this on the CPU); the first use may
    # also be inside no_grad.
    with torch.inference_mode(False), torch.enable_grad():
        kernel = CpuKernel()
        kernel.calibrate()
        _self_check(kernel)
    return kernel


class CpuKernel:
    """The loaded operator, with the summation width that reproduces torch's mean."""

    def __init__(self):
        self.op = torch.ops.llama_mini.rms_norm.default
        # Width of the vectors torch's CPU sum kernel adds with. It is not always the CPU's
        # widest (torch runs its sum with 32-byte vectors on AVX-512 machines), so
        # calibrate() measures it rather than guessing from the CPU.
        self.vector_bytes = 32
        self.bitwise_meta = False  # whether calibrate() found torch's exact summation order

    def __call__(self, x, weight, eps: float, n_rms: int):
        """RMSNorm of x (any shape and strides) with autograd, as Meta's formula computes it."""
        return self.op(x, weight, eps, n_rms, self.vector_bytes)

    def calibrate(self) -> None:
        """Pick the vector width at which the forward pass equals model.RMSNorm bit for bit,
        on rows of widely spread magnitudes where any other summation order would show."""
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16, 203, generator=g) * torch.exp2(torch.randint(-8, 8, (16, 203), generator=g).float())
        w = torch.ones(203)
        expected = model_rms_norm(x, w, 1e-5, 203)
        for self.vector_bytes in (32, 64, 16, 8, 4):
            if torch.equal(self(x, w, 1e-5, 203), expected):
                self.bitwise_meta = True
                return
        self.vector_bytes = 32  # no exact match: still within float32 rounding of Meta's
        log.debug("fused RMSNorm: no vector width reproduces torch's summation order")


def _self_check(kernel: CpuKernel) -> None:
    """Refuse a kernel that compiled but computes something else (a miscompile, an
    ABI surprise): one small forward and backward against model.RMSNorm."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=g, requires_grad=True)
    w = (torch.rand(48, generator=g) + 0.5).requires_grad_()
    dy = torch.randn(5, 48, generator=g)
    for n_rms in (48, 7):  # gradients of sum(y dy), not of y given dy: autograd then imports torch's symbolic shapes (40 MB)
        expected = model_rms_norm(x, w, 1e-5, n_rms)
        ex_dx, ex_dw = torch.autograd.grad((expected * dy).sum(), (x, w))
        got = kernel(x, w, 1e-5, n_rms)
        dx, dw = torch.autograd.grad((got * dy).sum(), (x, w))
        for a, b in ((got, expected), (dx, ex_dx), (dw, ex_dw)):
            if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                raise RuntimeError("the compiled kernel disagrees with model.RMSNorm")
