"""The integer layers off the CPU kernels (a GPU, a Mac, an ARM CPU, --kernels off): held in
plain rows, they compute the same function, store the same checkpoint, and under torch.compile
a decoding step is one pass over the codes (layers.one_row)."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fixtures import tiny_model
from llama_mini import load_checkpoint, save_checkpoint
from llama_mini.inference.loading import load_model
from llama_mini.kernels import on_kernels, use_cpu_kernels
from llama_mini.kernels.block import block_refusal
from llama_mini.kernels.linear import kernel_operands
from llama_mini.kernels.operators import operators
from llama_mini.quant import hold_plain_rows, quantize, quantized_notice
from llama_mini.quant import layers
from llama_mini.quant.layers import Int4Linear, Int8Linear, quantized_activations
from llama_mini.quant.layout import pack_int4_rows, unpack_int4_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
ROOT = Path(__file__).resolve().parents[2]

LAYERS = [(Int8Linear, {}), (Int4Linear, {"group_size": 32}), (Int4Linear, {"group_size": 64}),
          (Int4Linear, {"group_size": 128}), (Int4Linear, {"symmetric": True})]


def layer_of(kind, options, seed=0, shape=(48, 256)):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(*shape, generator=g) * torch.logspace(-2, 0, shape[0])[:, None]
    if options.get("symmetric"):  # GGUF's Q4_0: w = d (q - 8), no offsets held
        blocks = weight.unflatten(-1, (-1, 32))
        d = (blocks.abs().amax(-1) / 8).half()
        codes = torch.round(blocks / d.float()[..., None] + 8).clamp(0, 15).to(torch.uint8).flatten(1)
        return Int4Linear.from_codes(codes, d, None)
    return kind.from_weight(weight, **options)


def test_int4_plain_rows_hold_input_j_and_16_plus_j_of_each_block_in_one_byte():
    codes = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64).repeat(2, 1)
    codes[1] = codes[1].flip(0)
    packed = pack_int4_rows(codes)
    assert packed.shape == (2, 32)
    assert packed[0, 0] == codes[0, 0] | (codes[0, 16] << 4) and packed[0, 16] == codes[0, 32] | (codes[0, 48] << 4)
    assert torch.equal(unpack_int4_rows(packed), codes)


@pytest.mark.parametrize("kind, options", LAYERS)
def test_plain_rows_compute_the_same_weight_and_store_the_same_tensors(kind, options):
    layer = layer_of(kind, options)
    stored = {name: t.clone() for name, t in layer.state_dict().items()}
    weight = layer.dequantize(torch.float32)
    layer.hold_plain_rows()
    assert not layer.rows_of_8 and layer.weight.shape[0] == 48  # a row per row
    assert torch.equal(layer.dequantize(torch.float32), weight)
    again = layer.state_dict()
    assert again.keys() == stored.keys() and all(torch.equal(again[name], stored[name]) for name in stored)


def test_a_model_holding_plain_rows_saves_the_checkpoint_it_was_loaded_from(tmp_path):
    model = quantize(tiny_model(), "int4")
    save_checkpoint(model, tmp_path / "sets")
    loaded = hold_plain_rows(load_checkpoint(tmp_path / "sets"))
    save_checkpoint(loaded, tmp_path / "again")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "sets" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    tokens = torch.tensor([[1, 5, 9, 2]])
    torch.testing.assert_close(loaded(tokens), model(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, options", LAYERS)
@pytest.mark.parametrize("words", [False, True], ids=["bytes", "words"])
def test_one_row_is_the_definition_within_float_rounding_nan_included(kind, options, words, monkeypatch):
    """In both of its forms: the codes read as bytes, and as int32 words (torch's AVX2 CPU code)."""
    monkeypatch.setattr(layers, "CODES_AS_WORDS", words)
    by_words, calls = kind.one_row_by_words, []
    monkeypatch.setattr(kind, "one_row_by_words", lambda self, xq: calls.append(xq) or by_words(self, xq))
    layer = layer_of(kind, options)
    definition = layer.dequantize(torch.float32)
    layer.hold_plain_rows()
    x = torch.randn(1, 1, 256, generator=torch.Generator().manual_seed(1))
    xq = quantized_activations(x)
    torch.testing.assert_close(layer.one_row(xq.view(-1)), F.linear(xq, definition).view(-1), rtol=1e-5, atol=1e-5)
    x[..., 100] = float("nan")  # a NaN block scale reaches every output, as in the definition
    assert layer.one_row(quantized_activations(x).view(-1)).isnan().all()
    assert F.linear(quantized_activations(x), definition).isnan().all()
    assert len(calls) == (2 if words else 0)


def test_int4_inputs_not_a_multiple_of_64_keep_the_bytes_and_the_definition(monkeypatch):
    monkeypatch.setattr(layers, "CODES_AS_WORDS", True)
    layer = layer_of(Int4Linear, {"group_size": 32}, shape=(48, 96))
    definition = layer.dequantize(torch.float32)
    layer.hold_plain_rows()
    xq = quantized_activations(torch.randn(1, 1, 96, generator=torch.Generator().manual_seed(3)))
    torch.testing.assert_close(layer.one_row(xq.view(-1)), F.linear(xq, definition).view(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind, options", [LAYERS[0], LAYERS[2]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_a_decoding_step_goes_through_one_row_and_gives_the_definition(kind, options, dtype, monkeypatch):
    layer = layer_of(kind, options).to(dtype)
    definition = layer.dequantize(torch.float32)
    layer.hold_plain_rows()
    traced = []
    one_row = kind.one_row
    monkeypatch.setattr(kind, "one_row", lambda self, xq: traced.append(xq.shape) or one_row(self, xq))
    compiled = torch.compile(layer, dynamic=True)
    torch._dynamo.reset()
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    with torch.inference_mode():
        for rows in (1, 5):  # a decoding step, then a prompt (dequantized, then multiplied)
            x = torch.randn(1, rows, 256).to(dtype)
            y = compiled(x)
            assert y.dtype == dtype
            torch.testing.assert_close(y.float(), F.linear(quantized_activations(x), definition), **tolerance)
            assert len(traced) == 1  # the step traced one_row; the prompt did not
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="this CPU's own code is the AVX2 code")
def test_compiled_a_decoding_step_gives_the_definition_in_torchs_avx2_code_too(tmp_path):
    """torch.compile writes its loops for the CPU's vector width: eight lanes on AVX2, the CPU
    most users hold. The compiler's cache is a new one: code cached for AVX-512 must not be
    reused for AVX2 (the cache would hand it over, and its loads of sixteen lanes read eight)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/quant/test_off_kernels.py",
                             "-k", "goes_through_one_row"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    assert result.returncode == 0 and "4 passed" in result.stdout, result.stdout[-5000:] + result.stderr[-2000:]


def test_the_kernels_leave_a_layer_holding_plain_rows_to_torch_and_say_why():
    model = hold_plain_rows(quantize(tiny_model(), "int4"))
    layer = model.layers[0].attention.wq
    assert kernel_operands(layer) is None
    if operators() is not None:  # where the kernels load: the block is named, with the reason
        assert "holding plain rows" in block_refusal(model.layers[0], torch.float32)
        tokens = torch.tensor([[1, 5, 9, 2]])
        expected = model(tokens)
        use_cpu_kernels(model)
        assert not on_kernels(model)
        assert torch.equal(model(tokens), expected)  # each layer's own function, as before


def loaded(tmp_path, kernels, compile_=False):
    save_checkpoint(quantize(tiny_model(), "int8"), tmp_path / "ckpt")
    args = argparse.Namespace(ckpt=str(tmp_path / "ckpt"), tokenizer=None, dtype=None, quantize=None, device="cpu",
                              compile=compile_, kernels=kernels)
    return load_model(args, tmp_path / "ckpt", "native", argparse.Namespace(model_path=None), max_seq_len=None)


def test_generate_holds_plain_rows_off_the_kernels_and_sets_on_them(tmp_path, monkeypatch):
    monkeypatch.setattr("llama_mini.inference.loading.check_vocab_size", lambda *a: None)
    off = loaded(tmp_path / "off", "off")
    assert all(not m.rows_of_8 for m in off.modules() if isinstance(m, Int8Linear))
    if operators() is not None:
        on = loaded(tmp_path / "on", "auto")
        assert all(m.rows_of_8 for m in on.modules() if isinstance(m, Int8Linear))


@pytest.mark.parametrize("isa", ["AVX512", "AVX2"])
def test_the_notice_gives_the_measured_cost_and_the_way_out(isa, monkeypatch):
    model = quantize(tiny_model(), "int8")
    monkeypatch.setattr("torch.backends.cpu.get_cpu_capability", lambda: isa)
    monkeypatch.setattr("llama_mini.quant.quantized_slowdown", lambda layer: 18.4)
    assert quantized_notice(model) == (
        "note: here int8 layers take 18x the time of float ones in a decoding step (off the CPU kernels each step "
        "dequantizes them): --quantize int8 saves memory, not time, unless you add --compile")
    assert quantized_notice(model, compiled=True) is None  # torch's AVX-512 and AVX2 code: as fast as float
    monkeypatch.setattr("llama_mini.quant.quantized_slowdown", lambda layer: 1.2)
    assert quantized_notice(model) is None
    assert quantized_notice(tiny_model()) is None  # no integer layers


def test_the_slowdown_is_the_fastest_of_the_timed_runs_after_an_untimed_one(monkeypatch):
    """support/device.py's fastest_time, the timer of quantized_slowdown (and bfloat16_slowdown):
    a first run untimed, then the fastest of three."""
    from types import SimpleNamespace

    from llama_mini.quant import quantized_slowdown
    from llama_mini.support import device

    calls, clock = [], iter([0.0, 5.0, 5.0, 7.0, 7.0, 10.0])  # timed runs of 5, 2 and 3 seconds
    monkeypatch.setattr(device, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    assert device.fastest_time(lambda: calls.append(1), torch.device("cpu")) == 2.0
    assert len(calls) == 4
    monkeypatch.undo()
    assert 0 < quantized_slowdown(layer_of(Int8Linear, {})) < float("inf")


def test_compiled_on_torchs_plain_cpu_code_the_notice_says_integer_layers_are_slower(monkeypatch):
    monkeypatch.setattr("torch.backends.cpu.get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.setattr("llama_mini.quant.quantized_slowdown", lambda layer: 18.4)
    int4 = quantize(tiny_model(), "int4")
    assert quantized_notice(int4, compiled=True) == (
        "note: compiled with torch's DEFAULT CPU code, int4 layers decode slower than float ones "
        "(docs/generate_speed.md has the speeds measured): --quantize int4 saves memory, not time")
    assert quantized_notice(int4).endswith("--quantize int4 saves memory, not time")  # --compile is no way out here
