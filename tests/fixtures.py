"""The shared fixtures (Meta's tokenizers, llama.cpp's vocabulary tests), found beside the
checkout through this one constant. A test whose fixture is absent is skipped, except under
CI (CI=true), where the absence fails it. And the tiny model the tests build (tiny_model)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llama_mini.model import ModelArgs, Transformer

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT.parent / "shared" / "fixtures"
LLAMA2_TOKENIZER = FIXTURES / "llama2-tokenizer.model"
LLAMA3_TOKENIZER = FIXTURES / "llama3-tokenizer.model"
GGUF_VOCAB = FIXTURES / "gguf-vocab"


def require(path: Path) -> Path:
    """path, a fixture: the test is skipped where it is absent, and fails under CI."""
    if not path.exists():
        message = f"fixture {path.name} is not in {path.parent}"
        if os.environ.get("CI") == "true":
            pytest.fail(message + " (under CI every fixture must be present)")
        pytest.skip(message)
    return path


# dim 64 with 4 heads and 2 key-value heads: grouped-query attention, a hidden size rounded up
# to multiple_of, small enough that a test builds dozens in a second.
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, max_seq_len=128)


def tiny_model(seed=0, **overrides) -> Transformer:
    """A small Transformer (TINY, with overrides), its weights drawn from seed, norm weights
    included (not all ones: a norm read from the wrong tensor shows), in eval mode."""
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**{**TINY, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def assert_swapped_layers_keep_the_function(use, dtype, **overrides):
    """use(model), a call that swaps layers for faster ones, leaves a model whose logits and
    every gradient equal the plain model's within dtype's rounding, on batches of 1, 17 and
    64 rows."""
    plain = tiny_model(**overrides).train().to(dtype)
    swapped = use(tiny_model(**overrides).train().to(dtype))
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for batch, rows in ((1, 1), (3, 17), (2, 64)):
        tokens = torch.randint(0, plain.args.vocab_size, (batch, rows))
        expected, got = plain(tokens), swapped(tokens)
        torch.testing.assert_close(got, expected, **tolerance)
        expected.float().square().mean().backward()
        got.float().square().mean().backward()
        for (name, a), b in zip(plain.named_parameters(), swapped.parameters()):
            torch.testing.assert_close(b.grad.float(), a.grad.float(), **tolerance, msg=name)
        plain.zero_grad(), swapped.zero_grad()


def assert_swaps_every(use, base, faster, attribute, folder):
    """use(model) gives every `base` module of a two-block model the class `faster`, keeping each
    weight (not a copy) and state-dict name, and the model saves as the plain one (which
    implementation runs is not stored: it loads with `base` at `attribute` of a block). Returns
    the swapped modules."""
    from llama_mini import load_checkpoint, save_checkpoint

    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=32))
    weights, names = {name: p.data_ptr() for name, p in model.named_parameters()}, list(model.state_dict())
    assert use(model) is model
    layers = [m for m in model.modules() if isinstance(m, base)]
    assert len(layers) == 2 and all(type(m) is faster for m in layers)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == weights and list(model.state_dict()) == names
    save_checkpoint(model, folder)
    assert type(getattr(load_checkpoint(folder).layers[0], attribute)) is base
    return layers


def load_peak(call: str) -> tuple:
    """(how far `call`, a Python expression that loads a model, raises a fresh process's peak
    resident memory, the bytes of the model's tensors)."""
    code = ("import torch\n"
            "from llama_mini import load_checkpoint\n"
            "import llama_mini.formats.gguf\n"
            "def peak():  # VmHWM: this process's own peak (getrusage's carries the parent's over exec)\n"
            "    return next(int(line.split()[1]) * 1024 for line in open('/proc/self/status') if line.startswith('VmHWM'))\n"
            "before = peak()\n"
            f"model = {call}\n"
            "tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}.values()\n"
            "print(peak() - before, sum(t.numel() * t.element_size() for t in tensors))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    return tuple(map(int, result.stdout.split()[-2:]))
