"""Training speed: tokens/s and model FLOPs utilisation (MFU) for a few model sizes.

Each size runs the real training step of train.py (Trainer.train_step: AdamW, clipping,
bf16 autocast on CUDA) on the built-in stories, on whatever device is present. MFU is the
model's FLOPs per second (PaLM's 6N + attention estimate, llama_mini.trainer.flops_per_token)
divided by the peak this device reaches on a large matmul in the same dtype, measured right
after each size, so the ratio needs no datasheet and sees the same load from other processes.

    python bench/train_speed.py                 # sizes that suit the device
    python bench/train_speed.py --compile       # with torch.compile
    python bench/train_speed.py --dtype bfloat16  # bf16 autocast (fast on CPUs with AMX)
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train.py does, and for the same reason
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llama_mini.support.device import pick_device  # noqa: E402
from llama_mini.trainer import flops_per_token  # noqa: E402
from llama_mini.run.start import start_run, trains_in_bf16  # noqa: E402
from llama_mini.run.config import TrainConfig  # noqa: E402

# (name, dim, n_layers, n_heads, seq_len, batch_size)
SIZES = {
    "cpu": [("2M", 192, 4, 6, 256, 16), ("6M", 256, 6, 8, 256, 16), ("20M", 512, 6, 8, 256, 8)],  # 2M: train.py's default
    "gpu": [("20M", 512, 6, 8, 1024, 32), ("110M", 768, 12, 12, 1024, 32), ("350M", 1024, 24, 16, 1024, 16)],
}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


def matmul_peak(device, dtype, repeats=5) -> float:
    """FLOP/s of a square matmul: the best this device does on dense math in this dtype."""
    n = 4096 if device.type != "cpu" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def measure(cfg: TrainConfig, rounds: int, steps: int, peak_dtype):
    """Rounds of (steps training steps, then a matmul peak), so each round's MFU compares two
    timings taken under the same load from other processes; medians over rounds."""
    run = start_run(cfg)
    for _ in range(3 if not cfg.compile else 5):  # first steps allocate, and compile under --compile
        run.trainer.train_step()
    flops_per_tok = flops_per_token(run.args, cfg.seq_len)
    tok_s, peak, mfu = [], [], []
    for _ in range(rounds):
        synchronize(run.device)
        start = time.perf_counter()
        for _ in range(steps):
            run.trainer.train_step()
        synchronize(run.device)
        tok_s.append(cfg.batch_size * cfg.seq_len * steps / (time.perf_counter() - start))
        peak.append(matmul_peak(run.device, peak_dtype))
        mfu.append(flops_per_tok * tok_s[-1] / peak[-1])
    return run, statistics.median(tok_s), statistics.median(peak), statistics.median(mfu)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda, mps or cpu (default: the first available)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per size (medians are printed)")
    p.add_argument("--steps", type=int, default=3, help="training steps per round")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"), help="as train.py's --dtype")
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    device = pick_device(args.device, 0)
    sizes = SIZES["cpu" if device.type == "cpu" else "gpu"]
    bf16 = trains_in_bf16(TrainConfig(dtype=args.dtype), device)
    peak_dtype = torch.bfloat16 if bf16 else torch.float32
    print(f"device {device} ({'bfloat16 autocast' if bf16 else 'float32'}), {torch.get_num_threads()} CPU threads")
    header = ("size", "params", "dim", "layers", "seq", "batch", "tokens/s", "TFLOP/s", "peak", "MFU")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (6, 8, 5, 6, 5, 5, 10, 8, 8, 6))))
    with tempfile.TemporaryDirectory() as tmp:
        for name, dim, n_layers, n_heads, seq_len, batch_size in sizes:
            cfg = TrainConfig(
                dim=dim, n_layers=n_layers, n_heads=n_heads, seq_len=seq_len, batch_size=batch_size,
                device=str(device), dtype=args.dtype, compile=args.compile,
                out=f"{tmp}/{name}", cache_dir=f"{tmp}/cache",
            )
            run, tok_s, peak, mfu = measure(cfg, args.rounds, args.steps, peak_dtype)
            flops = flops_per_token(run.args, seq_len) * tok_s
            print(f"{name:>6} {run.n_params / 1e6:>7.1f}M {dim:>5} {n_layers:>6} {seq_len:>5} {batch_size:>5} "
                  f"{tok_s:>10,.0f} {flops / 1e12:>8.3f} {peak / 1e12:>8.3f} {mfu:>6.1%}")


if __name__ == "__main__":
    main()
