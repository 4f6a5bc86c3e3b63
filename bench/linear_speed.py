"""The linear layers alone: llama_mini's CPU kernels against torch's F.linear, fp32 and bf16, on
the layer shapes of a model, for a decoding step and for prompts.

A model's time on a CPU is its linear layers' (attention is a small share below a few thousand
positions): this sets each of a 110M's or a 1B's seven layer shapes and its output head
(Llama-2's 32000-token vocabulary) against torch's own kernel for the same product, rows of
activations times a weight matrix, in the same interleaved rounds. Figures are GFLOP/s of the
whole model's layers at each row count (2 x rows x weights / time), medians over the rounds.

--off-kernels times instead the int8 and int4 layers as they run off the kernels (a GPU, a Mac,
an ARM CPU, --kernels off), in plain rows: eagerly each call dequantizes its weight, then
multiplies in float32; under torch.compile one row is a single pass over the codes. One row (a
decoding step) against F.linear on the float weights.

The instruction set is named on every line: the kernels' (LLAMA_MINI_ISA, default native) and
torch's (ATen's capability; MKL and oneDNN follow MKL_ENABLE_INSTRUCTIONS and
ONEDNN_MAX_CPU_ISA). To run both as a CPU with AVX2 and no AVX-512 would, on one with it:

    LLAMA_MINI_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python bench/linear_speed.py --sizes 110M 1B --threads 2

torch.compile (--off-kernels) writes its loops for ATen's capability too; give it a cache of its
own (TORCHINDUCTOR_CACHE_DIR=/tmp/avx2-cache): torch's compile cache does not tell the two apart,
and code cached for AVX-512 computes wrong numbers when run as AVX2.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from llama_mini.kernels import build, use_cpu_kernels  # noqa: E402
from llama_mini.kernels.operators import operators  # noqa: E402

# (output, input) of each weight matrix: wq, wk, wv, wo, w1, w2, w3, and the head.
SHAPES = {
    "110M": [(768, 768)] * 4 + [(2048, 768), (768, 2048), (2048, 768), (32000, 768)],
    "1B": [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (5632, 2048), (2048, 5632), (5632, 2048), (32000, 2048)],
}


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def as_held(weight: torch.Tensor) -> torch.Tensor:
    """weight as use_cpu_kernels holds it for the kernels: in panels of sixteen outputs."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return use_cpu_kernels(torch.nn.Sequential(linear))[0].weight


def off_kernels(sizes, rounds: int) -> None:
    """The integer layers off the kernels against F.linear on their float weights, one row."""
    from llama_mini.quant.layers import Int4Linear, Int8Linear

    torch._dynamo.config.recompile_limit = 64  # one graph per layer shape and type
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads, "
          f"off the kernels, one row; median of {rounds} rounds")
    for size in sizes:
        weights = [torch.randn(n, k, generator=g) for n, k in SHAPES[size]]
        xs = [torch.randn(1, w.shape[1], generator=g) for w in weights]
        runs = {"F.linear": [lambda x, w=w: F.linear(x, w) for w in weights]}
        for name, kind in (("int8", Int8Linear), ("int4", Int4Linear)):
            layers = [kind.from_weight(w) for w in weights]
            for layer in layers:
                layer.hold_plain_rows()  # as generate.py holds them off the kernels
            runs[name] = layers
            runs[f"{name} compiled"] = [torch.compile(layer) for layer in layers]
        runs["F.linear compiled"] = [torch.compile(lambda x, w=w: F.linear(x, w)) for w in weights]
        times = {name: [] for name in runs}
        with torch.inference_mode():
            for layers in runs.values():  # warm up, and compile
                for x, layer in zip(xs, layers):
                    layer(x)
            for _ in range(rounds):
                for name, layers in runs.items():
                    times[name].append(timed(lambda: [layer(x) for x, layer in zip(xs, layers)]))
        base = statistics.median(times["F.linear"])
        for name in runs:
            t = statistics.median(times[name])
            print(f"{size} {name:>18}: {t * 1e3:8.2f} ms a step, {base / t:5.2f}x F.linear's speed")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["110M", "1B"], choices=SHAPES)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 256, 1024])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's choice)")
    p.add_argument("--off-kernels", action="store_true", help="int8 and int4 off the kernels, eager and compiled, one row")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.off_kernels:
        return off_kernels(args.sizes, args.rounds)
    ops = operators()
    if ops is None:
        sys.exit("no CPU kernels here (they need x86-64 with AVX2 and FMA)")
    isa = build.isa()
    torch_isa = (f"{torch.backends.cpu.get_cpu_capability()}, MKL {os.environ.get('MKL_ENABLE_INSTRUCTIONS', 'its best')}, "
                 f"oneDNN {os.environ.get('ONEDNN_MAX_CPU_ISA', 'its best')}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; kernels built for {isa}; torch: {torch_isa}; "
          f"median of {args.rounds} rounds")
    g = torch.Generator().manual_seed(0)
    for size in args.sizes:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            weights = [torch.randn(n, k, generator=g).to(dtype) for n, k in SHAPES[size]]
            held = [as_held(w) for w in weights]
            for rows in args.rows:
                xs = [torch.randn(rows, w.shape[1], generator=g).to(dtype) for w in weights]
                reps = 10 if rows == 1 else 1
                times = {"kernels": [], "F.linear": []}
                with torch.inference_mode():
                    for (name, f), ws in zip((("kernels", ops.linear_dense), ("F.linear", F.linear)), (held, weights)):  # warm up
                        for x, w in zip(xs, ws):
                            f(x, w)
                    for _ in range(args.rounds):
                        for (name, f), ws in zip((("kernels", ops.linear_dense), ("F.linear", F.linear)), (held, weights)):
                            times[name].append(timed(lambda: [f(x, w) for _ in range(reps) for x, w in zip(xs, ws)]) / reps)
                flops = sum(2 * rows * w.numel() for w in weights)
                ours, theirs = (statistics.median(times[name]) for name in ("kernels", "F.linear"))
                print(f"{size} {dtype_name:>8} {rows:5} rows: kernels ({isa}) {flops / ours / 1e9:7.1f} GFLOP/s, "
                      f"F.linear ({torch_isa}) {flops / theirs / 1e9:7.1f} GFLOP/s, kernels / F.linear {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
