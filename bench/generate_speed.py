"""Generation speed: llama_mini (fp32, bf16, int8, int4) against transformers and llama.cpp on the same weights.

Batch 1, greedy, random weights of a Llama shape with Llama-2's 32000-token vocabulary:
llama2.c's 15M and 110M, and a 1B of Llama-3.2 1B's shape (dim 2048, 16 layers, 32 heads
with 8 KV heads, hidden 5632). llama_mini runs as generate.py runs it, on its CPU kernels;
its int8 and int4 (llama_mini/quant/) hold bf16 scales and a bf16 KV cache, as llama.cpp's
Q8_0 and Q4_0 hold fp16 ones. llama.cpp, when llama-cpp-python is installed, runs the same
weights exported through llama_mini/formats/gguf.py as F32, BF16, Q8_0 and Q4_0; the export
needs the Llama-2 tokenizer.model (--tokenizer).

Every implementation runs once per round, in the same order, round after round, so the load
from other processes falls on all alike; figures are medians over rounds. Each round times,
for each implementation:
- decoding: a generate call that reads a 16-token prompt and decodes --tokens tokens, less one
  that decodes a single token: the decoding phase alone (llama.cpp keeps the prompt's cache
  between calls, the others read the prompt again; the difference is fair to both);
- prefill: the time to the first token of each of --prompt-lengths (the prompt read, one
  token sampled), and prompt tokens / that time.
At 1B, decoding far into the context (--positions) is timed after the others: the cache filled
with that many tokens once, then --steps decoding steps from there, round after round.

Decoding one token reads every weight once (the embedding table aside: one row), so the
memory bandwidth bounds tokens/s at bandwidth / weight bytes. The bandwidth is measured in
the same rounds by copying as many bytes as the fp32 weights hold (bytes read + bytes written
per second), and each result is printed as a share of its own bound ("of bound"). The logits'
error is the rms of their difference from the plain fp32 model's over a 256-token prompt,
divided by the latter's std.

    python bench/generate_speed.py --sizes 110M 1B     # against llama.cpp at the same bytes per weight
    python bench/generate_speed.py --quick             # a tiny shape, 1 round: checks that it all runs
    python bench/generate_speed.py --compile           # llama_mini with torch.compile as well
    python bench/generate_speed.py --kernels off --compile --no-peers   # llama_mini off its kernels, eager and compiled
    python bench/generate_speed.py --profile           # where a decoding step's time goes
    python bench/generate_speed.py --gguf FILE ...      # a user's GGUF files, llama_mini and llama.cpp on each
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
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/fixtures.py: where the shared fixtures are
from fixtures import LLAMA2_TOKENIZER  # noqa: E402
from llama_mini import ModelArgs, Transformer, generate  # noqa: E402
from llama_mini.generation import decode_one_token  # noqa: E402
from llama_mini.formats.hf import hf_config_from_args, to_hf_state_dict  # noqa: E402
from llama_mini.kernels import use_fused_rmsnorm, use_cpu_kernels  # noqa: E402
from llama_mini.model import KVCache  # noqa: E402
from llama_mini.quant import hold_plain_rows, quantize  # noqa: E402

SIZES = {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, multiple_of=32),
    "15M": dict(dim=288, n_layers=6, n_heads=6),
    "110M": dict(dim=768, n_layers=12, n_heads=12),
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=5632),
}
VARIANTS = ("fp32", "bf16", "int8", "int4")  # llama_mini's
TRANSFORMERS = {"fp32": torch.float32, "bf16": torch.bfloat16}
LLAMA_CPP = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # the GGUF type of matching bytes per weight


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


def llama_mini_variants(base: Transformer, kernels: bool = True) -> dict:
    """fp32 (base itself), bf16, int8 and int4 (quantized from base's fp32 weights) models, on
    the CPU kernels, as generate.py runs them (kernels=False: model.py's own code and the integer
    layers', as generate.py --kernels off and every machine without the kernels run them). No more
    copies than that: at 1B, every implementation's models together nearly fill a 24 GiB machine."""
    variants = {"bf16": copy.deepcopy(base).to(torch.bfloat16),
                "int8": quantize(copy.deepcopy(base), "int8").to(torch.bfloat16),
                "int4": quantize(copy.deepcopy(base), "int4").to(torch.bfloat16)}
    models = {"fp32": base, **variants}
    return {name: use_cpu_kernels(use_fused_rmsnorm(model)) if kernels else hold_plain_rows(model) for name, model in models.items()}


def transformers_model(base: Transformer, dtype):
    import transformers

    config = transformers.LlamaConfig(**hf_config_from_args(base.args))
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.load_state_dict(to_hf_state_dict(base.state_dict(), base.args), strict=False)
    return theirs.to(dtype)


def llama_cpp_models(base: Transformer, tokenizer, folder: Path, threads: int) -> dict:
    """{variant: (llama_cpp.Llama, weight bytes per token, GGUF path)} on GGUF exports of base; {} without llama_cpp."""
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
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=base.args.max_seq_len, n_threads=threads,
                              n_threads_batch=threads, verbose=False)
        models[variant] = (llm, n_bytes, path)
    return models


def run_ours(model, prompt, n):
    return generate(model, [prompt], n, temperature=0)[0]


@torch.inference_mode()
def logits_ours(model, prompt):
    return model(torch.tensor([prompt]))[0].float()


@torch.inference_mode()
def run_transformers(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def logits_transformers(model, prompt):
    return model(torch.tensor([prompt])).logits[0].float()


def run_llama_cpp(llm, prompt, n):
    out = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        out.append(token)
        if len(out) == n:
            return out
    return out


def logits_llama_cpp(path, prompt, threads):
    """llama.cpp's logits at every position of prompt, from an instance that keeps them all."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt), n_batch=len(prompt), n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    llm.eval(prompt)
    logits = torch.from_numpy(llm.scores[:len(prompt)].copy())
    llm.close()
    return logits


# --- Decoding far into a context --------------------------------------------------------------


class OursFar:
    """llama_mini decoding far into a context: fill_to(p) reads prompt[:p] into the KV cache (after
    what it already holds), decode(n) times n decoding steps from there."""

    def __init__(self, model, prompt, longest):
        self.model, self.prompt, self.done = model, prompt, 0
        model.setup_cache(1, longest)

    @torch.inference_mode()
    def fill_to(self, position):
        for start in range(self.done, position, 512):
            self.model(torch.tensor([self.prompt[start:min(position, start + 512)]]), start, last_only=True)
        self.done = position

    @torch.inference_mode()
    def decode(self, n):
        token = torch.tensor([self.prompt[:1]])
        for i in range(n):
            decode_one_token(self.model, token, self.done + i)


class LlamaCppFar:
    """OursFar for llama.cpp."""

    def __init__(self, llm, prompt):
        self.llm, self.prompt, self.done = llm, prompt, 0
        llm.reset()

    def fill_to(self, position):
        self.llm.n_tokens = self.done  # eval drops what the last decode steps added after it
        self.llm.eval(self.prompt[self.done:position])
        self.done = position

    def decode(self, n):
        self.llm.n_tokens = self.done
        for _ in range(n):
            self.llm.eval(self.prompt[:1])


# --- The rounds -------------------------------------------------------------------------------


class Implementation:
    """One implementation and variant: generate(prompt, n) -> tokens, logits(prompt) -> (T, vocab),
    far(prompt, longest) -> OursFar or LlamaCppFar (or None), weight bytes per token."""

    def __init__(self, generate, logits, n_bytes, far=None):
        self.generate, self.logits, self.n_bytes, self.far = generate, logits, n_bytes, far
        self.f32_error = None  # llama_mini int8 / int4: the logits' error with float32 activations


def logits_error(logits, expected) -> float:
    """rms of the logits' difference from the expected ones, over the latter's std."""
    return ((logits - expected).pow(2).mean().sqrt() / expected.std()).item()


def float32_activation_errors(base, prompt, expected) -> dict:
    """{method: logits error} of int8 and int4 run as llama.cpp runs Q8_0 and Q4_0: float32
    activations and 16-bit scales (bf16 here, fp16 there), the same bytes per weight."""
    errors = {}
    for method in ("int8", "int4"):
        model = quantize(copy.deepcopy(base), method)
        for module in model.modules():
            for name in ("scales", "offsets"):
                if isinstance(getattr(module, name, None), torch.Tensor):
                    setattr(module, name, getattr(module, name).bfloat16())
        errors[method] = logits_error(logits_ours(use_cpu_kernels(use_fused_rmsnorm(model)), prompt), expected)
    return errors


def implementations(size, args, folder, max_seq_len, quality_prompt):
    """{name: Implementation} for every implementation and variant at this size, and the plain
    fp32 model's logits for quality_prompt (the reference of the error column), or None."""
    torch.manual_seed(0)
    base = Transformer(ModelArgs(**SIZES[size], vocab_size=32000, max_seq_len=max_seq_len)).eval()
    expected = logits_ours(base, quality_prompt) if args.quality else None  # before the kernels
    out = {}
    if expected is not None:
        for method, error in float32_activation_errors(base, quality_prompt, expected).items():
            out[f"llama_mini {method}"] = error
    f32_errors, out = out, {}
    for variant, model in llama_mini_variants(base, args.kernels == "auto").items():
        out[f"llama_mini {variant}"] = Implementation(
            lambda p, n, m=model: run_ours(m, p, n), lambda p, m=model: logits_ours(m, p), weight_bytes_per_token(model),
            lambda p, longest, m=model: OursFar(m, p, longest))
        out[f"llama_mini {variant}"].f32_error = f32_errors.get(f"llama_mini {variant}")
        if args.compile:
            # Each variant compiles its own graphs (a decoding step, a prompt, a logits call) from the
            # one Transformer.forward; dynamo's default of 8 per function would leave the last ones eager.
            torch._dynamo.config.recompile_limit = 64
            compiled = copy.deepcopy(model)
            compiled.compile(dynamic=True)
            out[f"llama_mini+compile {variant}"] = Implementation(
                lambda p, n, m=compiled: run_ours(m, p, n), lambda p, m=compiled: logits_ours(m, p), weight_bytes_per_token(model))
    if not args.peers:
        return out, expected
    for variant, dtype in TRANSFORMERS.items():
        theirs = transformers_model(base, dtype)
        out[f"transformers {variant}"] = Implementation(
            lambda p, n, m=theirs: run_transformers(m, p, n), lambda p, m=theirs: logits_transformers(m, p),
            weight_bytes_per_token(base) // (4 // dtype.itemsize))
    threads = torch.get_num_threads()
    for variant, (llm, n_bytes, path) in llama_cpp_models(base, args.tokenizer, folder, threads).items():
        out[f"llama.cpp {LLAMA_CPP[variant]}"] = Implementation(
            lambda p, n, m=llm: run_llama_cpp(m, p, n), lambda p, path=path: logits_llama_cpp(path, p, threads), n_bytes,
            lambda p, longest, m=llm: LlamaCppFar(m, p))
    return out, expected


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(size, args):
    """Rows (name, figures) for one size, and the copy bandwidth; every implementation runs in
    turn, round after round."""
    prompt_lengths = sorted(args.prompt_lengths)
    longest = max(prompt_lengths + [p + args.steps for p in args.positions if size == "1B"] + [16 + args.tokens])
    tokens = torch.randint(3, 32000, (longest,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = [1] + tokens[:15]
    with tempfile.TemporaryDirectory() as folder:
        copy = copy_runner()
        copy()  # its pages are touched before any timing
        impls, expected = implementations(size, args, Path(folder), longest + 1, tokens[:256])
        rows = {name: {"n_bytes": impl.n_bytes, "tokens": impl.generate(prompt, args.tokens)} for name, impl in impls.items()}
        if expected is not None:  # the logits' error against the plain fp32 model's, over a prompt
            for name, impl in impls.items():
                rows[name]["error"] = logits_error(impl.logits(tokens[:256]), expected)
                if impl.f32_error is not None:
                    rows[name]["f32 error"] = impl.f32_error
        times = {name: {"decode": [], "one": [], **{length: [] for length in prompt_lengths}} for name in impls}
        copy_times = []
        for _ in range(args.rounds):
            for name, impl in impls.items():
                times[name]["decode"].append(timed(lambda: impl.generate(prompt, args.tokens)))
                times[name]["one"].append(timed(lambda: impl.generate(prompt, 1)))
                for length in prompt_lengths:  # time to first token: the prompt read, one token sampled
                    times[name][length].append(timed(lambda: impl.generate(tokens[:length], 1)))
            copy_times.append(timed(copy))
        if size == "1B" and args.positions:
            measure_far_positions(impls, tokens, args, rows)
    bandwidth = 2 * COPY_BYTES / statistics.median(copy_times)  # bytes moved (read + write) per second
    for name, row in rows.items():
        decoding = statistics.median(times[name]["decode"]) - statistics.median(times[name]["one"])
        row["decode"] = (args.tokens - 1) / decoding
        row["of bound"] = row["decode"] / (bandwidth / row["n_bytes"])
        for length in prompt_lengths:
            row[length] = statistics.median(times[name][length])
    return rows, bandwidth


def measure_far_positions(impls, tokens, args, rows):
    """Decoding tokens/s at each of args.positions, llama_mini's against llama.cpp's, round after
    round; the caches filled to each position in turn."""
    wanted = args.position_variants + [LLAMA_CPP[v] for v in args.position_variants]
    fars = {name: impl.far(tokens, max(args.positions) + args.steps + 1) for name, impl in impls.items()
            if impl.far is not None and name.split()[1] in wanted}
    for position in sorted(args.positions):
        times = {name: [] for name in fars}
        for far in fars.values():
            far.fill_to(position)
        for _ in range(args.rounds):
            for name, far in fars.items():
                times[name].append(timed(lambda: far.decode(args.steps)))
        for name, t in times.items():
            rows[name][f"at {position}"] = args.steps / statistics.median(t)


def print_size(size, rows, bandwidth, args):
    reference = rows["llama_mini fp32"]["tokens"]
    lengths = sorted(args.prompt_lengths)
    print(f"\n{size}: copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    header = f"{'implementation':>24} {'decode tok/s':>12} {'of bound':>8} {'MB/token':>9}"
    header += "".join(f" {f'prefill {n} tok/s':>18} {f'first token {n}':>16}" for n in lengths)
    header += f" {'logits error':>12} {'(f32 activations)':>17} {'same tokens as llama_mini fp32':>31}"
    print(header)
    for name, row in rows.items():
        same = sum(a == b for a, b in zip(row["tokens"], reference))
        line = f"{name:>24} {row['decode']:12.1f} {row['of bound']:8.0%} {row['n_bytes'] / 1e6:9.1f}"
        line += "".join(f" {n / row[n]:18.1f} {row[n]:15.2f}s" for n in lengths)
        line += f" {row['error']:12.4f}" if "error" in row else f" {'':>12}"
        line += f" {row['f32 error']:17.4f}" if "f32 error" in row else f" {'':>17}"
        print(line + f" {same:>27}/{len(reference)}")
    for ours in ("llama_mini", "llama_mini+compile"):
        if f"{ours} fp32" in rows:
            fp32 = rows[f"{ours} fp32"]["decode"]
            print(f"decoding, {ours} / its fp32: " + ", ".join(
                f"{variant} {rows[f'{ours} {variant}']['decode'] / fp32:.2f}x" for variant in VARIANTS[1:]))
    print("ratios, llama_mini / llama.cpp at the same bytes per weight (and / transformers):")
    for variant in VARIANTS:
        ours = rows[f"llama_mini {variant}"]
        for other in (f"llama.cpp {LLAMA_CPP[variant]}", f"transformers {variant}"):
            if other in rows:
                theirs = rows[other]
                figures = [f"decode {ours['decode'] / theirs['decode']:.2f}x"]
                figures += [f"prefill {n} {theirs[n] / ours[n]:.2f}x" for n in lengths]
                figures += [f"decode at {p} {ours[f'at {p}'] / theirs[f'at {p}']:.2f}x" for p in args.positions
                            if f"at {p}" in ours and f"at {p}" in theirs]
                print(f"  llama_mini {variant} / {other}: " + ", ".join(figures))
    far = [(name, p, row[f"at {p}"]) for name, row in rows.items() for p in args.positions if f"at {p}" in row]
    if far:
        print("decoding tok/s far into the context:")
        for name, p, tok_s in far:
            print(f"  {name:>24} at position {p}: {tok_s:.1f}")


def profile(size, tokens):
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.manual_seed(0)
    ours = Transformer(ModelArgs(**SIZES[size], vocab_size=32000, max_seq_len=1024)).eval()
    run_ours(ours, [1, 2, 3], 8)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        run_ours(ours, [1, 2, 3], tokens)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def instruction_sets() -> str:
    """The instruction set each implementation runs with, to name beside every figure."""
    from llama_mini.kernels import build

    line = f"llama_mini's kernels built for {build.isa()} (LLAMA_MINI_ISA); torch: {torch.backends.cpu.get_cpu_capability()}"
    try:
        import llama_cpp

        features = [f.split("=")[0].strip() for f in llama_cpp.llama_print_system_info().decode().split("|") if f.strip().endswith("= 1")]
        line += f"; llama.cpp {llama_cpp.__version__}: {' '.join(features)}"
    except ImportError:
        pass
    return line


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["110M", "1B"], choices=SIZES)
    p.add_argument("--tokens", type=int, default=128, help="new tokens per generate call")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[256, 1024], help="prompts whose first token is timed")
    p.add_argument("--positions", type=int, nargs="*", default=[1000, 4000], help="1B: decoding timed this far into the context")
    p.add_argument("--position-variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--steps", type=int, default=32, help="decoding steps timed at each of --positions")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-quality", dest="quality", action="store_false", help="skip the logits' error against fp32")
    p.add_argument("--quick", action="store_true", help="the tiny shape, 8 tokens, 1 round: checks that everything runs")
    p.add_argument("--compile", action="store_true", help="also time llama_mini under torch.compile")
    p.add_argument("--kernels", choices=("auto", "off"), default="auto",
                   help="off: llama_mini without its CPU kernels, as on a GPU, a Mac or a CPU without AVX2")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="llama_mini alone: no transformers, no llama.cpp")
    p.add_argument("--profile", action="store_true", help="print a profile of llama_mini's fp32 decoding instead")
    p.add_argument("--threads", type=int, help="torch and llama.cpp CPU threads (default: torch's choice)")
    p.add_argument("--tokenizer", default=LLAMA2_TOKENIZER, help="Llama-2 tokenizer.model, for the GGUF export llama.cpp reads")
    p.add_argument("--gguf", nargs="+", type=Path, metavar="FILE",
                   help="GGUF files instead, each run by llama_mini and by llama.cpp side by side (bench/gguf_speed.py)")
    args = p.parse_args()
    if args.gguf:
        import gguf_speed
        threads = ["--threads", str(args.threads)] if args.threads else []
        for length in args.prompt_lengths:
            gguf_speed.main([*map(str, args.gguf), "--prompt", str(length), "--new", str(args.tokens), "--rounds", str(args.rounds),
                             *threads])
        return
    if args.quick:
        args.sizes, args.tokens, args.rounds, args.prompt_lengths, args.positions = ["tiny"], 8, 1, [64], []
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        return profile(args.sizes[0], args.tokens)
    print(f"CPU threads: {torch.get_num_threads()}; decoding: {args.tokens} new tokens after a 16-token prompt; "
          f"prefill: prompts of {', '.join(map(str, sorted(args.prompt_lengths)))} tokens; median of {args.rounds} rounds")
    print(instruction_sets())
    for size in args.sizes:
        rows, bandwidth = measure(size, args)
        print_size(size, rows, bandwidth, args)


if __name__ == "__main__":
    main()
