"""Fused RMSNorm: the same numbers as Meta's reference code, forward and backward.

The reference RMSNorm is checked against hand computation in test_rmsnorm.py; here the
fused kernel (llama_mini/kernels, applied by use_fused_rmsnorm) is checked against the
reference, against float64 truth, and by gradcheck. The kernel is built when first applied, and cached.
"""

import ctypes
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llama_mini import ModelArgs, RMSNorm, Transformer, load_checkpoint, save_checkpoint
from llama_mini.kernels import FusedRMSNorm, build, fused_rmsnorm, use_fused_rmsnorm
from fixtures import assert_swapped_layers_keep_the_function

EPS = 1e-5
KERNEL_NODE = "torch::autograd::CppNode<llama_mini::RMSNormFunction>"  # kernels/csrc/rms_norm_op.cpp

requires_kernel = pytest.mark.skipif(
    fused_rmsnorm.cpu_kernel()[0] is None, reason=f"fused RMSNorm kernel unavailable: {fused_rmsnorm.cpu_kernel()[1]}"
)


def norm_pair(dim, p=1.0, dtype=torch.float32, seed=0):
    """A reference and a fused RMSNorm with the same non-trivial weight."""
    torch.manual_seed(seed)
    reference = RMSNorm(dim, EPS, p=p)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 2.0)
    fused = FusedRMSNorm(dim, EPS, p=p, fallback=False)
    fused.load_state_dict(reference.state_dict())
    return reference.to(dtype), fused.to(dtype)


def output_and_grads(norm, x, dy):
    x = x.detach().requires_grad_()
    y = norm(x)
    dx, dw = torch.autograd.grad(y, (x, norm.weight), dy)
    return y, dx, dw


def float64_truth(norm, x, dy):
    """Output and gradients of RMSNorm's formula computed in float64 throughout (no intermediate rounding)."""
    x, weight = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    y = x * torch.rsqrt(x[..., : norm.n_rms].pow(2).mean(-1, keepdim=True) + norm.eps) * weight
    return (y, *torch.autograd.grad(y, (x, weight), dy.double()))


@requires_kernel
@pytest.mark.parametrize("p", [1.0, 0.0625])
@pytest.mark.parametrize("shape", [(4, 33, 256), (1000, 1024)])
def test_float32_output_and_gradients_match_reference_within_1e_5(shape, p):
    reference, fused = norm_pair(shape[-1], p)
    x, dy = torch.randn(shape) * 3, torch.randn(shape)
    expected, got = output_and_grads(reference, x, dy), output_and_grads(fused, x, dy)
    for name, e, g in zip(("output", "dx", "dweight"), expected, got):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=name)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [1.0, 0.0625])
def test_half_precision_output_is_meta_result_up_to_one_ulp_in_one_percent(dtype, p):
    """Meta's result is float32 arithmetic rounded where its code rounds; the statistic's
    summation order may differ in the last float32 bit, which moves a rare element by one
    ulp of the half-precision type, never more."""
    reference, fused = norm_pair(4096, p, dtype)
    x = (torch.randn(256, 4096) * 4).to(dtype)
    with torch.no_grad():
        expected, got = reference(x), fused(x)
    differ = expected != got
    assert differ.float().mean() <= 0.01
    ulp = torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(expected[differ].float().abs())))
    assert ((got[differ].float() - expected[differ].float()).abs() <= ulp).all()


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gradients_within_rounding_of_float64_truth(dtype):
    """The fused backward keeps float32 throughout and rounds each gradient once, so it
    is within a few ulps of exact, and at least as close as the reference's
    op-by-op half-precision backward."""
    reference, fused = norm_pair(1024, 1.0, dtype)
    x, dy = (torch.randn(512, 1024) * 2).to(dtype), torch.randn(512, 1024).to(dtype)
    truth = float64_truth(fused, x, dy)
    for i, name in ((1, "dx"), (2, "dweight")):
        got, expected = output_and_grads(fused, x, dy)[i].double(), output_and_grads(reference, x, dy)[i].double()
        scale = truth[i].abs().max()
        fused_error, reference_error = (got - truth[i]).abs().max(), (expected - truth[i]).abs().max()
        assert fused_error <= 4 * torch.finfo(dtype).eps * scale, name
        assert fused_error <= reference_error * 1.01, name


@requires_kernel
@pytest.mark.parametrize("p", [1.0, 0.25])
def test_gradcheck_float64_runs_the_kernel(p):
    _, fused = norm_pair(16, p, torch.float64)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    assert fused(x).grad_fn.name() == KERNEL_NODE
    assert torch.autograd.gradcheck(fused, (x,))


@requires_kernel
def test_non_contiguous_input_matches_reference():
    reference, fused = norm_pair(128)
    base = torch.randn(64, 2, 128)
    x = base[::2, 1]  # strided rows
    dy = torch.randn(128, 32).t()  # a transposed gradient
    for e, g in zip(output_and_grads(reference, x, dy), output_and_grads(fused, x, dy)):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@requires_kernel
def test_bfloat16_input_with_float32_weight_promotes_like_meta():
    """Meta's `type_as(x) * weight` with a float32 weight gives float32."""
    reference, fused = norm_pair(256)
    x = torch.randn(8, 256).to(torch.bfloat16)
    assert fused(x).dtype == torch.float32
    torch.testing.assert_close(fused(x), reference(x), rtol=1e-5, atol=1e-5)


@requires_kernel
def test_empty_input_gives_empty_output_and_zero_weight_gradient():
    _, fused = norm_pair(64)
    x = torch.randn(0, 64, requires_grad=True)
    y = fused(x)
    assert y.shape == (0, 64)
    (dw,) = torch.autograd.grad(y.sum(), fused.weight)
    assert torch.equal(dw, torch.zeros(64))


def test_the_model_alone_runs_model_py_and_use_fused_rmsnorm_swaps_every_rmsnorm():
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=32, norm="rmsnorm"))
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 5 and all(type(m) is RMSNorm for m in norms)
    if fused_rmsnorm.cpu_kernel()[0] is None:
        pytest.skip("fused RMSNorm kernel unavailable")
    weights = {name: p.data_ptr() for name, p in model.named_parameters()}
    names = list(model.state_dict())
    assert use_fused_rmsnorm(model) is model
    assert all(type(m) is FusedRMSNorm for m in norms)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == weights and list(model.state_dict()) == names
    assert model.norm(torch.randn(2, 64)).grad_fn.name() == KERNEL_NODE


@requires_kernel
def test_a_saved_model_records_no_implementation_and_loads_plain(tmp_path):
    """Which implementation runs is a layer applied to a model, not stored with it."""
    model = use_fused_rmsnorm(Transformer(ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=32, norm="prmsnorm", norm_p=0.25)))
    save_checkpoint(model, tmp_path)
    assert "impl" not in (tmp_path / "config.json").read_text()
    loaded = load_checkpoint(tmp_path)
    assert type(loaded.norm) is RMSNorm and loaded.norm.n_rms == 16
    assert type(use_fused_rmsnorm(loaded).norm) is FusedRMSNorm
    assert loaded.norm(torch.randn(2, 64)).grad_fn.name() == KERNEL_NODE


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_with_the_fused_norm_equals_the_plain_model(dtype):
    """Logits and every gradient, on batches of 1, 17 and 64 rows, partial RMSNorm included."""
    assert_swapped_layers_keep_the_function(use_fused_rmsnorm, dtype, norm="prmsnorm", norm_p=0.25)


@requires_kernel
def test_torch_compile_traces_the_reference_code_in_one_graph():
    """Under torch.compile Inductor fuses the reference itself; the opaque kernel would
    break the graph, which fullgraph=True turns into an error."""
    reference, fused = norm_pair(32)
    compiled = torch.compile(fused, backend="eager", fullgraph=True)
    x = torch.randn(3, 32)
    torch.testing.assert_close(compiled(x), reference(x))


NO_COMPILER = "no C++ compiler found (install g++ or set CXX)"


@pytest.fixture
def kernel_unavailable(monkeypatch):
    monkeypatch.setattr(fused_rmsnorm, "cpu_kernel", lambda: (None, NO_COMPILER))
    monkeypatch.setattr(fused_rmsnorm, "_cuda_fusable", lambda: False)
    for cached in (fused_rmsnorm.notice_fallback, fused_rmsnorm.kernel_for):
        cached.cache_clear()
    yield
    for cached in (fused_rmsnorm.notice_fallback, fused_rmsnorm.kernel_for):
        cached.cache_clear()


def notices(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.name == fused_rmsnorm.__name__]


def test_without_the_kernel_the_model_keeps_its_own_norm_after_one_notice(kernel_unavailable, caplog):
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=50)
    with caplog.at_level(logging.WARNING, logger=fused_rmsnorm.__name__):
        models = [use_fused_rmsnorm(Transformer(args)) for _ in range(2)]  # ten norms, one notice
    assert all(type(m) is RMSNorm for model in models for m in (model.norm, model.layers[1].ffn_norm))
    assert notices(caplog) == [f"llama_mini: fused RMSNorm unavailable ({NO_COMPILER}); using the reference implementation"]


def test_fused_refuses_to_fall_back_silently(kernel_unavailable):
    with pytest.raises(RuntimeError, match=r"fused RMSNorm cannot run here: no C\+\+ compiler"):
        use_fused_rmsnorm(Transformer(ModelArgs(dim=32, n_heads=4, vocab_size=8)), fallback=False)


@requires_kernel
def test_tensors_no_kernel_takes_fall_back_with_one_notice_or_are_refused(caplog):
    """float16 input with a bfloat16 weight has no kernel (csrc/rms_norm.h): the auto
    module runs the reference code, the strict one refuses."""
    reference, fused = norm_pair(32)
    auto = FusedRMSNorm(32, EPS)
    auto.load_state_dict(reference.state_dict())
    x = torch.randn(3, 32, dtype=torch.float16)
    reference, auto, fused = reference.bfloat16(), auto.bfloat16(), fused.bfloat16()
    fused_rmsnorm.notice_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger=fused_rmsnorm.__name__):
        assert torch.equal(auto(x), reference(x))
        auto(x)
    assert notices(caplog) == [
        "llama_mini: fused RMSNorm unavailable (no CPU kernel for torch.float16 input with torch.bfloat16 weight); using the reference implementation"
    ]
    with pytest.raises(RuntimeError, match="FusedRMSNorm cannot run here: no CPU kernel for torch.float16 input"):
        fused(x)


@pytest.mark.slow  # builds the kernels, several times
@requires_kernel
def test_build_is_cached_per_source_and_reports_compiler_errors(tmp_path, monkeypatch, capsys):
    """Runs the real build command on a small source (the operator itself takes longer)."""
    monkeypatch.setenv("LLAMA_MINI_CACHE", str(tmp_path))
    small = tmp_path / "small.cpp"
    small.write_text('#include <torch/library.h>\nextern "C" int answer() { return 42; }\n')
    monkeypatch.setattr(build, "SOURCES", [small])
    monkeypatch.setattr(build, "OPERATORS", ())  # it registers none
    first = build.build()
    assert first.parent == tmp_path and ctypes.CDLL(str(first)).answer() == 42
    assert capsys.readouterr().err == build.BUILD_NOTICE + "\n"  # one line, before compiling
    mtime = first.stat().st_mtime_ns
    assert build.build() == first and first.stat().st_mtime_ns == mtime  # no second compile
    assert capsys.readouterr().err == ""  # loading from the cache is silent
    small.write_text('#include <torch/library.h>\nextern "C" int answer() { return 43; }\n')
    assert build.build() != first  # a changed source is a new binary
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(build, "SOURCES", [bad])
    with pytest.raises(RuntimeError, match="failed on bad.cpp: .*error"):
        build.build()
    assert len(list(tmp_path.glob("*.so"))) == 2 and not list(tmp_path.glob(".*"))  # no half-written binary left


@pytest.mark.slow  # builds the kernels
@requires_kernel
def test_a_build_removes_what_killed_builds_left_and_keeps_running_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_MINI_CACHE", str(tmp_path))
    small = tmp_path / "small.cpp"
    small.write_text('#include <torch/library.h>\nextern "C" int answer() { return 7; }\n')
    monkeypatch.setattr(build, "SOURCES", [small])
    monkeypatch.setattr(build, "OPERATORS", ())  # it registers none
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = tmp_path / f".cpu_kernels-0123456789abcdef.so.tmp-{int(finished.stdout)}"  # its process is gone
    running = tmp_path / f".cpu_kernels-0123456789abcdef.so.tmp-{os.getpid()}"  # a build in progress
    killed.write_bytes(b"half a binary")
    running.write_bytes(b"half a binary")
    build.build()
    assert not killed.exists() and running.exists()


def test_import_loads_no_compiler_machinery_and_a_cached_kernel_loads_silently():
    """import llama_mini.kernels never imports torch.utils.cpp_extension (nor setuptools, which
    print on some machines) and loads no kernel library; applying the cached kernel prints nothing."""
    code = (
        "import sys, torch, llama_mini\n"
        "from llama_mini.kernels import use_fused_rmsnorm\n"
        "print(sorted(m for m in ('torch.utils.cpp_extension', 'setuptools') if m in sys.modules), sorted(torch.ops.loaded_libraries))\n"
        "use_fused_rmsnorm(llama_mini.Transformer(llama_mini.ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=8)))\n"
        "print('torch.utils.cpp_extension' in sys.modules)\n"
    )
    fused_rmsnorm.cpu_kernel()  # the kernel is in the cache (where it builds at all)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[] []", "False"]
    expected = "" if fused_rmsnorm.cpu_kernel()[0] else f"llama_mini: fused RMSNorm unavailable ({fused_rmsnorm.cpu_kernel()[1]}); using the reference implementation\n"
    assert result.stderr == expected


@pytest.mark.parametrize("importer", ["build._torch_flags()", "import torch.utils.cpp_extension"])
def test_compiling_keeps_cpp_extensions_import_time_notices_from_the_user(importer):
    """A CUDA build of torch on a machine without CUDA logs "No CUDA runtime is found" when
    cpp_extension is imported; the build imports it without letting that through."""
    code = (
        "import os, torch\n"
        "torch.cuda._is_compiled, torch.version.cuda = (lambda: True), '12.0'  # a CUDA build of torch\n"
        "torch.cuda.is_available = lambda: False  # on a machine without a GPU\n"
        "os.environ['CUDA_HOME'] = os.getcwd()\n"
        f"from llama_mini.kernels import build\n{importer}\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr
    if importer.startswith("import"):  # the notice this guards against, so the test can fail
        assert "No CUDA runtime is found" in result.stderr
    else:
        assert result.stderr == ""


@requires_kernel
def test_weight_of_the_wrong_size_is_refused_in_one_line():
    kernel = fused_rmsnorm.cpu_kernel()[0]
    with pytest.raises(RuntimeError, match=r"weight of shape \[63\] for input of shape \[2, 64\]; the weight needs"):
        kernel(torch.randn(2, 64), torch.ones(63), EPS, 64)


@requires_kernel
def test_second_order_gradients_are_refused_not_silently_zero():
    _, fused = norm_pair(16)
    x = torch.randn(4, 16, requires_grad=True)
    (dx,) = torch.autograd.grad(fused(x).pow(2).sum(), x, create_graph=False)
    assert dx.abs().sum() > 0
    with pytest.raises(RuntimeError, match="cannot be differentiated again; leave use_fused_rmsnorm out"):
        torch.autograd.grad(fused(x).pow(2).sum(), x, create_graph=True)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_is_bitwise_meta_where_torch_summation_order_is_known(dtype):
    """On CPUs where the kernel reproduces torch's summation order (x86 with torch's
    cascade sum), the forward pass is Meta's code bit for bit, not merely close."""
    if not fused_rmsnorm.cpu_kernel()[0].bitwise_meta:
        pytest.skip("torch's summation order is not reproduced on this CPU; the tolerance tests apply")
    reference, fused = norm_pair(4096, 1.0, dtype)
    x = (torch.randn(3, 100, 4096) * 4).to(dtype)
    with torch.no_grad():
        assert torch.equal(fused(x), reference(x))


@requires_kernel
@pytest.mark.parametrize("fresh_output", [True, False])
def test_large_outputs_written_by_streaming_stores_equal_the_reference(fresh_output):
    """Outputs of 32 MB and more are mapped in one call and written with streaming stores
    (kernels/csrc/rms_norm.cpp): into fresh memory and into memory already in use alike. Width
    4099 puts most rows off the vector alignment, so the copy's head and tail run too."""
    kernel = fused_rmsnorm.cpu_kernel()[0]
    library = ctypes.CDLL(str(build.library_path()))  # the loaded operator's own kernels, by their C ABI
    rows, dim = 2048, 4099  # 33.6 MB of float32 per output
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(rows, dim, generator=g) * 3, torch.randn(rows, dim, generator=g)
    w = torch.rand(dim, generator=g) + 0.5
    new = torch.empty if fresh_output else torch.ones  # torch.ones touches every page
    y, rstd, dx, dw = new(rows, dim), torch.empty(rows), new(rows, dim), torch.empty(dim)
    i64, threads = ctypes.c_int64, torch.get_num_threads()
    library.rms_norm_fwd_float32_float32(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                                         ctypes.c_void_p(rstd.data_ptr()), i64(rows), i64(dim), i64(dim), ctypes.c_double(EPS),
                                         kernel.vector_bytes // 4, threads)
    library.rms_norm_bwd_float32_float32(*(ctypes.c_void_p(t.data_ptr()) for t in (dy, x, w, rstd, dx, dw)),
                                         i64(rows), i64(dim), i64(dim), threads)

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    expected = fused_rmsnorm.model_rms_norm(xr, wr, EPS, dim)
    ex_dx, ex_dw = torch.autograd.grad(expected, (xr, wr), dy)
    if kernel.bitwise_meta:
        assert torch.equal(y, expected)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, ex_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, ex_dw, rtol=1e-4, atol=1e-3)  # a sum over 2048 rows
