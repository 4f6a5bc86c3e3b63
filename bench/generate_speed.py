"""Generation speed: llama_mini (fp32, bf16, int8, int4) against transformers and llama.cpp on the same weights.

Batch 1, greedy, random weights of a Llama shape with Llama-2's 32000-token vocabulary:
llama2.c's 15M and 110M, and a 1B of Llama-3.2 1B's shape (dim 2048, 16 layers, 32 heads
with 8 KV heads, hidden 5632). llama_mini's int8 and int4 (llama_mini/quant/) run with
bf16 activations, the dtype torch's weight-only kernels are fast with. llama.cpp, when
llama-cpp-python is installed, runs the same weights exported through llama_mini/formats/gguf.py
as F32, BF16, Q8_0 and Q4_0; the export needs the Llama-2 tokenizer.model (--tokenizer).

Every implementation runs once per round, in the same order, round after round, so the load
from other processes falls on all alike; figures are medians over rounds. Each round times a
generate call that reads a 16-token prompt and decodes --tokens tokens, and one that decodes
a single token: their difference is the decoding phase alone (llama.cpp keeps the prompt's
cache between calls, the others read the prompt again; the difference is fair to both).

Decoding one token reads every weight once (the embedding table aside: one row), so the
memory bandwidth bounds tokens/s at bandwidth / weight bytes. The bandwidth is measured in
the same rounds by copying as many bytes as the fp32 weights hold (bytes read + bytes written
per second), and each result is printed as a share of its own bound ("of bound").

    python bench/generate_speed.py --sizes 110M 1B     # against llama.cpp at the same bytes per weight
    python bench/generate_speed.py --quick             # a tiny shape, 1 round: checks that it all runs
    python bench/generate_speed.py --compile           # llama_mini with torch.compile as well
    python bench/generate_speed.py --profile           # where a decoding step's time goes
"""

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from llama_mini import ModelArgs, Transformer, generate  # noqa: E402
from llama_mini.formats.hf import hf_config_from_args, to_hf_state_dict  # noqa: E402
from llama_mini.kernels import use_fused_rmsnorm, use_matvec  # noqa: E402
from llama_mini.model import KVCache  # noqa: E402
from llama_mini.quant import quantize  # noqa: E402

SIZES = {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, multiple_of=32),
    "15M": dict(dim=288, n_layers=6, n_heads=6),
    "110M": dict(dim=768, n_layers=12, n_heads=12),
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=5632),
}
VARIANTS = ("fp32", "bf16", "int8", "int4")  # llama_mini's
TRANSFORMERS = {"fp32": torch.float32, "bf16": torch.bfloat16}
LLAMA_CPP = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # the GGUF type of matching bytes per weight
LLAMA2_TOKENIZER = ROOT.parent / "shared" / "fixtures" / "llama2-tokenizer.model"


COPY_BYTES = 1 << 29  # far past the last-level cache, and small beside the models


def copy_runner(n_bytes=COPY_BYTES):
    """A copy of n_bytes, to time next to generation: it moves 2 * n_bytes (read + write)."""
    src = torch.ones(n_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decoding step reads: every parameter and buffer (a quantized layer
    holds only the layout its kernel reads), the embedding table aside, of which one row."""
    tensors = [t for m in model.modules() if not isinstance(m, KVCache)
               for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]
    embedding = model.tok_embeddings.weight
    total = sum(t.numel() * t.element_size() for t in tensors)
    return total - (embedding.shape[0] - 1) * embedding.shape[1] * embedding.element_size()


def llama_mini_variants(base: Transformer) -> dict:
    """fp32 (base itself), bf16, int8 and int4 (quantized from base's fp32 weights) models, on
    the decoding kernels, as generate.py runs them. No more copies than that: at 1B, every
    implementation's models together nearly fill a 24 GiB machine."""
    variants = {"bf16": copy.deepcopy(base).to(torch.bfloat16),
                "int8": quantize(copy.deepcopy(base), "int8").to(torch.bfloat16),
                "int4": quantize(copy.deepcopy(base), "int4").to(torch.bfloat16)}
    return {name: use_matvec(use_fused_rmsnorm(model)) for name, model in {"fp32": base, **variants}.items()}  # as generate.py does


def transformers_model(base: Transformer, dtype):
    import transformers

    config = transformers.LlamaConfig(**hf_config_from_args(base.args))
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.load_state_dict(to_hf_state_dict(base.state_dict(), base.args), strict=False)
    return theirs.to(dtype)


def llama_cpp_models(base: Transformer, tokenizer, folder: Path, threads: int) -> dict:
    """{variant: (llama_cpp.Llama, weight bytes per token)} on GGUF exports of base; {} without llama_cpp."""
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp is not importable: llama.cpp is left out (pip install llama-cpp-python)", file=sys.stderr)
        return {}
    if tokenizer is None or not Path(tokenizer).is_file():
        print("no Llama-2 tokenizer.model (--tokenizer): llama.cpp is left out", file=sys.stderr)
        return {}
    import gguf
    from llama_mini.formats.gguf import export_gguf

    models = {}
    for variant, type in LLAMA_CPP.items():
        path = export_gguf(base, folder / f"{type}.gguf", tokenizer, type)
        tensors = gguf.GGUFReader(path).tensors
        n_bytes = sum(int(t.n_bytes) for t in tensors)
        embd = next(t for t in tensors if t.name == "token_embd.weight")
        n_bytes -= int(embd.n_bytes) * (base.args.vocab_size - 1) // base.args.vocab_size
        models[variant] = (llama_cpp.Llama(model_path=str(path), n_ctx=base.args.max_seq_len, n_threads=threads,
                                           verbose=False), n_bytes)
    return models


def run_ours(model, prompt, n):
    return generate(model, [prompt], n, temperature=0)[0]


@torch.inference_mode()
def run_transformers(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run_llama_cpp(llm, prompt, n):
    out = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        out.append(token)
        if len(out) == n:
            return out
    return out


def runners(size, args, folder):
    """{name: (run(n), weight bytes per token)} for every implementation and variant at this size."""
    torch.manual_seed(0)
    base = Transformer(ModelArgs(**SIZES[size], vocab_size=32000, max_seq_len=1024)).eval()
    prompt = [1] + torch.randint(3, 32000, (15,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    for variant, model in llama_mini_variants(base).items():
        out[f"llama_mini {variant}"] = (lambda n, m=model: run_ours(m, prompt, n), weight_bytes_per_token(model))
        if args.compile:
            compiled = copy.deepcopy(model)
            compiled.compile(dynamic=True)
            out[f"llama_mini+compile {variant}"] = (lambda n, m=compiled: run_ours(m, prompt, n), weight_bytes_per_token(model))
    for variant, dtype in TRANSFORMERS.items():
        theirs = transformers_model(base, dtype)
        out[f"transformers {variant}"] = (lambda n, m=theirs: run_transformers(m, prompt, n), weight_bytes_per_token(base) // (4 // dtype.itemsize))
    for variant, (llm, n_bytes) in llama_cpp_models(base, args.tokenizer, folder, torch.get_num_threads()).items():
        out[f"llama.cpp {LLAMA_CPP[variant]}"] = (lambda n, m=llm: run_llama_cpp(m, prompt, n), n_bytes)
    return out


def timed(run, n) -> float:
    start = time.perf_counter()
    run(n)
    return time.perf_counter() - start


def measure(size, args):
    """Rows (name, decoding tok/s, of bound, weight bytes, tokens) for one size, interleaved over rounds."""
    with tempfile.TemporaryDirectory() as folder:
        copy = copy_runner()
        copy()  # its pages are touched before any timing
        runs = runners(size, args, Path(folder))
        tokens = {name: run(args.tokens) for name, (run, _) in runs.items()}  # warm-up (and compilation)
        times = {name: ([], []) for name in runs}
        copy_times = []
        for _ in range(args.rounds):
            for name, (run, _) in runs.items():
                times[name][0].append(timed(run, args.tokens))
                times[name][1].append(timed(run, 1))
            copy_times.append(timed(lambda n: copy(), 0))
    bandwidth = 2 * COPY_BYTES / statistics.median(copy_times)  # bytes moved (read + write) per second
    rows = []
    for name, (_, n_bytes) in runs.items():
        decoding = statistics.median(times[name][0]) - statistics.median(times[name][1])
        tok_s = (args.tokens - 1) / decoding
        rows.append((name, tok_s, tok_s / (bandwidth / n_bytes), n_bytes, tokens[name]))
    return rows, bandwidth


def print_size(size, rows, bandwidth):
    by_name = {row[0]: row for row in rows}
    reference = by_name["llama_mini fp32"][4]
    print(f"\n{size}: copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'implementation':>24} {'tok/s':>8} {'of bound':>8} {'MB/token':>9} {'same tokens as llama_mini fp32':>31}")
    for name, tok_s, share, n_bytes, tokens in rows:
        same = sum(a == b for a, b in zip(tokens, reference))
        print(f"{name:>24} {tok_s:8.1f} {share:8.0%} {n_bytes / 1e6:9.1f} {same:>27}/{len(reference)}")
    print("ratios of tokens/s:")
    for variant in VARIANTS:
        ours = by_name[f"llama_mini {variant}"][1]
        for other in (f"transformers {variant}", f"llama.cpp {LLAMA_CPP[variant]}", "llama_mini bf16"):
            if other in by_name and other != f"llama_mini {variant}":
                print(f"  llama_mini {variant} / {other}: {ours / by_name[other][1]:.2f}x")


def profile(size, tokens):
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.manual_seed(0)
    ours = Transformer(ModelArgs(**SIZES[size], vocab_size=32000, max_seq_len=1024)).eval()
    run_ours(ours, [1, 2, 3], 8)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        run_ours(ours, [1, 2, 3], tokens)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["110M", "1B"], choices=SIZES)
    p.add_argument("--tokens", type=int, default=128, help="new tokens per generate call")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="the tiny shape, 8 tokens, 1 round: checks that everything runs")
    p.add_argument("--compile", action="store_true", help="also time llama_mini under torch.compile")
    p.add_argument("--profile", action="store_true", help="print a profile of llama_mini's fp32 decoding instead")
    p.add_argument("--threads", type=int, help="torch and llama.cpp CPU threads (default: torch's choice)")
    p.add_argument("--tokenizer", default=LLAMA2_TOKENIZER, help="Llama-2 tokenizer.model, for the GGUF export llama.cpp reads")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.tokens, args.rounds = ["tiny"], 8, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        return profile(args.sizes[0], args.tokens)
    print(f"CPU threads: {torch.get_num_threads()}, {args.tokens} new tokens after a 16-token prompt, median of {args.rounds} rounds")
    for size in args.sizes:
        rows, bandwidth = measure(size, args)
        print_size(size, rows, bandwidth)


if __name__ == "__main__":
    main()
