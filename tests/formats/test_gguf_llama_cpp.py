"""The real peer: llama.cpp reading the same GGUF files gives llama_mini's greedy tokens and logits.

Runs where llama-cpp-python is installed (a benchmark dependency, not CI's); skipped elsewhere.
The quantized files are made by llama.cpp's own quantizer from the F32 file convert writes.
llama.cpp rounds activations to 8 bits in its quantized matrix products, llama_mini computes
with the exact dequantized weights in float32: the logits then differ by that rounding.
"""

import sys

import pytest
import torch

from gguf_files import ROOT
from llama_mini import ModelArgs, Transformer, generate, load_checkpoint
from llama_mini.formats.gguf import export_gguf
from llama_mini.support.gguf_file import GGUFFile
from llama_mini.tokenizers import open_tokenizer
from llama_mini.run import corpus
from fixtures import LLAMA3_TOKENIZER, require

pytest.importorskip("llama_cpp")
sys.path.insert(0, str(ROOT / "bench"))
from gguf_parity import LlamaCpp, compare, quantize_with_llama_cpp  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # one_thread: tests/conftest.py; slow: gguf_run trains a model first
N = 64  # greedy tokens compared


@pytest.fixture(scope="module")
def files(gguf_run, tmp_path_factory):
    """The run's F32 file, and llama.cpp's Q8_0 and Q4_K_M (Q4_K, with Q6_K for some matrices) of it."""
    folder, f32 = tmp_path_factory.mktemp("llama-cpp"), gguf_run["files"]["f32"]
    return {"F32": f32, **{type: quantize_with_llama_cpp(f32, folder / f"{type}.gguf", type, pure=False, threads=1)
                           for type in ("Q8_0", "Q4_K_M")}}


# llama.cpp keeps its KV cache in F16, so even F32 files differ by a little more than float32 rounding.
@pytest.mark.parametrize("type, tolerance", [("F32", 1e-3), ("Q8_0", 0.02), ("Q4_K_M", 0.02)])
@torch.no_grad()
def test_llama_cpp_gives_the_same_logits_and_greedy_choices(files, type, tolerance):
    """Along llama_mini's greedy continuation, llama.cpp's logits stay within `tolerance` of the
    spread, and it picks the same token wherever the top two logits are further apart than the
    two implementations' largest difference (a nearer tie may fall either way)."""
    path = files[type]
    if type == "Q4_K_M":  # a K-quant file as llama.cpp's users hold them
        assert {info.type.name for info in GGUFFile(path).tensors.values() if len(info.shape) == 2} == {"Q4_K", "Q6_K"}
    tokenizer, model, peer = open_tokenizer(path), load_checkpoint(path), LlamaCpp(path, 128, threads=1)
    prompt = tokenizer.encode("Once upon a time")
    sequence = prompt + generate(model, [prompt], N, temperature=0)[0]
    ours, theirs = model(torch.tensor([sequence]))[0], peer.logits(sequence)
    largest, share = compare(theirs, ours)
    assert share < tolerance, (largest, share)
    steps = range(len(prompt) - 1, len(sequence) - 1)
    top = ours.topk(2, dim=-1).values
    decided = [i for i in steps if top[i, 0] - top[i, 1] > largest]
    assert len(decided) > 0.8 * N
    assert [theirs[i].argmax().item() for i in decided] == [sequence[i + 1] for i in decided]
    equal = sum(a == b for a, b in zip(sequence[len(prompt):], peer.greedy(prompt, N)))
    print(f"{type}: max |logit difference| {largest:.2e} ({share:.2%} of the spread); the same choice at all "
          f"{len(decided)} of {N} steps decided by more; {equal} of {N} free-running greedy tokens equal")


@torch.no_grad()
def test_a_llama3_file_gives_llama_cpps_logits(tmp_path):
    """Llama-3.x's shape: its vocabulary, GQA, a tied head, theta 500000 and llama3 RoPE scaling
    (factor 32, as Llama-3.2 1B), written F32 by our export: llama.cpp reads the same model."""
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128256, multiple_of=32, max_seq_len=256,
                     rope_theta=500000.0, tie_embeddings=True, use_scaled_rope=True, rope_scaling_factor=32.0)
    model = Transformer(args).eval()
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(50)  # logits with a spread that decides greedy tokens
    path = export_gguf(model, tmp_path / "llama3.gguf", require(LLAMA3_TOKENIZER), "f32")
    loaded, peer = load_checkpoint(path), LlamaCpp(path, 256, threads=1)
    tokens = open_tokenizer(path).encode("The capital of France is Paris, and the capital of Italy is")
    largest, share = compare(peer.logits(tokens), loaded(torch.tensor([tokens]))[0])
    assert share < 1e-4, (largest, share)
    assert generate(loaded, [tokens], 32, temperature=0)[0] == peer.greedy(tokens, 32)


@pytest.mark.parametrize("type", ["F32", "Q8_0", "Q4_0"])
def test_evaluate_gives_llama_cpps_perplexity(gguf_run, files, tmp_path, type):
    """python -m llama_mini.evaluate on a GGUF file against llama-perplexity's method on
    llama.cpp's own tokens and logits: within 0.5% for F32 and Q8_0, and for Q4_0 within
    the standard error llama.cpp states."""
    from perplexity import llama_cpp_perplexity, ours

    path = files[type] if type in files else quantize_with_llama_cpp(files["F32"], tmp_path / "q4_0.gguf", type, pure=True, threads=1)
    text = tmp_path / "held-out.txt"
    text.write_text("\n\n".join(corpus.stories(40_000, seed=11)), encoding="utf-8")
    tally = ours(path, text, 128, 20)
    ppl, error, count = llama_cpp_perplexity(path, text.read_text(encoding="utf-8"), 128, threads=1, chunks=20)
    assert tally.count == count == 20 * 63
    print(f"{type}: llama_mini {tally.perplexity:.4f} ± {tally.error:.4f}, llama.cpp {ppl:.4f} ± {error:.4f}")
    if type == "Q4_0":
        assert abs(tally.perplexity - ppl) < error
    else:
        assert tally.perplexity == pytest.approx(ppl, rel=0.005)
