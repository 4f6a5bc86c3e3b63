"""Generation speed: llama_mini.generate against transformers' generate on the same weights.

Batch 1, greedy, the Llama shapes of llama2.c's 15M (dim 288, 6 layers, 6 heads) and 110M
(dim 768, 12 layers, 12 heads) models with Llama-2's 32000-token vocabulary, in float32
and bfloat16. The two run alternately, round after round, so the load from other processes
falls on both alike; the ratio is the median over rounds of their time for the same tokens.

Decoding one token reads every weight once (the embedding table aside: one row), so the
memory bandwidth bounds tokens/s at bandwidth / weight bytes. The bandwidth is measured in
the same rounds by copying as many bytes as the weights hold (bytes read + bytes written
per second: the same buffer size meets the same caches), and each result is printed as a
fraction of that bound.

    python bench/generate_speed.py                 # both sizes, fp32 and bf16
    python bench/generate_speed.py --compile       # llama_mini with torch.compile as well
    python bench/generate_speed.py --profile       # where a decoding step's time goes
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llama_mini import ModelArgs, Transformer, generate  # noqa: E402
from llama_mini.hf import hf_config_from_args, to_hf_state_dict  # noqa: E402

SIZES = {"15M": dict(dim=288, n_layers=6, n_heads=6), "110M": dict(dim=768, n_layers=12, n_heads=12)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def copy(n_bytes):
    """A copy of n_bytes, to time next to generation: it moves 2 * n_bytes (read + write)."""
    src = torch.ones(n_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decoding step reads: all but the embedding table, of which one row."""
    embedding = model.tok_embeddings.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - embedding.numel() * embedding.element_size() + embedding.shape[1] * embedding.element_size()


def build_pair(size, dtype):
    torch.manual_seed(0)
    ours = Transformer(ModelArgs(**SIZES[size], vocab_size=32000, max_seq_len=1024)).eval().to(dtype)
    import transformers

    config = transformers.LlamaConfig(**hf_config_from_args(ours.args))
    theirs = transformers.LlamaForCausalLM(config).eval().to(dtype)
    theirs.load_state_dict(to_hf_state_dict(ours.state_dict(), ours.args), strict=False)
    return ours, theirs


def run_ours(model, prompt, n):
    return generate(model, [prompt], n, temperature=0)[0]


@torch.inference_mode()
def run_theirs(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def measure(size, dtype_name, args):
    ours, theirs = build_pair(size, DTYPES[dtype_name])
    prompt = [1] + torch.randint(3, 32000, (15,), generator=torch.Generator().manual_seed(0)).tolist()
    runners = {"llama_mini": lambda: run_ours(ours, prompt, args.tokens), "transformers": lambda: run_theirs(theirs, prompt, args.tokens)}
    if args.compile:
        compiled = Transformer(ours.args).eval().to(DTYPES[dtype_name])
        compiled.load_state_dict(ours.state_dict())
        compiled.compile(dynamic=True)
        runners["llama_mini+compile"] = lambda: run_ours(compiled, prompt, args.tokens)
    n_bytes = weight_bytes_per_token(ours)
    runners["copy"] = copy(n_bytes)
    outputs = {name: run() for name, run in runners.items()}  # warm-up (and compilation)
    times = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    # Reading the weights once per token at the copy's rate takes half a copy's time.
    limit_s = statistics.median(times.pop("copy")) / 2
    bandwidth = 2 * n_bytes / (2 * limit_s)
    rows = []
    for name in times:
        ratio = statistics.median(t_hf / t for t, t_hf in zip(times[name], times["transformers"]))
        per_token = statistics.median(times[name]) / args.tokens
        same = outputs[name] == outputs["transformers"]
        rows.append((size, dtype_name, name, 1 / per_token, ratio, limit_s / per_token, n_bytes, bandwidth, same))
    return rows


def profile(size, dtype_name, tokens):
    from torch.profiler import ProfilerActivity, profile as torch_profile

    ours, _ = build_pair(size, DTYPES[dtype_name])
    run_ours(ours, [1, 2, 3], 8)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        run_ours(ours, [1, 2, 3], tokens)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--tokens", type=int, default=128, help="new tokens per generate call")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="also time llama_mini under torch.compile")
    p.add_argument("--profile", action="store_true", help="print a profile of llama_mini's decoding instead")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        return profile(args.sizes[0], args.dtypes[0], args.tokens)

    print(f"CPU threads: {torch.get_num_threads()}, {args.tokens} new tokens after a 16-token prompt, median of {args.rounds} rounds")
    print(f"{'model':>5} {'dtype':>5} {'implementation':>19} {'tok/s':>8} {'vs HF':>6} {'of BW limit':>11} {'same tokens':>11}   weights/token, copy bandwidth")
    for size in args.sizes:
        for dtype_name in args.dtypes:
            for size_, dt, name, tok_s, ratio, frac, n_bytes, bandwidth, same in measure(size, dtype_name, args):
                print(
                    f"{size_:>5} {dt:>5} {name:>19} {tok_s:8.1f} {ratio:5.2f}x {frac:10.0%} {str(same):>11}"
                    f"   {n_bytes / 1e6:.0f} MB, {bandwidth / 1e9:.1f} GB/s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
