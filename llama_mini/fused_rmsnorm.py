"""Fused RMSNorm: Meta's arithmetic in one pass over memory, forward and backward.

Meta's eager RMSNorm launches a kernel per operation (float, pow, mean, add, rsqrt, mul,
type_as, mul), each reading and writing the whole activation, and autograd replays as many
in backward: on CPU it is 2.6-7.8x slower than torch's fused nn.LayerNorm, which turns the
RMSNorm paper's speed claim upside down. This module gives RMSNorm a kernel at least as
fused as LayerNorm's, so the ablation compares like with like:

- CPU: `csrc/rms_norm.cpp`, compiled on first use with the system C++ compiler into
  ~/.cache/llama_mini (a few seconds, once per machine and source version) and called
  through ctypes. No ninja, torch headers or Python headers are needed.
- CUDA: Meta's formula under torch.compile; Inductor emits one Triton kernel each way.
  (Not measured: no GPU was available when this was written.)

The CPU forward pass is Meta's result bit for bit: it rounds where Meta's code rounds
(x * rstd to the input dtype, then the product with the weight) and adds the squares in the
order torch's sum kernel does (CpuKernel.calibrate checks this at load time; where the order
cannot be matched the statistic may differ in its last float32 bit). The backward pass keeps float32 throughout and rounds each
gradient once, so it is at least as accurate as autograd's op-by-op chain.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "rms_norm.cpp"
CXX_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC"]
if platform.machine().lower() in ("x86_64", "amd64"):
    CXX_FLAGS.append("-mprefer-vector-width=512")  # gcc's default 256 is ~25% slower here on AVX-512 CPUs
# (input dtype, weight dtype) pairs the CPU kernel implements; the output dtype is their
# promotion, as in Meta's `type_as(x) * weight`. Other pairs use the reference code.
CPU_DTYPES = {
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
}

log = logging.getLogger(__name__)


def rms_norm_eager(x, weight, eps: float, n_rms: int):
    """Meta's RMSNorm as one function (RMSNorm's reference path, with the partial prefix):
    what Inductor fuses on CUDA, and what the CPU kernel is checked against when loaded."""
    xf = x if x.dtype == torch.float64 else x.float()
    x_rms = xf if n_rms == x.shape[-1] else xf[..., :n_rms]
    return (xf * torch.rsqrt(x_rms.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


# --- Building and loading the CPU kernel ---------------------------------------------------


def cache_dir() -> Path:
    """Where compiled kernels live: $LLAMA_MINI_CACHE, else $XDG_CACHE_HOME/llama_mini."""
    if "LLAMA_MINI_CACHE" in os.environ:
        return Path(os.environ["LLAMA_MINI_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama_mini"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    return cxx


def _build_key(cxx: str) -> str:
    """A hash of everything the binary depends on: source, compiler, flags and this CPU
    (-march=native code must not run on another machine sharing the home directory)."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(CXX_FLAGS).encode())
    h.update(subprocess.run([cxx, "--version"], capture_output=True).stdout)
    h.update(platform.machine().encode())
    try:
        cpu_flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "Features", "model name"))]
        h.update("\n".join(sorted(set(cpu_flags))).encode())
    except OSError:
        h.update(platform.processor().encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    """Where the binary for this source, compiler and CPU is (or will be) cached."""
    return cache_dir() / f"rms_norm-{_build_key(_compiler())}.so"


def build(force: bool = False) -> Path:
    """Compile the CPU kernel unless a binary for this source, compiler and CPU is cached.

    Returns the shared library's path. The binary is written under a temporary name and
    moved into place, so concurrent processes (DDP ranks, test workers) never load a
    half-written file. Raises RuntimeError naming the problem when compilation fails.
    """
    cxx, lib = _compiler(), library_path()
    if lib.is_file() and not force:
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f".{lib.name}.tmp-{os.getpid()}")
    try:
        result = subprocess.run([cxx, *CXX_FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if "error" in line] or result.stderr.splitlines() or ["?"]
            raise RuntimeError(f"{Path(cxx).name} failed on {SOURCE.name}: {errors[0]}")
        os.replace(tmp, lib)
    finally:
        tmp.unlink(missing_ok=True)
    return lib


@functools.cache
def cpu_kernel():
    """The loaded and self-checked CPU kernel as (CpuKernel, None), or (None, why not).

    Loaded after torch, so the kernel's OpenMP calls bind to the libgomp torch already
    holds and both share one thread pool. Cached: at most one build per process.
    """
    try:
        start = time.perf_counter()
        path = build()
        kernel = CpuKernel(ctypes.CDLL(str(path)))
        with torch.inference_mode(False), torch.enable_grad():  # the first use may be inside no_grad
            kernel.calibrate()
            _self_check(kernel)
        log.debug("fused RMSNorm kernel %s ready in %.2f s", path, time.perf_counter() - start)
        return kernel, None
    except (RuntimeError, OSError, subprocess.SubprocessError, AttributeError) as e:
        return None, str(e)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


P, I64, I32, F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
# Below this many elements one thread does the work: waking the others costs more (torch's
# own GRAIN_SIZE). One decoded token per row is the common case.
PARALLEL_MIN_ELEMENTS = 32768


def _bind(lib, name: str, argtypes: list):
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, None
    return fn


class CpuKernel:
    """The compiled library, called on contiguous tensors (..., dim) seen as rows."""

    def __init__(self, lib):
        self.fwd, self.bwd = {}, {}
        for x, w in CPU_DTYPES:
            name = f"{_dtype_name(x)}_{_dtype_name(w)}"
            # the output dtype and the statistic's, looked up once rather than on every call
            types = torch.promote_types(x, w), torch.float64 if x == torch.float64 else torch.float32
            self.fwd[x, w] = _bind(lib, f"rms_norm_fwd_{name}", [P, P, P, P, I64, I64, I64, F64, I32, I32]), *types
            self.bwd[x, w] = _bind(lib, f"rms_norm_bwd_{name}", [P, P, P, P, P, P, I64, I64, I64, I32])
        # Width of the vectors torch's CPU sum kernel adds with. It is not always the CPU's
        # widest (torch runs its sum with 32-byte vectors on AVX-512 machines), so
        # calibrate() measures it rather than guessing from the CPU.
        self.vector_bytes = 32
        self.bitwise_meta = False  # whether calibrate() found torch's exact summation order

    @staticmethod
    def threads(n: int) -> int:
        return torch.get_num_threads() if n >= PARALLEL_MIN_ELEMENTS else 1

    # Python runs on every call of these two, which matters for small activations: they do
    # as little as they can around the one foreign call.
    def forward(self, x, weight, eps: float, n_rms: int):
        """Contiguous x (..., dim) -> output and per-row 1/rms (float32; float64 for float64 x)."""
        fn, out_dtype, acc = self.fwd[x.dtype, weight.dtype]
        n, dim = x.numel(), x.shape[-1]
        rows = n // dim if dim else 0
        y = torch.empty(x.shape, dtype=out_dtype)
        rstd = torch.empty(rows, dtype=acc)
        fn(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rstd.data_ptr(), rows, dim, n_rms, eps,
           self.vector_bytes // acc.itemsize, self.threads(n))
        return y, rstd

    def backward(self, dy, x, weight, rstd, n_rms: int):
        """Gradients of x and weight; dy is contiguous, with the output's shape and dtype."""
        dx = torch.empty_like(x)
        dw = torch.empty_like(weight)
        self.bwd[x.dtype, weight.dtype](dy.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
                                         dw.data_ptr(), rstd.shape[0], x.shape[-1], n_rms, self.threads(x.numel()))
        return dx, dw

    def calibrate(self) -> None:
        """Pick the vector width at which the forward pass equals Meta's code bit for bit,
        on rows of widely spread magnitudes where any other summation order would show."""
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16, 203, generator=g) * torch.exp2(torch.randint(-8, 8, (16, 203), generator=g).float())
        w = torch.ones(203)
        expected = rms_norm_eager(x, w, 1e-5, 203)
        for self.vector_bytes in (32, 64, 16, 8, 4):
            if torch.equal(self.forward(x, w, 1e-5, 203)[0], expected):
                self.bitwise_meta = True
                return
        self.vector_bytes = 32  # no exact match: still within float32 rounding of Meta's
        log.debug("fused RMSNorm: no vector width reproduces torch's summation order")


def _self_check(kernel: CpuKernel) -> None:
    """Refuse a kernel that compiled but computes something else (a miscompile, an
    ABI surprise): one small forward and backward against the eager formula."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=g, requires_grad=True)
    w = (torch.rand(48, generator=g) + 0.5).requires_grad_()
    dy = torch.randn(5, 48, generator=g)
    for n_rms in (48, 7):
        expected = rms_norm_eager(x, w, 1e-5, n_rms)
        ex_dx, ex_dw = torch.autograd.grad(expected, (x, w), dy)
        got = _RMSNormFunction.apply(x, w, 1e-5, n_rms, kernel)
        dx, dw = torch.autograd.grad(got, (x, w), dy)
        for a, b in ((got, expected), (dx, ex_dx), (dw, ex_dw)):
            if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                raise RuntimeError("the compiled kernel disagrees with the reference formula")


# --- The autograd function -----------------------------------------------------------------


class _RMSNormFunction(torch.autograd.Function):
    """x (..., dim) -> RMSNorm(x) * weight by the CPU kernel; saves x and the per-row
    1/rms (one float per row) for backward, which recomputes everything else. Outputs
    are allocated in their final shape: returning a view of a tensor made here costs
    autograd extra work on every call."""

    @staticmethod
    def forward(ctx, x, weight, eps, n_rms, kernel):
        x, weight = x.contiguous(), weight.contiguous()
        y, rstd = kernel.forward(x, weight, eps, n_rms)
        ctx.save_for_backward(x, weight, rstd)
        ctx.n_rms, ctx.kernel = n_rms, kernel
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = ctx.kernel.backward(dy.contiguous(), x, weight, rstd, ctx.n_rms)
        return dx, dw, None, None, None


# --- Choosing the implementation -------------------------------------------------------------


@functools.cache
def _compiled_eager():
    return torch.compile(rms_norm_eager, dynamic=None)


def unavailable_reason(x: torch.Tensor, weight: torch.Tensor):
    """None when rms_norm_fused can take these tensors, else why not (a short phrase)."""
    if weight.device != x.device:  # the reference code then raises torch's own error
        return f"input on {x.device} but weight on {weight.device}"
    if x.device.type == "cpu":
        if (x.dtype, weight.dtype) not in CPU_DTYPES:
            return f"no CPU kernel for {x.dtype} input with {weight.dtype} weight"
        return cpu_kernel()[1]
    if x.device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "torch.compile needs Triton on CUDA"
    return f"no fused kernel for device {x.device.type}"


def rms_norm_fused(x, weight, eps: float, n_rms: int):
    """RMSNorm of x over its last dimension, statistic from the first n_rms elements.

    Any leading shape, any strides; call unavailable_reason(x, weight) first.
    """
    if x.device.type == "cuda":
        return _compiled_eager()(x, weight, eps, n_rms)
    kernel = cpu_kernel()[0]
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFunction.apply(x, weight, eps, n_rms, kernel)
    return kernel.forward(x.contiguous(), weight.contiguous(), eps, n_rms)[0]


@functools.cache
def notice_fallback(reason: str) -> None:
    """Say once per process (per reason) that "auto" fell back to the reference code."""
    log.warning("llama_mini: fused RMSNorm unavailable (%s); using the reference implementation", reason)
