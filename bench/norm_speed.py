"""Normalisation speed: reference RMSNorm, torch.nn.RMSNorm, fused RMSNorm, nn.LayerNorm.

For each shape and dtype the four implementations run interleaved, in a random order each
round, so the load from other processes falls on all of them alike; each round's time is
divided by nn.LayerNorm's time in the same round and the median ratio is printed. GB/s
counts the bytes a fused kernel must move (forward: read x, write y; backward: read x and
dy, write dx) and is printed beside a memory copy measured the same way: a copy into a
preallocated tensor (the bandwidth ceiling) and a clone (which, like every op here, also
pays for the fresh pages of its output: on CPU, for outputs of tens of MB, that costs
more than the arithmetic).

    python bench/norm_speed.py --quick        # hidden 4096, 4096 tokens only
    python bench/norm_speed.py                # hidden 512-8192 x 1k-32k tokens
"""

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llama_mini import RMSNorm  # noqa: E402
from llama_mini.kernels import build, fused_rmsnorm, use_fused_rmsnorm  # noqa: E402

EPS = 1e-5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def implementations(dim, dtype, device):
    """name -> module, all with the same weight; LayerNorm's bias is zero as at init."""
    impls = {
        "reference": RMSNorm(dim, EPS),
        "nn.RMSNorm": nn.RMSNorm(dim, eps=EPS),
        "fused": nn.Sequential(RMSNorm(dim, EPS)),  # a model of one norm, for use_fused_rmsnorm to apply to
        "nn.LayerNorm": nn.LayerNorm(dim, eps=EPS),
    }
    impls = {name: m.to(device=device, dtype=dtype) for name, m in impls.items()}
    impls["fused"] = use_fused_rmsnorm(impls["fused"], fallback=False)[0]
    return impls


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def forward_fn(module, x):
    def run():
        with torch.no_grad():
            module(x)

    return run


def forward_backward_fn(module, x, dy):
    inputs = (x, *module.parameters())

    def run():
        torch.autograd.grad(module(x), inputs, dy)

    return run


def interleaved(fns: dict, rounds: int, device) -> dict:
    """name -> list of times, one per round, in a fresh random order each round: what ran
    just before (its freed memory, its cache footprint) changes the next op's time, so no
    implementation may always follow the same neighbour."""
    for fn in fns.values():  # warm-up: page in weights, build kernels, fill caches
        fn()
    times = {name: [] for name in fns}
    order, rng = list(fns), random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            times[name].append(timed(fns[name], device))
    return times


def ratio_to(times: dict, baseline: str) -> dict:
    """Median over rounds of each implementation's time / the baseline's in that round."""
    return {name: statistics.median(t / b for t, b in zip(ts, times[baseline])) for name, ts in times.items()}


def copy_bandwidth(x, rounds, device) -> tuple:
    """GB/s of x.copy into a preallocated tensor, and of x.clone() (fresh pages)."""
    out = torch.empty_like(x)
    times = interleaved({"copy": lambda: out.copy_(x), "clone": lambda: x.clone()}, rounds, device)
    return tuple(2 * x.nbytes / statistics.median(times[k]) / 1e9 for k in ("copy", "clone"))


def rounds_for(n_bytes: int, quick: bool) -> int:
    """More rounds for small shapes, where one round is short and noise is relatively larger."""
    rounds = max(7, min(41, int(4e9 / max(n_bytes, 1))))
    return min(rounds, 21) if quick else rounds


def bench_shape(tokens, dim, dtype, device, rounds):
    torch.manual_seed(0)
    x = torch.randn(tokens, dim, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    xg = x.clone().requires_grad_()
    impls = implementations(dim, dtype, device)
    copy_gbs, clone_gbs = copy_bandwidth(x, rounds, device)
    rows = []
    for mode, bytes_moved in (("fwd", 2 * x.nbytes), ("fwd+bwd", 5 * x.nbytes)):
        if mode == "fwd":
            fns = {name: forward_fn(m, x) for name, m in impls.items()}
        else:
            fns = {name: forward_backward_fn(m, xg, dy) for name, m in impls.items()}
        times = interleaved(fns, rounds, device)
        ratios = ratio_to(times, "nn.LayerNorm")
        median = {name: statistics.median(ts) for name, ts in times.items()}
        rows.append(dict(mode=mode, ratios=ratios, median=median, gbs={n: bytes_moved / t / 1e9 for n, t in median.items()}))
    return rows, copy_gbs, clone_gbs


def report_kernel(rebuild: bool) -> None:
    """Say what the CPU kernel cost to get: a compile now, or a load from the cache."""
    try:
        cached = build.library_path().is_file() and not rebuild
        start = time.perf_counter()
        if not cached:
            build.build(force=True)
        built = time.perf_counter() - start
    except RuntimeError as e:
        sys.exit(f"error: fused RMSNorm kernel unavailable: {e}")
    kernel, why = fused_rmsnorm.cpu_kernel()
    if kernel is None:
        sys.exit(f"error: fused RMSNorm kernel unavailable: {why}")
    ready = time.perf_counter() - start
    how = "loaded from the cache" if cached else f"compiled in {built:.2f} s (once per machine; cached)"
    print(f"fused kernel {how}, ready in {ready:.2f} s: {build.library_path()}")
    print(f"summation order reproduces torch's (bitwise Meta forward): {kernel.bitwise_meta}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="hidden 4096 x 4096 tokens only")
    ap.add_argument("--hidden", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--max-elements", type=int, default=1 << 26, help="skip larger shapes (memory: ~10 tensors of this size)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per shape (default: by size)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--rebuild", action="store_true", help="compile the CPU kernel even if cached, to time the one-time cost")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.quick:
        args.hidden, args.tokens = [4096], [4096]

    start = time.perf_counter()
    if device.type == "cpu":
        report_kernel(args.rebuild)
    wait_policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY {wait_policy}, load average {os.getloadavg()[0]:.2f}")
    print("ratio = time / nn.LayerNorm time in the same round, median over rounds (< 1: faster than LayerNorm)\n")
    ratio_cols = ["reference", "nn.RMSNorm", "fused"]
    header = f"{'dtype':5} {'tokens':>6} {'hidden':>6} {'mode':8} | " + " ".join(f"{c:>{max(len(c), 6)}}" for c in ratio_cols)
    header += f" | {'fused GB/s':>10} {'LN GB/s':>8} {'copy GB/s':>9} {'clone GB/s':>10} | {'fused ms':>8}"
    print(header)
    print("-" * len(header))
    for dtype_name in args.dtypes:
        for dim in args.hidden:
            for tokens in args.tokens:
                if tokens * dim > args.max_elements:
                    continue
                nbytes = tokens * dim * DTYPES[dtype_name].itemsize
                rounds = args.rounds or rounds_for(nbytes, args.quick)
                rows, copy_gbs, clone_gbs = bench_shape(tokens, dim, DTYPES[dtype_name], device, rounds)
                for row in rows:
                    r, g = row["ratios"], row["gbs"]
                    line = f"{dtype_name:5} {tokens:>6} {dim:>6} {row['mode']:8} | "
                    line += " ".join(f"{r[c]:>{max(len(c), 6) - 1}.2f}x" for c in ratio_cols)
                    line += f" | {g['fused']:>10.1f} {g['nn.LayerNorm']:>8.1f} {copy_gbs:>9.1f} {clone_gbs:>10.1f} | {row['median']['fused'] * 1e3:>8.2f}"
                    print(line, flush=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}; {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
