"""Edit model.py and every run follows: each kernel layer computes the core as it is loaded, or steps aside.

Each core function a kernel layer stands in for is edited as an edit of model.py (or of
quant/layers.py) leaves it: a changed function or class on the module. The layers are then
applied as train.py, generate.py and evaluate apply them, and the numbers are the edited
model's, those of --kernels off, to the order of float sums; the edit changes them (so each
check can fail); and one line names the function and the layer left off. The unedited core
stays on the kernels: the record matches the code.
"""

import functools
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fixtures import LLAMA2_TOKENIZER, TINY, require, tiny_model
from llama_mini import model as core
from llama_mini import save_checkpoint
from llama_mini.kernels import (FusedAttention, FusedFeedForward, FusedRMSNorm, on_kernels, use_cpu_kernels,
                                use_fused_rmsnorm, use_fused_rope, use_fused_swiglu)
from llama_mini.kernels import gguf_blocks
from llama_mini.kernels import fingerprints
from llama_mini.kernels.operators import operators
from llama_mini.quant import layers as quant_layers
from llama_mini.quant import quantize
from llama_mini.run import corpus

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(operators() is None, reason="no vector kernels on this machine (x86-64 with AVX2 and FMA)")]


# --- Edits, as a reader makes them in model.py or quant/layers.py ----------------------------------


def gelu_gate(self, a, b):
    return F.gelu(a) * b


def gelu_feed_forward(self, x):
    return self.w2(F.gelu(self.w1(x)) * self.w3(x))


def no_rope(x, cos, sin):
    return x


def rotate_twice(self, x, cos, sin):
    return core.apply_rotary_emb(core.apply_rotary_emb(x, cos, sin), cos, sin)


def centred_norm(self, x):
    x = x - x.mean(-1, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def offset_weight_norm(self, x):
    return self._norm(x.float()).type_as(x) * (1 + self.weight)


def scaled_residual(self, x, cos, sin, start_pos=0):
    h = x + 0.1 * self.attention(self.attention_norm(x), cos, sin, start_pos)
    return h + self.feed_forward(self.ffn_norm(h))


def halved_attention(original):
    def forward(self, x, cos, sin, start_pos=0):
        return 0.5 * original(self, x, cos, sin, start_pos)
    return forward


def halved_values(original):
    def update(self, start_pos, k, v):
        return original(self, start_pos, k, 0.5 * v)
    return update


def unrounded_activations(x, block=32):
    return x.float()


def halved_weights(original):
    def dequantize(self, dtype=None):
        return original(self, dtype) * 0.5
    return dequantize


class GeluFeedForward(nn.Module):
    """A feed-forward written anew in model.py: the class itself replaced."""

    def __init__(self, args):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)) * self.w3(x))


# name: (the edit, the function the notice names or None where a class is replaced, the layers
# left off in training, in inference, the quantization the edit needs)
EDITS = {
    "gate": (lambda mp: mp.setattr(core.FeedForward, "gate", gelu_gate), "FeedForward.gate",
             "fused SwiGLU", "block kernel", None),
    "feed_forward": (lambda mp: mp.setattr(core.FeedForward, "forward", gelu_feed_forward), "FeedForward.forward",
                     None, "block kernel", None),
    "no_rope": (lambda mp: mp.setattr(core, "apply_rotary_emb", no_rope), "apply_rotary_emb", "fused RoPE", "block kernel", None),
    "rotate": (lambda mp: mp.setattr(core.Attention, "rotate", rotate_twice), "Attention.rotate", "fused RoPE",
               "block kernel", None),
    "norm": (lambda mp: mp.setattr(core.RMSNorm, "_norm", centred_norm), "RMSNorm._norm", "fused RMSNorm", "fused RMSNorm", None),
    "norm_forward": (lambda mp: mp.setattr(core.RMSNorm, "forward", offset_weight_norm), "RMSNorm.forward", "fused RMSNorm",
                     "fused RMSNorm", None),
    "residual": (lambda mp: mp.setattr(core.TransformerBlock, "forward", scaled_residual), "TransformerBlock.forward",
                 None, "block kernel", None),
    "attention": (lambda mp: mp.setattr(core.Attention, "forward", halved_attention(core.Attention.forward)),
                  "Attention.forward", None, "block kernel", None),
    "cache": (lambda mp: mp.setattr(core.KVCache, "update", halved_values(core.KVCache.update)), "KVCache.update",
              None, "block kernel", None),
    "class": (lambda mp: mp.setattr(core, "FeedForward", GeluFeedForward), "FeedForward.forward", None, "block kernel", None),
    "int8_activations": (lambda mp: mp.setattr(quant_layers, "quantized_activations", unrounded_activations),
                         "quantized_activations", None, "int8 kernel", "int8"),
    "int4_weights": (lambda mp: mp.setattr(quant_layers.Int4Linear, "dequantize", halved_weights(quant_layers.Int4Linear.dequantize)),
                     "Int4Linear.dequantize", None, "int4 kernel", "int4"),
}
TRAINING = ["gate", "feed_forward", "no_rope", "rotate", "norm", "norm_forward", "residual", "class"]


def quick_and_slow(names, quick):
    """One case of a family in the quick suite, the others marked slow (CI runs them all)."""
    return [name if name == quick else pytest.param(name, marks=pytest.mark.slow) for name in names]


@pytest.fixture(autouse=True)
def notices(caplog):
    """The warnings the layers log, each process's once-per-edit memory cleared, as in a new process."""
    fingerprints.notice_changed.cache_clear()
    caplog.set_level(logging.WARNING, logger="llama_mini")
    yield caplog
    fingerprints.notice_changed.cache_clear()


def assert_named(caplog, function, layer):
    """One line names the edited function and the layer left off; none where no layer is (layer None)."""
    lines = [r.getMessage() for r in caplog.records if "is not the code the" in r.getMessage()]
    if layer is None:
        assert lines == []
        return
    assert any(f"llama_mini: {function} in llama_mini/" in line and f"the {layer} is left off" in line for line in lines), lines


def within(got, expected, share):
    """Each position's values within share of that position's spread (max - min)."""
    spread = expected.amax(-1, keepdim=True) - expected.amin(-1, keepdim=True)
    return bool(((got - expected).abs() <= share * spread).all())


def moved(got: dict, before: dict) -> float:
    """The largest change of any gradient, as a share of that gradient's largest value."""
    return max(((got[name] - grad).abs().max() / grad.abs().max()).item() for name, grad in before.items())


def loss_and_gradients(model, tokens):
    model.train()
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


TOKENS = torch.randint(0, TINY["vocab_size"], (3, 33), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("edit", quick_and_slow(TRAINING, "gate"))
def test_training_with_the_fused_layers_gives_the_edited_models_losses_and_gradients(edit, monkeypatch, notices):
    """As train.py applies them (run/start.py): the first loss and every gradient those of the
    edited model without the kernels; the other layers still fused, the edited one not."""
    _, unedited = loss_and_gradients(tiny_model(), TOKENS)
    apply, function, training_layer, _, _ = EDITS[edit]
    apply(monkeypatch)
    plain_loss, plain_grads = loss_and_gradients(tiny_model(), TOKENS)
    fused = use_fused_rope(use_fused_swiglu(use_fused_rmsnorm(tiny_model())))
    loss, grads = loss_and_gradients(fused, TOKENS)
    assert moved(plain_grads, unedited) > 1e-2, "the edit must change the numbers"
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert_named(notices, function, training_layer)
    block = fused.layers[0]
    kinds = {"fused RMSNorm": (block.attention_norm, FusedRMSNorm), "fused SwiGLU": (block.feed_forward, FusedFeedForward),
             "fused RoPE": (block.attention, FusedAttention)}
    for layer, (module, kernel_class) in kinds.items():
        edited_away = layer == training_layer or edit == "class" and layer == "fused SwiGLU"
        assert (type(module) is kernel_class) != edited_away, layer  # that module only steps aside


@torch.inference_mode()
def prompt_and_steps(model, tokens, steps=3):
    """The logits of a prompt read into the KV cache, then of `steps` decoding steps."""
    model.setup_cache(tokens.shape[0], tokens.shape[1] + steps)
    logits = [model(tokens, 0)]
    for i in range(steps):
        logits.append(model(tokens[:, i:i + 1], tokens.shape[1] + i))
    model.drop_cache()
    return torch.cat(logits, dim=1)


def inference_model(quantization, kernels):
    """The tiny model as generate.py loads it on a CPU (inference/loading.py), or with --kernels off."""
    model = tiny_model()
    if quantization:
        quantize(model, quantization)
    return use_cpu_kernels(use_fused_rmsnorm(model)) if kernels else model


@pytest.mark.parametrize("edit", quick_and_slow(EDITS, "residual"))
def test_prompts_and_decoding_on_the_kernels_give_the_edited_models_logits(edit, monkeypatch, notices):
    apply, function, _, layer, quantization = EDITS[edit]
    tokens = TOKENS[:2, :9]
    unedited = prompt_and_steps(inference_model(quantization, kernels=False), tokens)
    apply(monkeypatch)
    expected = prompt_and_steps(inference_model(quantization, kernels=False), tokens)
    model = inference_model(quantization, kernels=True)
    got = prompt_and_steps(model, tokens)
    assert not within(expected, unedited, 1e-3), "the edit must change the numbers"
    assert within(got, expected, 1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert not on_kernels(model)  # every edit here touches the block's code: it says so
    assert_named(notices, function, layer)


def test_the_unedited_model_stays_on_every_kernel(notices):
    for quantization in (None, "int8", "int4"):
        model = inference_model(quantization, kernels=True)
        assert on_kernels(model)
    fused = use_fused_rope(use_fused_swiglu(use_fused_rmsnorm(tiny_model())))
    block = fused.layers[0]
    assert (type(block.attention_norm), type(block.feed_forward), type(block.attention)) == (FusedRMSNorm, FusedFeedForward, FusedAttention)
    assert not [r for r in notices.records if "is not the code the" in r.getMessage()]


# --- The command lines ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model over Meta's Llama-2 vocabulary, saved as a run saves it, and a text."""
    require(LLAMA2_TOKENIZER)
    root = tmp_path_factory.mktemp("edited")
    folder = save_checkpoint(tiny_model(vocab_size=32000), root / "model", tokenizer_path=LLAMA2_TOKENIZER)
    (root / "text.txt").write_text("\n\n".join(corpus.stories(3000, seed=5)), encoding="utf-8")
    return folder, root / "text.txt"


def test_evaluate_and_generate_py_give_the_edited_models_numbers(checkpoint, monkeypatch, capsys, notices):
    """The issue's own case: a scaled residual; perplexity and greedy text as with --kernels off."""
    import generate
    from llama_mini.evaluate import main as evaluate

    folder, text = checkpoint

    def outputs(kernels):
        evaluate(["--ckpt", str(folder), "--data", str(text), "--ctx", "32", "--chunks", "4", "--kernels", kernels])
        generate.main(["--ckpt", str(folder), "--prompt", "Once upon a time", "--temperature", "0", "--max-new-tokens", "12",
                       "--kernels", kernels])
        out = capsys.readouterr().out.splitlines()
        return float(out[0].split()[1]), out[1]

    unedited = outputs("auto")
    scaled = EDITS["residual"]
    scaled[0](monkeypatch)
    off = outputs("off")
    auto = outputs("auto")
    assert off[0] != pytest.approx(unedited[0], rel=1e-3), "the edit must change the perplexity"
    assert auto[0] == pytest.approx(off[0], rel=1e-5) and auto[1] == off[1]
    assert_named(notices, scaled[1], scaled[3])


def test_train_py_trains_the_edited_model(tmp_path, monkeypatch, capsys, notices):
    """train.py as a user runs it, SwiGLU's gate turned into GELU's: the losses it logs are those of --kernels off."""
    import train

    (tmp_path / "text.txt").write_text("\n\n".join(corpus.stories(20_000, seed=5)), encoding="utf-8")
    EDITS["gate"][0](monkeypatch)

    def losses(kernels):
        out = tmp_path / f"run-{kernels}"
        assert train.main(["--data", str(tmp_path / "text.txt"), "--cache-dir", str(tmp_path / "cache"), "--out", str(out),
                           "--device", "cpu", "--dim", "32", "--n-layers", "1", "--n-heads", "2", "--vocab-size", "400",
                           "--seq-len", "16", "--batch-size", "2", "--max-steps", "3", "--eval-every", "3", "--sample-tokens", "0",
                           "--kernels", kernels]) == 0
        return [json.loads(line).get("train_loss") for line in (out / "metrics.jsonl").read_text().splitlines()][1:]

    off, auto = losses("off"), losses("auto")
    assert auto == pytest.approx(off, rel=1e-5)
    assert_named(notices, "FeedForward.gate", "fused SwiGLU")


# --- The record -------------------------------------------------------------------------------------


def kernel_layers():
    """Every kernel layer class: a class of llama_mini.kernels standing in for one of the core or quant/."""
    import inspect

    from llama_mini.kernels import block, linear

    modules = [block, linear, __import__("llama_mini.kernels.fused_rmsnorm", fromlist=["x"]),
               __import__("llama_mini.kernels.fused_rope", fromlist=["x"]), __import__("llama_mini.kernels.fused_swiglu", fromlist=["x"])]
    found = {cls for module in modules for _, cls in inspect.getmembers(module, inspect.isclass)
             if cls.__module__ == module.__name__ and any(base.__module__.startswith(("llama_mini.model", "llama_mini.quant", "torch.nn"))
                                                          for base in cls.__mro__[1:])}
    return sorted(found, key=lambda cls: cls.__name__)


def test_every_kernel_layer_names_the_core_code_it_computes_and_the_record_holds_it_as_it_is():
    layers = kernel_layers()
    assert {cls.__name__ for cls in layers} >= {"FusedRMSNorm", "FusedFeedForward", "FusedAttention", "KernelBlock",
                                                "KernelLinear", "KernelInt8Linear", "KernelInt4Linear"}
    named = set()
    for cls in layers:
        assert isinstance(cls.layer, str) and isinstance(cls.computes, tuple), cls
        named |= set(cls.computes)
    named |= set(gguf_blocks.COMPUTES)  # the GGUF converter: not a layer, written for quant/'s converters
    assert named == set(fingerprints.FINGERPRINTS), "the record names exactly the functions the layers compute"
    stale = {name for name in named if fingerprints.fingerprint(fingerprints.live(name)) != fingerprints.FINGERPRINTS[name]}
    assert not stale, f"{sorted(stale)} changed: update the kernels, then `python -m llama_mini.kernels.fingerprints`"


class Documented:
    def f(x):
        """Its docstring."""
        return x + 1  # a comment


class Reworded:
    def f(x):
        """Another docstring,
        over two lines."""

        # a comment of its own
        return x + 1


class Recoded:
    def f(x):
        """Its docstring."""
        return x + 2  # a comment


class Hashed:
    def f(x):
        return x + f"#{1}" + """
        # not a comment""" + "é#"  # a comment


class Rehashed:
    def f(x):
        return x + f"#{2}" + """
        # not a comment""" + "é#"  # another comment


class Recommented:
    def f(x):
        return x + f"#{1}" + """
        # not a comment""" + "é#"  # the same code, another comment


class Rehashed2:
    def f(x):
        return x + f"#{1}" + """
        # not a comment!""" + "é#"


class Shapes:
    @staticmethod
    @functools.lru_cache
    def decorated(x):
        return x + 1

    def split_signature(
        x,
    ):
        return x + 1  # the closing bracket at the def's indent: that cut does not parse
# a comment at column 0, then the next def

    def nested(x):
        def inner(y):
            return y + 1
        return inner


@pytest.mark.parametrize("function", [Shapes.decorated, Shapes.split_signature, Shapes.nested,
                                      Shapes.nested(0), Documented.f, Hashed.f, core.FeedForward.gate])
def test_a_fingerprint_reads_the_lines_inspect_reads(function, monkeypatch):
    read = fingerprints.fingerprint(function)
    monkeypatch.setattr(fingerprints, "_def_block", lambda function: "")  # inspect.getsource's lines, always
    assert read is not None and read == fingerprints.fingerprint(function)


def test_a_fingerprint_reads_the_code_not_its_docstring_or_comments():
    assert fingerprints.fingerprint(Documented.f) == fingerprints.fingerprint(Reworded.f)
    assert fingerprints.fingerprint(Documented.f) != fingerprints.fingerprint(Recoded.f)
    # a # inside a string, over lines or after a wide character, is code
    assert len({fingerprints.fingerprint(cls.f) for cls in (Hashed, Rehashed, Rehashed2)}) == 3
    assert fingerprints.fingerprint(Hashed.f) == fingerprints.fingerprint(Recommented.f)
    assert fingerprints.fingerprint(torch.add) is None  # a builtin: no source, so never the recorded code
    assert fingerprints.changed(["model:FeedForward.no_such_method"]) == "model:FeedForward.no_such_method"
