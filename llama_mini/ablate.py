"""The normalisation ablation: RMSNorm vs LayerNorm (vs none, vs partial RMSNorm), by flag.

    python -m llama_mini.ablate --norms rmsnorm,layernorm,none --max-steps 300 --seeds 3 --out checkpoints/ablation

Zhang & Sennrich (2019) claim RMSNorm matches LayerNorm's quality in less time. Here every
variant trains with the same seeds (so the same initial matrices and the same batches),
data, model size and steps; only the normalisation layer differs. Each RMSNorm runs fused
where the kernel builds (kernels.use_fused_rmsnorm, as in training), as LayerNorm runs torch's fused one.

The variants are built in a random order and train round-robin in one process: each takes
one optimizer step in turn, in a fresh random order each round, and is timed over its own
steps only. A burst of load from elsewhere on the machine then falls on all variants
alike, and no variant always runs first or always follows the same one: in a fixed order,
runs' speeds followed their position in the round (docs/ablation.md). Evaluation is not timed.

Writes to --out: report.md (final validation loss in nats per token and bits per byte, mean
and sd over seeds; tokens/s; steps/s; training time to reach a target loss; parameter count),
metrics.csv (every step of every run) and, with matplotlib installed, val_loss_vs_step.png
and val_loss_vs_time.png (the paper's Figure 1, in bits per byte).
"""

import argparse
import csv
import dataclasses
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from .support.cli import check_number, run_main
from .support.files import atomic_write, check_new_folder
from .model import NORMS
from .run.config import TrainConfig, add_arguments
from .run.plots import Curve, plot_curves
from .run.start import start_run
from .run.training_run import TrainingRun
from .trainer import NonFiniteLoss

# A model a little smaller than train.py's, so that the default ablation (three norms, three
# seeds: nine runs) fits in a coffee break on a laptop's CPU; docs/ablation.md has the times.
DEFAULTS = dict(dim=128, n_layers=4, n_heads=4, batch_size=16, seq_len=128, max_steps=300, warmup_steps=30, eval_every=25, eval_iters=5)


@dataclass
class Run:
    """One (norm, seed) training run and what it recorded."""

    norm: str
    seed: int
    training: TrainingRun
    seconds: float = 0.0  # this run's own training time, evaluation excluded
    steps: list = field(default_factory=list)  # {"step", "time", "train_loss"[, "val_loss", "val_bpb"]}
    diverged_at: Optional[int] = None

    @property
    def evals(self) -> list:
        return [r for r in self.steps if "val_loss" in r]

    def evaluate(self) -> None:
        """Add the validation loss to the latest step's record (a step-0 record at first)."""
        if not self.steps:
            self.steps.append({"step": 0, "time": 0.0})
        self.steps[-1].update(self.training.evaluate())

    def step(self) -> None:
        trainer = self.training.trainer
        start = time.perf_counter()
        try:
            loss = trainer.train_step()
        except NonFiniteLoss:
            self.diverged_at = trainer.step + 1
            return
        self.seconds += time.perf_counter() - start
        self.steps.append({"step": trainer.step, "time": self.seconds, "train_loss": loss})


def ablate(norms: list, seeds: int, cfg: TrainConfig, out: Path, target_loss: Optional[float] = None) -> Path:
    """Train every norm with every seed round-robin; write the report into the new folder out;
    return it."""
    check_new_folder(out, "pass --out a new folder")
    if cfg.seed + seeds > 2**63:  # every seed is checked before the first run's folder is written
        raise ValueError(f"--seed {cfg.seed} with --seeds {seeds} runs seeds past 2**63 - 1; pass a smaller --seed")
    out.mkdir(parents=True, exist_ok=True)
    # Where a model's tensors land in memory moves its step time measurably
    # (bench/norm_step_speed.py), and the order of building decides where they land:
    # build each seed's variants in a random order, so no norm is always built first.
    rng, built = random.Random(cfg.seed), {}
    for k in range(seeds):
        for norm in rng.sample(norms, len(norms)):
            run_cfg = dataclasses.replace(cfg, norm=norm, seed=cfg.seed + k, out=str(out / "runs" / f"{norm}-seed{cfg.seed + k}"))
            built[norm, k] = Run(norm, run_cfg.seed, start_run(run_cfg))
    runs = [built[norm, k] for norm in norms for k in range(seeds)]
    first = runs[0].training
    print(
        f"{len(norms)} norms x {seeds} seeds, {cfg.max_steps} steps each: dim {cfg.dim}, {cfg.n_layers} layers, "
        f"batch {cfg.batch_size} x {cfg.seq_len} tokens, {first.device}, data {first.corpus.name}"
    )
    for run in runs:
        run.evaluate()
    order = list(runs)  # each run has its own RNGs: the order changes no number
    with tqdm(total=cfg.max_steps * len(runs), unit="step", dynamic_ncols=True, disable=None) as bar:  # terminals only
        for step in range(1, cfg.max_steps + 1):
            rng.shuffle(order)
            for run in order:
                if run.diverged_at is None:
                    run.step()
                    if run.diverged_at is not None:
                        bar.write(f"{run.norm} seed {run.seed}: loss not finite at step {run.diverged_at}; that run stops")
                    elif step % cfg.eval_every == 0 or step == cfg.max_steps:
                        run.evaluate()
                bar.update()
            alive = {n: [r.steps[-1]["train_loss"] for r in runs if r.norm == n and r.diverged_at is None] for n in norms}
            bar.set_postfix({n: f"{statistics.mean(v):.3f}" if v else "diverged" for n, v in alive.items()}, refresh=False)

    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    rows = summarize(runs, norms, tokens_per_step, target_loss)
    write_metrics(runs, out / "metrics.csv")
    plots = plot(runs, norms, out)
    report = write_report(rows, cfg, seeds, plots, out / "report.md")
    print("\n" + table(rows))
    if not plots:
        print("\n(no plots: pip install matplotlib to get val_loss_vs_step.png and val_loss_vs_time.png)")
    print(f"\nreport: {report}")
    return report


def time_to_reach(run: Run, target: float) -> Optional[float]:
    """Training seconds at which the validation loss first reached target, interpolated
    linearly between the two evaluations around the crossing; None if it never did."""
    previous = None
    for r in run.evals:
        if r["val_loss"] <= target:
            if previous is None or previous["val_loss"] == r["val_loss"]:
                return r["time"]
            frac = (previous["val_loss"] - target) / (previous["val_loss"] - r["val_loss"])
            return previous["time"] + frac * (r["time"] - previous["time"])
        previous = r
    return None


def summarize(runs: list, norms: list, tokens_per_step: int, target_loss: Optional[float] = None) -> list:
    """One row per norm. The default target loss is LayerNorm's final validation loss
    plus 2% (the paper's sense of "reaches LayerNorm's quality"); without LayerNorm in the
    ablation, the best variant's plus 2%."""
    final = {n: [r.evals[-1]["val_loss"] for r in runs if r.norm == n and r.diverged_at is None] for n in norms}
    final_bpb = {n: [r.evals[-1].get("val_bpb", math.nan) for r in runs if r.norm == n and r.diverged_at is None] for n in norms}
    if target_loss is None:
        finished = {n: statistics.mean(v) for n, v in final.items() if v}
        reference = finished.get("layernorm", min(finished.values(), default=math.nan))
        target_loss = 1.02 * reference
    rows = []
    for norm in norms:
        mine = [r for r in runs if r.norm == norm]
        steps = sum(r.steps[-1]["step"] for r in mine)
        seconds = sum(r.seconds for r in mine)
        reached = [t for t in (time_to_reach(r, target_loss) for r in mine) if t is not None]
        losses = final[norm]
        rows.append({
            "norm": norm,
            "val_loss": statistics.mean(losses) if losses else math.nan,
            "val_loss_sd": statistics.stdev(losses) if len(losses) > 1 else None,
            "val_bpb": statistics.mean(final_bpb[norm]) if losses else math.nan,
            "val_bpb_sd": statistics.stdev(final_bpb[norm]) if len(losses) > 1 else None,
            "tokens_per_s": steps * tokens_per_step / seconds if seconds else math.nan,
            "steps_per_s": steps / seconds if seconds else math.nan,
            "target_loss": target_loss,
            "time_to_target": statistics.mean(reached) if reached else None,
            "reached": len(reached),
            "runs": len(mine),
            "diverged": [r.diverged_at for r in mine if r.diverged_at is not None],
            "params": mine[0].training.n_params,
        })
    return rows


def table(rows: list) -> str:
    """The summary as a Markdown table."""
    target = rows[0]["target_loss"]
    lines = [
        f"| norm | final val loss, nats/token (mean ± sd) | bits/byte (mean ± sd) | tokens/s | steps/s "
        f"| time to val loss {target:.3f} | parameters |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if math.isnan(r["val_loss"]):
            loss, bpb = "diverged", ""
        else:
            loss, bpb = (f"{r[name]:.4f} " + (f"± {r[name + '_sd']:.4f}" if r[name + "_sd"] is not None else "(one run)")
                         for name in ("val_loss", "val_bpb"))
        if r["diverged"]:
            loss += f" ({len(r['diverged'])}/{r['runs']} diverged, at step {', '.join(map(str, r['diverged']))})"
        reach = f"{r['time_to_target']:.1f} s" if r["time_to_target"] is not None else "not reached"
        if r["time_to_target"] is not None and r["reached"] < r["runs"]:
            reach += f" ({r['reached']}/{r['runs']} runs)"
        lines.append(f"| {r['norm']} | {loss} | {bpb} | {r['tokens_per_s']:,.0f} | {r['steps_per_s']:.2f} | {reach} | {r['params']:,} |")
    return "\n".join(lines)


def write_metrics(runs: list, path: Path) -> None:
    def write(tmp):
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["norm", "seed", "step", "time_s", "train_loss", "val_loss", "val_bpb"])
            for run in runs:
                for r in run.steps:
                    writer.writerow([run.norm, run.seed, r["step"], f"{r['time']:.4f}", r.get("train_loss", ""),
                                     r.get("val_loss", ""), r.get("val_bpb", "")])

    atomic_write(path, write)


def curves_of(runs: list, norm: str):
    """Evaluation steps, mean training seconds and min/mean/max validation bits per byte over
    the seeds of one norm, up to the last evaluation every seed reached."""
    evals = [r.evals for r in runs if r.norm == norm]
    n = min(len(e) for e in evals)
    steps = [evals[0][i]["step"] for i in range(n)]
    seconds = [statistics.mean(e[i]["time"] for e in evals) for i in range(n)]
    losses = [[e[i]["val_bpb"] for e in evals] for i in range(n)]
    return steps, seconds, [min(v) for v in losses], [statistics.mean(v) for v in losses], [max(v) for v in losses]


def plot(runs: list, norms: list, out: Path) -> list:
    """val_loss_vs_step.png and val_loss_vs_time.png, in bits per byte: mean over seeds, band from min to max."""
    paths = []
    for x_name, label in (("step", "training step"), ("time", "training time (s, evaluation excluded)")):
        curves = []
        for norm in norms:
            steps, seconds, low, mean, high = curves_of(runs, norm)
            curves.append(Curve(norm, steps if x_name == "step" else seconds, mean, low, high))
        title = f"validation loss vs {label.split(' (')[0]}"
        path = plot_curves(out / f"val_loss_vs_{x_name}.png", curves, label, "validation loss (bits per byte, log scale)", title)
        if path is None:  # no matplotlib
            return []
        paths.append(path)
    return paths


def write_report(rows: list, cfg: TrainConfig, seeds: int, plots: list, path: Path) -> Path:
    setup = (
        f"dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, batch {cfg.batch_size} x {cfg.seq_len} tokens, "
        f"{cfg.max_steps} steps, lr {cfg.lr}, seeds {cfg.seed}..{cfg.seed + seeds - 1}, data {cfg.data or 'built-in stories'}"
    )
    text = [
        "# Normalisation ablation",
        "",
        setup + ".",
        "Times are each run's own training steps (round-robin in one process), evaluation excluded.",
        "",
        table(rows),
        "",
    ]
    text += [f"![{p.stem}]({p.name})" for p in plots]
    atomic_write(path, lambda tmp: tmp.write_text("\n".join(text) + "\n"))
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--norms", default="rmsnorm,layernorm,none", help=f"comma-separated, from {', '.join(NORMS)} (default: rmsnorm,layernorm,none)")
    p.add_argument("--seeds", type=int, default=3, help="runs per norm, seeds --seed, --seed + 1, ... (default: 3)")
    p.add_argument("--out", default="checkpoints/ablation", help="a new folder for report.md, metrics.csv, the plots and the runs (default: checkpoints/ablation)")
    p.add_argument("--target-loss", type=float, default=None, help="for the time-to-loss column (default: LayerNorm's final + 2%%)")
    add_arguments(p, ("data", *DEFAULTS, "lr", "norm_p", "seed", "vocab_size", "cache_dir", "device"), DEFAULTS)
    return p


def ablate_from_flags(argv=None) -> None:
    args = vars(parser().parse_args(argv))
    norms = [n.strip() for n in args.pop("norms").split(",") if n.strip()]
    seeds, out, target = args.pop("seeds"), Path(args.pop("out")), args.pop("target_loss")
    unknown = [n for n in norms if n not in NORMS]
    if unknown or not norms:
        raise ValueError(f"unknown norm {unknown[0]!r} in --norms; choose from {', '.join(NORMS)}" if unknown else "--norms is empty; e.g. --norms rmsnorm,layernorm")
    if len(set(norms)) != len(norms):
        raise ValueError(f"--norms names a norm twice: {','.join(norms)}")
    check_number("--seeds", seeds, 1)
    check_number("--target-loss", target, 0, low_open=True)
    ablate(norms, seeds, TrainConfig(**args), out, target)


def main(argv=None) -> int:
    return run_main(ablate_from_flags, argv)


if __name__ == "__main__":
    sys.exit(main())
