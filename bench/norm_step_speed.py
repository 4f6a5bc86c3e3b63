"""Training-step time of the same model with RMSNorm and with LayerNorm.

The RMSNorm model runs the fused kernel (use_fused_rmsnorm, as training applies it); the
same model with Meta's eager RMSNorm (model.py alone) is timed alongside to show what the
kernel buys. Each round runs one optimizer step (forward, backward, AdamW) of every variant in a
random order, and ratios are per round against the LayerNorm model, so load from other
processes falls on all variants alike.

Where a model's tensors happen to lie in memory moves its step time by a few percent, even
between two identical models built one after the other (docs/norm_step_speed.md). So each
trial builds every variant afresh, in a random order, and the result is
the geometric mean of the per-round ratios over all trials, with the spread of the trials'
own means and the standard error those give (placement, not per-round noise, dominates it).

    python bench/norm_step_speed.py            # the ablation's model, train.py's and a wider one
    python bench/norm_step_speed.py --quick    # the ablation's model only, fewer trials
"""

import argparse
import gc
import math
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
from llama_mini.kernels import use_fused_rmsnorm  # noqa: E402

# (name, ModelArgs fields, batch size, sequence length)
MODELS = [
    ("ablation default", dict(dim=128, n_layers=4, n_heads=4, vocab_size=1024), 16, 128),
    ("train.py default", dict(dim=192, n_layers=4, n_heads=6, vocab_size=1024), 16, 256),
    ("wider", dict(dim=768, n_layers=4, n_heads=12, vocab_size=1024), 8, 256),
]
VARIANTS = {  # name -> (ModelArgs.norm, whether the fused RMSNorm is applied, as training does)
    "rmsnorm (fused)": ("rmsnorm", True),
    "layernorm": ("layernorm", True),
    "rmsnorm (reference)": ("rmsnorm", False),
}


def make_step(args: ModelArgs, fused: bool, batch: int, seq_len: int, device):
    """A closure running one training step of a freshly initialised model."""
    torch.manual_seed(0)
    model = Transformer(args).to(device)
    if fused:
        use_fused_rmsnorm(model, fallback=False)
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


def run_trial(variants: list, fields: dict, batch: int, seq_len: int, device, rounds: int, rng: random.Random):
    """Build every variant in a random order, then time `rounds` interleaved steps:
    {variant: per-round step times}, and the parameter counts."""
    steps, params = {}, {}
    for variant in rng.sample(variants, len(variants)):
        norm, fused = VARIANTS[variant]
        args = ModelArgs(**fields, norm=norm, max_seq_len=seq_len)
        steps[variant], params[variant] = make_step(args, fused, batch, seq_len, device)
        steps[variant]()  # warm-up: builds the kernel, touches every buffer
    times = {v: [] for v in variants}
    order = list(steps)
    for _ in range(rounds):
        rng.shuffle(order)  # a fresh order each round: no variant always follows the same one
        for v in order:
            start = time.perf_counter()
            steps[v]()
            times[v].append(time.perf_counter() - start)
    del steps
    gc.collect()
    return times, params


def geometric_mean(logs: list) -> float:
    return math.exp(statistics.fmean(logs))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the ablation's model only, 4 trials")
    ap.add_argument("--trials", type=int, default=None, help="fresh builds of every variant per model (default 8, --quick 4)")
    ap.add_argument("--rounds", type=int, default=20, help="interleaved steps per trial (default 20)")
    ap.add_argument("--no-reference", action="store_true", help="time only fused RMSNorm and LayerNorm (more rounds in the same time)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    models = MODELS[:1] if args.quick else MODELS
    trials = args.trials or (4 if args.quick else 8)
    wait_policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY {wait_policy}, load average {os.getloadavg()[0]:.2f}")
    print("ratio = step time / the LayerNorm model's in the same round: geometric mean over all rounds ± standard error of the")
    print(f"trials' means; trials = their range ({trials} trials x {args.rounds} rounds, models rebuilt in a random order per trial)\n")
    rng = random.Random(0)
    variants = [v for v in VARIANTS if not (args.no_reference and v == "rmsnorm (reference)")]
    for name, fields, batch, seq_len in models:
        times, logs, trial_means = ({v: [] for v in variants} for _ in range(3))
        for _ in range(trials):
            trial, params = run_trial(variants, fields, batch, seq_len, device, args.rounds, rng)
            for v, ts in trial.items():
                trial_logs = [math.log(t / b) for t, b in zip(ts, trial["layernorm"])]
                times[v] += ts
                logs[v] += trial_logs
                trial_means[v].append(geometric_mean(trial_logs))
        print(f"{name}: {fields}, batch {batch} x {seq_len} tokens")
        for v in variants:
            trial_logs = [math.log(m) for m in trial_means[v]]
            se = statistics.stdev(trial_logs) / math.sqrt(trials) if trials > 1 else 0.0
            print(f"  {v:20} {statistics.median(times[v]) * 1e3:8.1f} ms/step  {geometric_mean(logs[v]):.3f}x ± {se:.3f}"
                  f"  (trials {min(trial_means[v]):.3f}-{max(trial_means[v]):.3f}; {params[v]:,} parameters)")
        print()
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
