"""The kernel cache through generate.py: a binary is trusted only once it has loaded, a damaged
one is rebuilt once with one notice, and a failed build is tried once per machine.

A stand-in compiler "compiles" by copying a binary (the real build of these sources, or a
truncated copy of it) and logs each call, so a rebuild costs no minute and can be counted.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llama_mini import ModelArgs, Transformer, save_checkpoint
from llama_mini.kernels import build, fused_rmsnorm
from llama_mini.tokenizers.spm import train_sentencepiece

ROOT = Path(__file__).resolve().parents[2]
TEXT = "Tom had a red ball. He gave it to Sue, and she was glad. 'Thank you,' said Sue. " * 40


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    tok = train_sentencepiece(TEXT.split(". "), vocab_size=300, model_path=root / "tok.model")
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=tok.n_words, max_seq_len=64))
    return save_checkpoint(model, root / "native", tokenizer_path=tok.model_path)


@pytest.fixture(scope="module")
def binary() -> bytes:
    """The real build of the kernels, from the cache the other tests use."""
    if fused_rmsnorm.cpu_kernel()[0] is None:
        pytest.skip(f"the kernels do not build here: {fused_rmsnorm.cpu_kernel()[1]}")
    return build.library_path().read_bytes()


def compiler(folder: Path, output: bytes) -> Path:
    """A compiler whose every build writes output to the -o file, and says so in folder/calls."""
    (folder / "output.so").write_bytes(output)
    script = folder / "c++"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "stand-in c++ 1.0"; exit 0; fi\n'
        f'echo build >> "{folder / "calls"}"\n'
        'while [ $# -gt 0 ]; do if [ "$1" = -o ]; then cp "' + str(folder / "output.so") + '" "$2"; fi; shift; done\n'
    )
    script.chmod(0o755)
    return script


def generate(ckpt, cache: Path, cxx) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLAMA_MINI_CACHE": str(cache), "CXX": str(cxx), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), "--ckpt", str(ckpt), "--prompt", "Tom",
                           "--max-new-tokens", "4", "--temperature", "0"], capture_output=True, text=True, env=env, timeout=300)


def library_path(cache: Path, cxx) -> Path:
    """Where the kernels built by cxx are cached: their name hashes the compiler's --version."""
    code = "from llama_mini.kernels import build; print(build.library_path())"
    env = {**os.environ, "LLAMA_MINI_CACHE": str(cache), "CXX": str(cxx)}
    return Path(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT).stdout.strip())


def calls(folder: Path) -> int:
    return len((folder / "calls").read_text().splitlines()) if (folder / "calls").exists() else 0


def kernel_lines(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("llama_mini:")]


@pytest.mark.slow  # generate.py runs in a child process, building the kernels
def test_a_truncated_cached_kernel_is_rebuilt_once_with_one_notice(ckpt, binary, tmp_path):
    """Loading a short ELF faults (SIGBUS): it is loaded in a child process, never in the run."""
    cxx = compiler(tmp_path, binary)
    lib = library_path(tmp_path / "cache", cxx)
    lib.parent.mkdir()
    lib.write_bytes(binary[:100_000])
    first = generate(ckpt, tmp_path / "cache", cxx)
    assert first.returncode == 0, first.stderr
    assert kernel_lines(first.stderr) == [build.REBUILD_NOTICE.format(lib)]
    assert calls(tmp_path) == 1 and lib.read_bytes() == binary
    again = generate(ckpt, tmp_path / "cache", cxx)
    assert again.returncode == 0 and kernel_lines(again.stderr) == [] and calls(tmp_path) == 1, again.stderr


@pytest.mark.slow  # generate.py runs in a child process, building the kernels
def test_a_build_that_does_not_load_is_not_tried_again(ckpt, binary, tmp_path):
    cxx = compiler(tmp_path, binary[:100_000])
    first = generate(ckpt, tmp_path / "cache", cxx)
    assert first.returncode == 0 and "Traceback" not in first.stderr, first.stderr
    lines = kernel_lines(first.stderr)
    assert lines[0] == build.BUILD_NOTICE and len(lines) == 3, first.stderr  # and one notice per kernel
    assert all("the CPU kernels c++ built do not load" in line for line in lines[1:])
    again = generate(ckpt, tmp_path / "cache", cxx)
    assert again.returncode == 0 and calls(tmp_path) == 1, again.stderr
    assert all("remembered from an earlier build" in line for line in kernel_lines(again.stderr))


@pytest.mark.slow  # generate.py runs in a child process, building the kernels
def test_a_failing_compiler_is_tried_once_per_machine_and_its_failure_is_shown(ckpt, tmp_path):
    first = generate(ckpt, tmp_path / "cache", "/bin/false")
    assert first.returncode == 0 and "Traceback" not in first.stderr, first.stderr
    lines = kernel_lines(first.stderr)
    assert lines.count(build.BUILD_NOTICE) == 1 and len(lines) == 3, first.stderr
    assert all("false failed on rms_norm.cpp" in line and "it exited with code 1 and printed nothing" in line for line in lines[1:])
    again = generate(ckpt, tmp_path / "cache", "/bin/false")
    assert again.returncode == 0 and build.BUILD_NOTICE not in again.stderr, again.stderr
    record = library_path(tmp_path / "cache", "/bin/false").with_suffix(".json")
    assert all(f"remembered from an earlier build: delete {record} to try again" in line for line in kernel_lines(again.stderr))


@pytest.mark.slow  # generate.py runs in a child process, building the kernels
def test_another_compiler_is_tried_after_a_failed_one(ckpt, binary, tmp_path):
    assert generate(ckpt, tmp_path / "cache", "/bin/false").returncode == 0
    working = generate(ckpt, tmp_path / "cache", compiler(tmp_path, binary))
    assert working.returncode == 0 and kernel_lines(working.stderr) == [build.BUILD_NOTICE], working.stderr


@pytest.mark.slow  # generate.py runs in a child process, building the kernels
def test_a_compiler_killed_by_a_signal_is_tried_again_by_the_next_run(ckpt, tmp_path):
    """Out of memory, say: not the build's fault, so the next run builds again."""
    cxx = tmp_path / "killed-c++"
    cxx.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "stand-in c++ 1.0"; exit 0; fi\n'
                   f'echo build >> "{tmp_path / "calls"}"\nkill -9 $$\n')
    cxx.chmod(0o755)
    for run in (1, 2):
        result = generate(ckpt, tmp_path / "cache", cxx)
        assert result.returncode == 0 and calls(tmp_path) == run, result.stderr
        assert all("killed-c++ was killed by SIGKILL while compiling" in line for line in kernel_lines(result.stderr)[1:])


@pytest.mark.slow  # generate.py runs in a child process, building the kernels
def test_another_valid_library_at_the_cached_name_is_never_loaded_and_is_rebuilt(ckpt, binary, tmp_path):
    """A shared library that loads but is not the one recorded (here, one without our operators):
    its record does not match, so it is rebuilt before anything loads it."""
    cxx = compiler(tmp_path, binary)
    lib = library_path(tmp_path / "cache", cxx)
    lib.parent.mkdir()
    foreign = tmp_path / "foreign.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-x", "c", "-", "-o", str(foreign)], input="int f(void) { return 1; }\n",
                   text=True, check=True)
    lib.write_bytes(foreign.read_bytes())
    first = generate(ckpt, tmp_path / "cache", cxx)
    assert first.returncode == 0 and "Traceback" not in first.stderr, first.stderr
    assert kernel_lines(first.stderr) == [build.REBUILD_NOTICE.format(lib)] and calls(tmp_path) == 1
    assert lib.read_bytes() == binary


def test_a_library_without_our_operators_is_not_trusted_even_once_it_loads(tmp_path):
    foreign = tmp_path / "foreign.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-x", "c", "-", "-o", str(foreign)], input="int f(void) { return 1; }\n",
                   text=True, check=True)
    assert "has no attribute 'rms_norm'" in build._load_in_child(foreign)


def hanging_compiler(folder: Path, on_version: bool) -> Path:
    script = folder / "hanging-c++"
    version = "sleep 60" if on_version else 'echo "stand-in c++ 1.0"; exit 0'
    script.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then {version}; fi\necho build >> "{folder / "calls"}"\nsleep 60\n')
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("on_version", [True, False])
def test_a_compiler_that_hangs_times_out_and_is_not_waited_for_again(tmp_path, monkeypatch, on_version):
    """Hanging on --version or in the build: the call times out, the run goes on without the
    kernels, and the next run fails at once from the record instead of waiting again."""
    monkeypatch.setenv("LLAMA_MINI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(hanging_compiler(tmp_path, on_version)))
    monkeypatch.setattr(build, "VERSION_TIMEOUT", 1)
    monkeypatch.setattr(build, "COMPILE_TIMEOUT", 1)
    with pytest.raises(RuntimeError) as first:
        build.build()
    assert ("--version did not answer in 1 s" if on_version else "did not finish compiling the CPU kernels in 1 s") in str(first.value)
    with pytest.raises(RuntimeError) as again:
        build.build()
    assert "remembered from an earlier" in str(again.value) and calls(tmp_path) == (0 if on_version else 1)


@pytest.mark.parametrize("variable", ["LLAMA_MINI_CACHE", "XDG_CACHE_HOME"])
def test_an_empty_cache_variable_means_the_default_cache_not_the_current_folder(monkeypatch, variable):
    monkeypatch.delenv("LLAMA_MINI_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    default = build.cache_dir()
    monkeypatch.setenv(variable, "")
    assert build.cache_dir() == default == Path.home() / ".cache" / "llama_mini"
