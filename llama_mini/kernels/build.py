"""Compiling and loading the CPU operators (fused RMSNorm, decoding matrix-vector products and layers).

The sources in csrc/ are compiled, once per machine, into one library with the system C++ compiler against the headers and
libraries inside torch's wheel (no ninja, no Python headers), into ~/.cache/llama_mini
($LLAMA_MINI_CACHE to move it), under a name that hashes everything the binary depends on,
and loaded into torch.ops.llama_mini once per process.
"""

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from ..files import atomic_write

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("rms_norm.cpp", "rms_norm_op.cpp", "matvec.cpp", "attention.cpp", "matvec_op.cpp", "block_op.cpp")]
HEADERS = [CSRC / name for name in ("rms_norm.h", "matvec.h", "simd.h", "ops.h")]
LIBRARY = "cpu_kernels"
CXX_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c++20", "-shared", "-fPIC"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # gcc's default of 256-bit vectors leaves half of an AVX-512 register idle in these loops.
    CXX_FLAGS.append("-mprefer-vector-width=512")
BUILD_NOTICE = "llama_mini: compiling the CPU kernels, once per machine (up to a minute)"


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


def _torch_flags() -> list:
    """Compile against the headers and libraries in torch's own wheel, with its C++ ABI.

    torch.utils.cpp_extension (and setuptools with it) is imported here, when compiling,
    and only then; what its import may print (a CUDA_HOME notice on machines without CUDA,
    deprecation warnings) is not for the user.
    """
    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    disabled, cpp_logger.disabled = cpp_logger.disabled, True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.utils import cpp_extension
    finally:
        cpp_logger.disabled = disabled
    lib_dirs = cpp_extension.library_paths()
    return [
        *(f"-I{d}" for d in cpp_extension.include_paths()),
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-L{d}" for d in lib_dirs),
        *(f"-Wl,-rpath,{d}" for d in lib_dirs),
        "-lc10",
        "-ltorch_cpu",
    ]


def _build_key(cxx: str) -> str:
    """A hash of everything the binary depends on: sources, compiler, flags, the torch it
    links (version, place, C++ ABI) and this CPU (-march=native code must not run on another
    machine sharing the home directory)."""
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.read_bytes())
    h.update(" ".join(CXX_FLAGS).encode())
    h.update(f"{torch.__version__} {Path(torch.__file__).parent} {torch._C._GLIBCXX_USE_CXX11_ABI}".encode())
    h.update(subprocess.run([cxx, "--version"], capture_output=True).stdout)
    h.update(platform.machine().encode())
    try:
        cpu_flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "Features", "model name"))]
        h.update("\n".join(sorted(set(cpu_flags))).encode())
    except OSError:
        h.update(platform.processor().encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    """Where the binary for these sources, compiler, torch and CPU is (or will be) cached."""
    return cache_dir() / f"{LIBRARY}-{_build_key(_compiler())}.so"


@functools.cache
def load() -> None:
    """Build (once per machine) and load (once per process) the operators into torch.ops.llama_mini.

    Loaded after torch, so the kernels' OpenMP calls bind to the libgomp torch already holds
    and all share one thread pool. An operator's name can be registered with torch only once,
    hence once per process; a failure raises and is not remembered.
    """
    torch.ops.load_library(str(build()))


def build(force: bool = False) -> Path:
    """Compile the CPU operators unless a binary for these sources, compiler, torch and CPU
    is cached; return the shared library's path.

    Says so on one line of stderr before compiling; loading from the cache is silent. The
    binary is written through atomic_write, so concurrent processes (DDP ranks, test
    workers) never load a half-written file. Raises RuntimeError naming the problem when
    compilation fails.
    """
    cxx, lib = _compiler(), library_path()
    if lib.is_file() and not force:
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    _remove_killed_builds(lib.parent)
    print(BUILD_NOTICE, file=sys.stderr, flush=True)
    atomic_write(lib, lambda tmp: _compile(cxx, tmp))
    return lib


def _compile(cxx: str, out: Path) -> None:
    command = [cxx, *CXX_FLAGS, *map(str, SOURCES), "-o", str(out), *_torch_flags()]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "error" in line] or result.stderr.splitlines() or ["?"]
        raise RuntimeError(f"{Path(cxx).name} failed on {', '.join(p.name for p in SOURCES)}: {errors[0]}")


def _remove_killed_builds(folder: Path) -> None:
    """Delete the temporary binaries (.<name>.tmp-<pid>, atomic_write's names) of builds
    whose process is gone: a killed build cannot clean up after itself."""
    if os.name != "posix":
        return
    for tmp in folder.glob(f".{LIBRARY}-*.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) > 0 and not _process_alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
