"""Training-step time of the same model with RMSNorm and with LayerNorm.

The RMSNorm model uses norm_impl "auto" (the fused kernel, as training does); the same
model with Meta's eager RMSNorm ("reference") is timed alongside to show what the kernel
buys. Each round runs one optimizer step (forward, backward, AdamW) of every variant in a
random order; ratios are per round against the LayerNorm model, median over rounds, so
load from other processes falls on all variants alike.

    python bench/norm_step_speed.py            # the ablation's model, train.py's and a wider one
    python bench/norm_step_speed.py --quick    # the ablation's model only, fewer rounds
"""

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llama_mini import ModelArgs, Transformer  # noqa: E402

# (name, ModelArgs fields, batch size, sequence length)
MODELS = [
    ("ablation default", dict(dim=128, n_layers=4, n_heads=4, vocab_size=1024), 16, 128),
    ("train.py default", dict(dim=192, n_layers=4, n_heads=6, vocab_size=1024), 16, 256),
    ("wider", dict(dim=768, n_layers=4, n_heads=12, vocab_size=1024), 8, 256),
]
VARIANTS = {  # name -> ModelArgs overrides
    "rmsnorm (fused)": dict(norm="rmsnorm", norm_impl="auto"),
    "layernorm": dict(norm="layernorm"),
    "rmsnorm (reference)": dict(norm="rmsnorm", norm_impl="reference"),
}


def make_step(args: ModelArgs, batch: int, seq_len: int, device):
    """A closure running one training step of a freshly initialised model."""
    torch.manual_seed(0)
    model = Transformer(args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type in ("cpu", "cuda"))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step, sum(p.numel() for p in model.parameters())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the ablation's model only, 9 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per model (default 15, --quick 9)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    models = MODELS[:1] if args.quick else MODELS
    rounds = args.rounds or (9 if args.quick else 15)
    wait_policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY {wait_policy}, load average {os.getloadavg()[0]:.2f}")
    print("ratio = step time / the LayerNorm model's step time in the same round: median and quartiles over rounds\n")
    for name, fields, batch, seq_len in models:
        steps, params = {}, {}
        for variant, overrides in VARIANTS.items():
            steps[variant], params[variant] = make_step(ModelArgs(**fields, **overrides, max_seq_len=seq_len), batch, seq_len, device)
            steps[variant]()  # warm-up: builds the kernel, touches every buffer
        times = {v: [] for v in steps}
        order, rng = list(steps), random.Random(0)
        for _ in range(rounds):
            rng.shuffle(order)  # a fresh order each round: no variant always follows the same one
            for v in order:
                start = time.perf_counter()
                steps[v]()
                times[v].append(time.perf_counter() - start)
        print(f"{name}: {fields}, batch {batch} x {seq_len} tokens, {rounds} rounds")
        for v, ts in times.items():
            q1, ratio, q3 = statistics.quantiles([t / b for t, b in zip(ts, times["layernorm"])], n=4)
            print(f"  {v:20} {statistics.median(ts) * 1e3:8.1f} ms/step  {ratio:5.3f}x  (quartiles {q1:.3f}-{q3:.3f}; {params[v]:,} parameters)")
        print()
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
