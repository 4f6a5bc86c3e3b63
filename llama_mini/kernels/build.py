"""Compiling and loading the CPU operators (fused RMSNorm, decoding matrix-vector products and layers).

The sources in csrc/ are compiled, once per machine, into one library with the system C++ compiler against the headers and
libraries inside torch's wheel (no ninja, no Python headers), into ~/.cache/llama_mini
($LLAMA_MINI_CACHE to move it), under a name that hashes everything the binary depends on,
and loaded into torch.ops.llama_mini once per process.

A binary is trusted only once it has loaded: a new build is loaded in a child process first
(loading a damaged library can kill the process that loads it, with no error to catch), and
only then are its size and hash written beside it, in <name>.json. A binary that does not
match its record is never loaded: it is rebuilt, with one notice. A failed build is written
in the record too: it is not tried again on this machine until the compiler, torch or the
sources change (a new name), or the record is deleted. Every compiler call runs under a
timeout, and one that passes it is a failed build (a compiler that hangs on --version is
remembered by its path, size and time). A compiler killed by a signal (out of memory, say)
is tried again by the next process.
"""

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from ..support.files import atomic_write

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("rms_norm.cpp", "rms_norm_op.cpp", "linear.cpp", "linear_op.cpp", "attention.cpp",
                                     "attention_op.cpp", "swiglu.cpp", "swiglu_op.cpp", "rope.cpp", "rope_op.cpp", "block_op.cpp",
                                     "subnormals_op.cpp", "gguf_blocks_op.cpp", "activations.cpp", "k_quants.cpp")]
HEADERS = [CSRC / name for name in ("bf16.h", "rms_norm.h", "kernels.h", "simd.h", "ops.h")]
LIBRARY = "cpu_kernels"
CXX_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-std=c++20", "-shared", "-fPIC"]

# The instruction sets the kernels can be built for ($LLAMA_MINI_ISA; default native, this CPU's
# own): each x86-64 variant, with the CPU flags (/proc/cpuinfo's names) it needs to run. The
# kernels have three code paths (csrc/simd.h): AVX-512 with VNNI (and BF16's dot products where
# present), AVX2 with FMA, and none (x86-64: the norm alone, the layers on torch's code). A
# machine with AVX-512 builds and tests every variant below its own.
AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni")
X86_64_V3 = ("avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm")
ISAS = {
    "avx512-bf16": (["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"], AVX512 + ("avx512_bf16",)),
    "avx512": (["-march=x86-64-v4", "-mavx512vnni"], AVX512),
    "avx2": (["-march=x86-64-v3"], X86_64_V3),
    "x86-64": (["-march=x86-64"], ()),
}
BUILD_NOTICE = "llama_mini: compiling the CPU kernels, once per machine (a minute or two)"
REBUILD_NOTICE = "llama_mini: the cached CPU kernels {} are not the ones built there; compiling them again (a minute or two)"
# Seconds a compiler call may take: --version answers at once; the build takes 70 s on 2 cores.
VERSION_TIMEOUT, COMPILE_TIMEOUT = 30, 600
# The operators a build registers: a library without them is not ours.
OPERATORS = ("rms_norm", "linear_dense", "block")


def isa() -> str:
    """The instruction set the kernels are built for: $LLAMA_MINI_ISA, else native."""
    name = os.environ.get("LLAMA_MINI_ISA") or "native"
    if name != "native" and name not in ISAS:
        raise RuntimeError(f"LLAMA_MINI_ISA={name} is not one of native, {', '.join(ISAS)}")
    return name


def isa_flags(name: str) -> list:
    """The compiler's flags for instruction set `name`."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if name == "native":
        # gcc's default of 256-bit vectors leaves half of an AVX-512 register idle in these loops.
        return ["-march=native", "-mprefer-vector-width=512"] if x86 else ["-march=native"]
    if not x86:
        raise RuntimeError(f"LLAMA_MINI_ISA={name} is an x86-64 instruction set; this CPU is {platform.machine()}")
    flags, needs = ISAS[name]
    return flags + ["-mprefer-vector-width=512"] if "avx512f" in needs else flags


def runnable_isas() -> list:
    """The instruction sets of ISAS this CPU executes (none but native off x86-64)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return []
    return [name for name, (_, needs) in ISAS.items() if flags.issuperset(needs)]


def cache_dir() -> Path:
    """Where compiled kernels live: $LLAMA_MINI_CACHE, else $XDG_CACHE_HOME/llama_mini."""
    if os.environ.get("LLAMA_MINI_CACHE"):  # set and not empty: an empty one is not the current folder
        return Path(os.environ["LLAMA_MINI_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama_mini"


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
    h.update(" ".join(CXX_FLAGS + isa_flags(isa())).encode())
    h.update(f"{torch.__version__} {Path(torch.__file__).parent} {torch._C._GLIBCXX_USE_CXX11_ABI}".encode())
    h.update(_compiler_version(cxx))
    h.update(platform.machine().encode())
    try:
        cpu_flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "Features", "model name"))]
        h.update("\n".join(sorted(set(cpu_flags))).encode())
    except OSError:
        h.update(platform.processor().encode())
    return h.hexdigest()[:16]


def _compiler_version(cxx: str) -> bytes:
    """`cxx --version`, under a timeout; a compiler that passed it is remembered, by its path, size
    and time, so that no later run waits for it again until it changes."""
    try:
        stat = os.stat(shutil.which(cxx) or cxx)
        identity = f"{cxx} {stat.st_size} {stat.st_mtime_ns}"
    except OSError:
        identity = cxx
    record = cache_dir() / f"{LIBRARY}-compiler-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.json"
    if record.is_file():
        raise RuntimeError(f"{Path(cxx).name} --version did not answer in {VERSION_TIMEOUT} s; remembered from an "
                           f"earlier run: delete {record} to try again")
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, timeout=VERSION_TIMEOUT).stdout
    except subprocess.TimeoutExpired:
        record.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(record, lambda tmp: tmp.write_text(json.dumps({"failed": "--version timed out", "compiler": identity}) + "\n"))
        raise RuntimeError(f"{Path(cxx).name} --version did not answer in {VERSION_TIMEOUT} s; torch's code runs instead") from None


def library_path() -> Path:
    """Where the binary for these sources, compiler, torch and CPU is (or will be) cached."""
    return cache_dir() / f"{LIBRARY}-{_build_key(_compiler())}.so"


def load() -> None:
    """Build (once per machine) and load (once per process) the operators into torch.ops.llama_mini.

    Loaded after torch, so the kernels' OpenMP calls bind to the libgomp torch already holds
    and all share one thread pool. An operator's name can be registered with torch only once,
    hence once per process; a failure raises RuntimeError and is remembered for the process,
    so a build is tried once however many kernels ask for it.
    """
    reason = _load_once()
    if reason is not None:
        raise RuntimeError(reason)


def checked(make):
    """(make(), None) with the operators loaded, on the CPU, make's self-check passed; else (None,
    the first line of why not). How each kernel layer loads its operators (once: it caches this)."""
    try:
        with torch.device("cpu"):
            load()
            return make(), None
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return None, (str(e).splitlines() or [type(e).__name__])[0]


@functools.cache
def _load_once():
    """None once the library is loaded, else the first line of why not."""
    try:
        torch.ops.load_library(str(build()))
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return (str(e).splitlines() or [type(e).__name__])[0]
    return None


def build(force: bool = False) -> Path:
    """Compile the CPU operators unless a binary for these sources, compiler, torch and CPU
    is cached and loads; return the shared library's path.

    Says so on one line of stderr before compiling; loading from the cache is silent. One
    process builds while the others wait for it (a lock beside the binary), and the binary
    is written through atomic_write, so no process loads a half-written file. Raises
    RuntimeError naming the problem when compilation fails, now or in an earlier try on this
    machine (force=True compiles regardless).
    """
    cxx, lib = _compiler(), library_path()
    if not force and _trusted(lib):
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with _locked(lib.with_suffix(".lock")):
        if not force and _trusted(lib):  # built by another process while this one waited
            return lib
        record = _read_record(lib)
        if not force and record.get("failed") and record.get("compiler") == cxx:
            raise RuntimeError(f"{record['failed']}; remembered from an earlier build: delete {_record_path(lib)} to try again")
        # A file there that is not the one recorded (damaged, replaced, an older build) is never loaded.
        notice = REBUILD_NOTICE.format(lib) if not force and lib.is_file() else BUILD_NOTICE
        print(notice, file=sys.stderr, flush=True)
        _remove_killed_builds(lib.parent)
        try:
            atomic_write(lib, lambda tmp: _compile(cxx, tmp))
        except RuntimeError as e:
            _write_record(lib, {"failed": (str(e).splitlines() or ["?"])[0], "compiler": cxx})
            raise
        _write_record(lib, _built_record(lib))
    return lib


def _compile(cxx: str, out: Path) -> None:
    """Compile the sources into out, and load it in a child process: the binary is trusted only then."""
    command = [cxx, *CXX_FLAGS, *isa_flags(isa()), *map(str, SOURCES), "-o", str(out), *_torch_flags()]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{Path(cxx).name} did not finish compiling the CPU kernels in {COMPILE_TIMEOUT} s") from None
    if result.returncode < 0:  # killed (out of memory, say): not the build's fault, so not remembered
        raise subprocess.SubprocessError(f"{Path(cxx).name} {_exit_status(result.returncode)} while compiling the CPU kernels")
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if "error" in line] or result.stderr.splitlines()
        why = lines[0] if lines else f"it {_exit_status(result.returncode)} and printed nothing"
        raise RuntimeError(f"{Path(cxx).name} failed on {', '.join(p.name for p in SOURCES)}: {why}")
    reason = _load_in_child(out)
    if reason is not None:
        raise RuntimeError(f"the CPU kernels {Path(cxx).name} built do not load: {reason}")


def _load_in_child(lib: Path):
    """None if lib loads into torch in a new process and registers our operators, else why not
    (a damaged library can kill the process that loads it: this one must not be that process)."""
    code = ("import sys, torch; torch.ops.load_library(sys.argv[1]); "
            f"[getattr(torch.ops.llama_mini, name) for name in {OPERATORS!r}]")
    try:
        result = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"loading it did not finish in {COMPILE_TIMEOUT} s"
    if result.returncode == 0:
        return None
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else f"loading it {_exit_status(result.returncode)}"


def _exit_status(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _record_path(lib: Path) -> Path:
    return lib.with_suffix(".json")


def _built_record(lib: Path) -> dict:
    return {"size": lib.stat().st_size, "sha256": hashlib.sha256(lib.read_bytes()).hexdigest()}


def _read_record(lib: Path) -> dict:
    """What the last build of lib left beside it: its size and hash, or why it failed ({} if nothing)."""
    try:
        record = json.loads(_record_path(lib).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(lib: Path, record: dict) -> None:
    atomic_write(_record_path(lib), lambda tmp: tmp.write_text(json.dumps(record) + "\n"))


def _trusted(lib: Path) -> bool:
    """Whether lib is the very file a build loaded and recorded (a hash of half a megabyte)."""
    record = _read_record(lib)
    try:
        return "sha256" in record and record == _built_record(lib)
    except OSError:
        return False


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on path: one process builds, the others wait, then find its binary.
    The kernel drops the lock when its holder exits, however it exits."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


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
