"""The package's shape: a core that stands alone, layers that reach it from outside, no cycles;
and what runs where: a training step and a decoding step each run the few files they name."""

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import llama_mini
from llama_mini.run import corpus

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llama_mini"
CORE = ("model.py", "generation.py", "trainer.py")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set:
    """The llama_mini modules path imports, at the top or inside a function (absolute names)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            stem = f"{base}.{node.module}" if node.level and node.module else base if node.level else node.module
            names.add(stem)
            names |= {f"{stem}.{alias.name}" for alias in node.names}  # from . import corpus: a module
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    return {n for n in names if n in modules and n != module_name(path)}


def test_model_py_imports_torch_and_the_standard_library_only():
    tree = ast.parse((PACKAGE / "model.py").read_text())
    roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree)), "model.py imports llama_mini"
    assert roots - set(sys.stdlib_module_names) == {"torch"}


def test_no_module_of_the_package_imports_another_in_a_cycle():
    # A package's __init__ runs before its modules, so importing llama_mini.x.y imports llama_mini.x
    # too: an edge to each package above the module imported, except those above the importer (its
    # own packages are already being imported when it runs).
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        imported = {".".join(m.split(".")[:i]) for m in imported_modules(path) for i in range(2, m.count(".") + 2)}
        graph[name] = {m for m in imported if m != name and not name.startswith(m + ".")}
    state = {}

    def visit(name, path):
        state[name] = "open"
        for dep in sorted(graph[name]):
            assert state.get(dep) != "open", f"import cycle: {' -> '.join(path[path.index(dep):] + [dep])}"
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_core_imports_only_the_core_and_torch():
    core = {module_name(PACKAGE / name) for name in CORE}
    for name in CORE:
        tree = ast.parse((PACKAGE / name).read_text())
        roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
        assert roots - set(sys.stdlib_module_names) <= {"torch"}, name
        assert imported_modules(PACKAGE / name) <= core, f"{name} imports {sorted(imported_modules(PACKAGE / name) - core)}"


@pytest.mark.parametrize("module, loaded", [
    ("llama_mini.trainer", ["llama_mini", "llama_mini.model", "llama_mini.trainer"]),
    ("llama_mini.generation", ["llama_mini", "llama_mini.generation", "llama_mini.model"]),
])
def test_importing_a_core_module_loads_the_core_it_needs_and_nothing_else(module, loaded):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('llama_mini')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(loaded)]


# Runs in a child process, with the repository's root as its first argument: files_run(call)
# calls call() and returns the repository files whose Python code ran meanwhile, in any thread.
FILES_RUN = """
import json, sys, threading
from pathlib import Path

ROOT = Path(sys.argv[1])

def files_run(call):
    seen = set()
    def record(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if event == "call" and ROOT in path.parents:
            seen.add(path.relative_to(ROOT).as_posix())
    threading.setprofile(record)
    sys.setprofile(record)
    try:
        call()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(seen)
"""


def files_run_in_a_child(code: str, *args) -> dict:
    """The JSON that FILES_RUN + code prints, run in a fresh process (nothing loaded or warmed up yet)."""
    result = subprocess.run([sys.executable, "-c", FILES_RUN + code, str(ROOT), *map(str, args)], capture_output=True,
                            text=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_a_training_step_runs_the_trainer_the_model_the_fused_layers_and_the_data_only(tmp_path):
    """The first and the second optimizer step of a real run, set up as train.py sets it up
    (the fused RMSNorm, SwiGLU and RoPE where the kernels build, one process), run Python code in
    six files at most."""
    (tmp_path / "text.txt").write_text("\n\n".join(corpus.stories(30_000, seed=5)), encoding="utf-8")
    code = (
        "from llama_mini.run.config import TrainConfig\n"
        "from llama_mini.run.start import start_run\n"
        "tmp = Path(sys.argv[2])\n"
        "run = start_run(TrainConfig(data=str(tmp / 'text.txt'), cache_dir=str(tmp / 'cache'), out=str(tmp / 'run'),\n"
        "                            device='cpu', dim=32, n_layers=1, n_heads=2, vocab_size=400, seq_len=16, batch_size=2))\n"
        "steps = [files_run(run.trainer.train_step) for _ in range(2)]\n"
        "print(json.dumps({'norm': type(run.raw_model.norm).__name__,\n"
        "                  'feed_forward': type(run.raw_model.layers[0].feed_forward).__name__,\n"
        "                  'attention': type(run.raw_model.layers[0].attention).__name__, 'steps': steps}))\n"
    )
    found = files_run_in_a_child(code, tmp_path)
    expected = {"llama_mini/trainer.py", "llama_mini/model.py", "llama_mini/run/data.py"}
    if found["norm"] == "FusedRMSNorm":  # where the kernel builds, as train.py applies it
        expected.add("llama_mini/kernels/fused_rmsnorm.py")
    if found["feed_forward"] == "FusedFeedForward":
        expected.add("llama_mini/kernels/fused_swiglu.py")
    if found["attention"] == "FusedAttention":
        expected.add("llama_mini/kernels/fused_rope.py")
    for step in found["steps"]:
        assert set(step) == expected


def test_a_decoding_step_runs_generation_and_the_model_only_and_the_kernels_where_applied():
    code = (
        "import torch\n"
        "from llama_mini.generation import generate_stream\n"
        "from llama_mini.model import ModelArgs, Transformer\n"
        "model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32,\n"
        "                              max_seq_len=64)).eval()\n"
        "def decoding_step():\n"
        "    steps = generate_stream(model, [[1, 2, 3]], 4, seed=0)\n"
        "    next(steps)  # the prompt, read into the KV cache\n"
        "    files = files_run(lambda: next(steps))\n"
        "    steps.close()\n"
        "    return files\n"
        "found = {'plain': decoding_step()}\n"
        "from llama_mini.kernels import use_cpu_kernels\n"
        "from llama_mini.kernels.operators import operators\n"
        "if operators() is not None:\n"
        "    use_cpu_kernels(model)\n"
        "    found['kernels'] = decoding_step()\n"
        "print(json.dumps(found))\n"
    )
    found = files_run_in_a_child(code)
    assert found["plain"] == ["llama_mini/generation.py", "llama_mini/model.py"]
    if "kernels" in found:  # where the kernels build (x86-64 with AVX2 and FMA)
        assert found["kernels"] == ["llama_mini/generation.py", "llama_mini/kernels/block.py", "llama_mini/kernels/linear.py",
                                    "llama_mini/model.py"]


def test_a_model_is_built_and_trained_with_model_py_alone_loading_and_compiling_nothing(tmp_path):
    """With an empty kernel cache and a compiler that fails: import llama_mini.model, build a
    Transformer (on the meta device too, as loaders do), forward and backward. Only model.py is
    loaded, no tokenizer or file-format library is imported, nothing is compiled or loaded."""
    code = (
        "import subprocess, sys, torch\n"
        "subprocess.Popen = None  # a compiler would be started through it\n"
        "from llama_mini.model import ModelArgs, Transformer\n"
        "with torch.device('meta'):\n"
        "    Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64))\n"
        "model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16))\n"
        "model(torch.randint(0, 64, (2, 16))).sum().backward()\n"
        "model.setup_cache(1, 8)\n"
        "with torch.no_grad(): model(torch.tensor([[1, 2]]), 0); model(torch.tensor([[3]]), 2)\n"
        "print(sorted(m for m in sys.modules if m.startswith('llama_mini')))\n"
        "print(sorted(m for m in ('safetensors', 'sentencepiece', 'tiktoken', 'gguf', 'torch.utils.cpp_extension') if m in sys.modules))\n"
        "print(sorted(torch.ops.loaded_libraries))\n"
    )
    env = {**os.environ, "LLAMA_MINI_CACHE": str(tmp_path / "cache"), "CXX": "/bin/false", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["['llama_mini', 'llama_mini.model']", "[]", "[]"]
    assert result.stderr == "" and not (tmp_path / "cache").exists()


def test_import_llama_mini_is_cheap_and_its_names_load_on_first_use():
    code = (
        "import sys, llama_mini\n"
        "assert llama_mini.__version__\n"
        "print(sorted(m for m in sys.modules if m.startswith('llama_mini')))\n"
        "print(llama_mini.load_checkpoint.__module__, llama_mini.quantize.__module__, llama_mini.open_tokenizer.__module__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "['llama_mini']", "llama_mini.formats.checkpoint llama_mini.quant llama_mini.tokenizers",
    ]


def test_the_version_is_written_once_in_the_package_and_pyproject_reads_it_from_there():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["name"] == "llama_mini"
    assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "llama_mini.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", llama_mini.__version__)
