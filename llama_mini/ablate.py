"""The ablation: RMSNorm vs LayerNorm (vs none, vs partial RMSNorm), or any flags, trained side by side.

    python -m llama_mini.ablate --norms rmsnorm,layernorm,none --max-steps 300 --seeds 3 --out checkpoints/ablation
    python -m llama_mini.ablate --vary norm=rmsnorm,layernorm --vary lr=1e-3,3e-3 --seeds 5

Zhang & Sennrich (2019) claim RMSNorm matches LayerNorm's quality in less time. Here every
variant trains with the same seeds (so the same initial matrices, where the shapes agree, and
the same batches), data, model size and steps; only the flags --vary names differ (--norms is
--vary norm=...), each variant one combination of their values. Each RMSNorm runs fused where
the kernel builds (kernels.use_fused_rmsnorm, as in training), as LayerNorm runs torch's fused one.

The variants are built in a random order and train round-robin in one process: each takes
one optimizer step in turn, in a fresh random order each round, and is timed over its own
steps only. A burst of load from elsewhere on the machine then falls on all variants
alike, and no variant always runs first or always follows the same one: in a fixed order,
runs' speeds followed their position in the round (docs/ablation.md). Evaluation is not timed.

Writes to --out: report.md (final validation loss in nats per token and bits per byte, mean
and sd over seeds; tokens/s; steps/s; the time a step spends in the norms, each norm's forward
and backward timed apart after training, beside the whole step's; training time to reach a
target loss; parameter count;
and for each pair of variants the verdict: the paired differences over seeds with their 95%
intervals and p-values, support/paired.py), metrics.csv (every step of every run) and, with
matplotlib installed, val_loss_vs_step.png and val_loss_vs_time.png (the paper's Figure 1, in
bits per byte).
"""

import argparse
import contextlib
import csv
import dataclasses
import itertools
import math
import re
import typing
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from tqdm import tqdm

from .support.cli import check_number, flag, run_main
from .support.files import atomic_write, check_new_folder
from .support.paired import paired
from .model import NORMS
from .run.config import TrainConfig, add_arguments
from .run.plots import Curve, plot_curves
from .run.start import start_run
from .run.training_run import TrainingRun
from .trainer import NonFiniteLoss

# A model a little smaller than train.py's, so that the default ablation (three norms, three
# seeds: nine runs) fits in a coffee break on a laptop's CPU; docs/ablation.md has the times.
DEFAULTS = dict(dim=128, n_layers=4, n_heads=4, batch_size=16, seq_len=128, max_steps=300, warmup_steps=30, eval_every=25, eval_iters=5)
NORMS_BY_DEFAULT = "rmsnorm,layernorm,none"
NORM_TIMINGS = 9  # rounds of each run's norms timed apart after training; the median is reported
# Flags that say where a run writes, what it starts from or how it is watched, not what it
# trains: varying one would compare nothing (the seeds are the ablation's own, --seeds).
NOT_VARIED = ("out", "run_name", "resume", "init_from", "cache_dir", "seed", "save_every", "keep_checkpoints",
              "eval_every", "eval_iters", "sample_tokens", "prompt", "device")


@dataclass
class Run:
    """One (variant, seed) training run and what it recorded."""

    variant: str  # its label: the varied flags' values
    seed: int
    training: TrainingRun
    seconds: float = 0.0  # this run's own training time, evaluation excluded
    steps: list = field(default_factory=list)  # {"step", "time", "train_loss"[, "val_loss", "val_bpb"]}
    diverged_at: Optional[int] = None
    norm_timings: list = field(default_factory=list)  # seconds of a step's norms, each timed apart (time_norms)

    @property
    def evals(self) -> list:
        return [r for r in self.steps if "val_loss" in r]

    def evaluate(self) -> None:
        """Add the validation loss to the latest step's record (a step-0 record at first)."""
        if not self.steps:
            self.steps.append({"step": 0, "time": 0.0})
        self.steps[-1].update(self.training.evaluate())

    def time_norms(self) -> None:
        """Time what one training step spends in the model's norms, apart from the step: each
        norm's forward and backward on activations of the step's shape, under the step's
        autocast. The step's time holds it and everything else; this is the norm kernel's own."""
        training = self.training
        norms = [m for name, m in training.raw_model.named_modules() if name.endswith("norm") and not isinstance(m, nn.Identity)]
        cfg = training.cfg
        x = torch.randn(cfg.batch_size, cfg.seq_len, cfg.dim, device=training.device, requires_grad=True)
        bf16 = torch.autocast(x.device.type, dtype=torch.bfloat16) if training.trainer.bf16 else contextlib.nullcontext()
        start = time.perf_counter()
        for norm in norms:
            with bf16:
                y = norm(x)
            torch.autograd.grad(y, (x, *norm.parameters()), torch.ones_like(y))  # the parameters' .grad untouched
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.norm_timings.append(time.perf_counter() - start)

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


def ablate(variants: list, seeds: int, cfg: TrainConfig, out: Path, target_loss: Optional[float] = None) -> Path:
    """Train every variant ({flag name: value} over cfg) with every seed round-robin; write the
    report into the new folder out; return it."""
    check_new_folder(out, "pass --out a new folder")
    if cfg.seed + seeds > 2**63:  # every seed is checked before the first run's folder is written
        raise ValueError(f"--seed {cfg.seed} with --seeds {seeds} runs seeds past 2**63 - 1; pass a smaller --seed")
    labels = [label(v) for v in variants]
    configs = {(name, k): dataclasses.replace(cfg, **v, seed=cfg.seed + k, out=str(out / "runs" / f"{slug(v)}-seed{cfg.seed + k}"))
               for name, v in zip(labels, variants) for k in range(seeds)}  # each variant's flags checked before any work
    out.mkdir(parents=True, exist_ok=True)
    # Where a model's tensors land in memory moves its step time measurably
    # (bench/norm_step_speed.py), and the order of building decides where they land:
    # build each seed's variants in a random order, so no variant is always built first.
    rng, built = random.Random(cfg.seed), {}
    for k in range(seeds):
        for name in rng.sample(labels, len(labels)):
            built[name, k] = Run(name, cfg.seed + k, start_run(configs[name, k]))
    runs = [built[name, k] for name in labels for k in range(seeds)]
    first = runs[0].training
    varied = ", ".join(f"{flag(name)} {'/'.join(dict.fromkeys(str(v[name]) for v in variants))}" for name in variants[0]) or "nothing"
    print(
        f"{len(labels)} variants ({varied}) x {seeds} seeds, {cfg.max_steps} steps each: dim {cfg.dim}, {cfg.n_layers} "
        f"layers, batch {cfg.batch_size} x {cfg.seq_len} tokens, {first.device}, data {first.corpus.name}"
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
                        bar.write(f"{run.variant} seed {run.seed}: loss not finite at step {run.diverged_at}; that run stops")
                    elif step % cfg.eval_every == 0 or step == cfg.max_steps:
                        run.evaluate()
                bar.update()
            alive = {n: [r.steps[-1]["train_loss"] for r in runs if r.variant == n and r.diverged_at is None] for n in labels}
            bar.set_postfix({n: f"{statistics.mean(v):.3f}" if v else "diverged" for n, v in alive.items()}, refresh=False)

    for _ in range(NORM_TIMINGS):  # interleaved as the steps were, so load falls on all runs alike
        for run in rng.sample(runs, len(runs)):
            run.time_norms()
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    rows = summarize(runs, labels, tokens_per_step, target_loss)
    pairs = compare(runs, labels, tokens_per_step, rows[0]["target_loss"])
    write_metrics(runs, dict(zip(labels, variants)), out / "metrics.csv")
    plots = plot(runs, labels, out)
    report = write_report(rows, pairs, cfg, variants, seeds, plots, out / "report.md")
    print("\n" + table(rows) + "\n\n" + verdicts(pairs))
    if not plots:
        print("\n(no plots: pip install matplotlib to get val_loss_vs_step.png and val_loss_vs_time.png)")
    print(f"\nreport: {report}")
    return report


def label(variant: dict) -> str:
    """A variant's name: its value where one flag varies ("rmsnorm"), else flag=value pairs."""
    if len(variant) == 1:
        return str(next(iter(variant.values())))
    return " ".join(f"{name}={value}" for name, value in variant.items())


def slug(variant: dict) -> str:
    """A variant as a folder name: its flags and values, nothing a path would read otherwise."""
    return re.sub(r"[^\w.=-]+", "_", "_".join(f"{name}={value}" for name, value in variant.items())) or "run"


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


def summarize(runs: list, labels: list, tokens_per_step: int, target_loss: Optional[float] = None) -> list:
    """One row per variant. The default target loss is LayerNorm's final validation loss
    plus 2% (the paper's sense of "reaches LayerNorm's quality"); without a variant named
    layernorm, the best variant's plus 2%."""
    final = {n: [r.evals[-1]["val_loss"] for r in runs if r.variant == n and r.diverged_at is None] for n in labels}
    final_bpb = {n: [r.evals[-1].get("val_bpb", math.nan) for r in runs if r.variant == n and r.diverged_at is None] for n in labels}
    if target_loss is None:
        finished = {n: statistics.mean(v) for n, v in final.items() if v}
        reference = finished.get("layernorm", min(finished.values(), default=math.nan))
        target_loss = 1.02 * reference
    rows = []
    for name in labels:
        mine = [r for r in runs if r.variant == name]
        steps = sum(r.steps[-1]["step"] for r in mine)
        seconds = sum(r.seconds for r in mine)
        reached = [t for t in (time_to_reach(r, target_loss) for r in mine) if t is not None]
        losses = final[name]
        rows.append({
            "variant": name,
            "val_loss": statistics.mean(losses) if losses else math.nan,
            "val_loss_sd": statistics.stdev(losses) if len(losses) > 1 else None,
            "val_bpb": statistics.mean(final_bpb[name]) if losses else math.nan,
            "val_bpb_sd": statistics.stdev(final_bpb[name]) if len(losses) > 1 else None,
            "tokens_per_s": steps * tokens_per_step / seconds if seconds else math.nan,
            "steps_per_s": steps / seconds if seconds else math.nan,
            "target_loss": target_loss,
            "time_to_target": statistics.mean(reached) if reached else None,
            "reached": len(reached),
            "runs": len(mine),
            "diverged": [r.diverged_at for r in mine if r.diverged_at is not None],
            "params": mine[0].training.n_params,
            "step_ms": 1000 * seconds / steps if steps else math.nan,
            "norm_ms": 1000 * statistics.mean(statistics.median(r.norm_timings) * r.training.cfg.grad_accum for r in mine)
            if all(r.norm_timings for r in mine) else None,
        })
    return rows


def table(rows: list) -> str:
    """The summary as a Markdown table."""
    target = rows[0]["target_loss"]
    lines = [
        f"| variant | final val loss, nats/token (mean ± sd) | bits/byte (mean ± sd) | tokens/s | steps/s "
        f"| a step's norms, timed apart (share of the step) | time to val loss {target:.3f} | parameters |",
        "|---|---|---|---|---|---|---|---|",
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
        norms = "" if r["norm_ms"] is None else f"{r['norm_ms']:.2f} ms ({r['norm_ms'] / r['step_ms']:.1%})"
        lines.append(f"| {r['variant']} | {loss} | {bpb} | {r['tokens_per_s']:,.0f} | {r['steps_per_s']:.2f} | {norms} | {reach} "
                     f"| {r['params']:,} |")
    return "\n".join(lines)


def compare(runs: list, labels: list, tokens_per_step: int, target_loss: float) -> list:
    """For each pair of variants (a before b in labels), the paired differences over the seeds
    both finished: final bits per byte (a - b), tokens/s (a / b - 1, in percent) and time to
    target_loss (a - b, seconds; seeds where both reached it), and how many runs diverged."""
    by = {(r.variant, r.seed): r for r in runs}
    seeds = sorted({r.seed for r in runs})

    def per_seed(name, value):
        return [None if by[name, k].diverged_at is not None else value(by[name, k]) for k in seeds]

    def speed(r):
        return r.steps[-1]["step"] * tokens_per_step / r.seconds if r.seconds else None

    pairs = []
    for a, b in itertools.combinations(labels, 2):
        speed_a, speed_b = per_seed(a, speed), per_seed(b, speed)
        ratio = [None if x is None or y is None else 100 * (x / y - 1) for x, y in zip(speed_a, speed_b)]
        pairs.append({
            "a": a, "b": b, "target_loss": target_loss,
            "bpb": paired(per_seed(a, lambda r: r.evals[-1]["val_bpb"]), per_seed(b, lambda r: r.evals[-1]["val_bpb"])),
            "speed": paired(ratio, [0.0] * len(ratio)),
            "time": paired(per_seed(a, lambda r: time_to_reach(r, target_loss)), per_seed(b, lambda r: time_to_reach(r, target_loss))),
            "diverged": sum(by[name, k].diverged_at is not None for name in (a, b) for k in seeds),
        })
    return pairs


def verdict(result, unit: str, digits: int, smaller: str, larger: str) -> str:
    """One cell: the mean difference with its 95% interval and p-value, and what it says."""
    if result.n == 0:
        return "no seed finished both"
    shown = f"{result.mean:+.{digits}f}{unit}"
    if result.low is None:
        return f"{shown} (one seed: no interval)"
    interval = f"{shown} [{result.low:+.{digits}f}, {result.high:+.{digits}f}], p {result.p:.2g}"
    if result.detected:
        return f"{interval}: **{smaller if result.mean < 0 else larger}**"
    return f"{interval}: no difference detected (the run could detect ±{result.floor:.{digits}f}{unit})"


def verdicts(pairs: list) -> str:
    """The paired comparisons as a Markdown table: each pair's differences and what they say."""
    if not pairs:
        return ""
    lines = [f"| a vs b | seeds | final bits/byte, a - b | tokens/s, a / b - 1 | time to val loss {pairs[0]['target_loss']:.3f}, "
             "a - b |", "|---|---|---|---|---|"]
    for c in pairs:
        a, b = c["a"], c["b"]
        diverged = f" ({c['diverged']} runs diverged)" if c["diverged"] else ""
        lines.append(
            f"| {a} vs {b} | {c['bpb'].n}{diverged} | {verdict(c['bpb'], '', 4, f'{a} lower', f'{b} lower')} "
            f"| {verdict(c['speed'], '%', 1, f'{a} slower', f'{a} faster')} "
            f"| {verdict(c['time'], ' s', 1, f'{a} sooner', f'{b} sooner')} |")
    return "\n".join(lines)


def write_metrics(runs: list, variants: dict, path: Path) -> None:
    """metrics.csv: every step of every run, its variant by label and by each varied flag."""
    names = list(next(iter(variants.values()), {}))

    def write(tmp):
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["variant", *(n for n in names if n != "variant"), "seed", "step", "time_s", "train_loss",
                             "val_loss", "val_bpb"])
            for run in runs:
                values = [variants[run.variant][n] for n in names if n != "variant"]
                for r in run.steps:
                    writer.writerow([run.variant, *values, run.seed, r["step"], f"{r['time']:.4f}", r.get("train_loss", ""),
                                     r.get("val_loss", ""), r.get("val_bpb", "")])

    atomic_write(path, write)


def curves_of(runs: list, name: str):
    """Evaluation steps, mean training seconds and min/mean/max validation bits per byte over
    the seeds of one variant, up to the last evaluation every seed reached."""
    evals = [r.evals for r in runs if r.variant == name]
    n = min(len(e) for e in evals)
    steps = [evals[0][i]["step"] for i in range(n)]
    seconds = [statistics.mean(e[i]["time"] for e in evals) for i in range(n)]
    losses = [[e[i]["val_bpb"] for e in evals] for i in range(n)]
    return steps, seconds, [min(v) for v in losses], [statistics.mean(v) for v in losses], [max(v) for v in losses]


def plot(runs: list, labels: list, out: Path) -> list:
    """val_loss_vs_step.png and val_loss_vs_time.png, in bits per byte: mean over seeds, band from min to max."""
    paths = []
    for x_name, label in (("step", "training step"), ("time", "training time (s, evaluation excluded)")):
        curves = []
        for name in labels:
            steps, seconds, low, mean, high = curves_of(runs, name)
            curves.append(Curve(name, steps if x_name == "step" else seconds, mean, low, high))
        title = f"validation loss vs {label.split(' (')[0]}"
        path = plot_curves(out / f"val_loss_vs_{x_name}.png", curves, label, "validation loss (bits per byte, log scale)", title)
        if path is None:  # no matplotlib
            return []
        paths.append(path)
    return paths


def write_report(rows: list, pairs: list, cfg: TrainConfig, variants: list, seeds: int, plots: list, path: Path) -> Path:
    varied = set(variants[0])
    fixed = ", ".join(f"{flag(f.name)} {getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                      if f.name not in varied and f.name not in NOT_VARIED and getattr(cfg, f.name) not in (None, False))
    text = [
        "# Ablation",
        "",
        f"Varied: {', '.join(flag(n) for n in variants[0]) or 'nothing'}; each variant trains seeds {cfg.seed}.."
        f"{cfg.seed + seeds - 1} (the same initial matrices where the shapes agree, the same batches). Held fixed: "
        f"{fixed}, data {cfg.data or 'built-in stories'}.",
        "Times are each run's own training steps (round-robin in one process), evaluation excluded.",
        "",
        table(rows),
        "",
        "Each pair of variants compared seed by seed (the same seed, the same batches): the mean difference, its 95%",
        "interval and a paired t-test's p-value. Where the interval holds zero, no difference is detected, and its",
        "half width is the smallest difference this run could have detected.",
        "",
        verdicts(pairs),
        "",
    ]
    text += [f"![{p.stem}]({p.name})" for p in plots]
    atomic_write(path, lambda tmp: tmp.write_text("\n".join(text) + "\n"))
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--norms", help=f"comma-separated, from {', '.join(NORMS)}: --vary norm=... (default, without --vary: "
                                   f"{NORMS_BY_DEFAULT})")
    p.add_argument("--vary", action="append", default=[], metavar="FLAG=V1,V2,...",
                   help="a train.py flag and its values, each a variant; repeated, every combination (e.g. --vary lr=1e-3,3e-3)")
    p.add_argument("--seeds", type=int, default=3, help="runs per variant, seeds --seed, --seed + 1, ... (default: 3)")
    p.add_argument("--out", default="checkpoints/ablation", help="a new folder for report.md, metrics.csv, the plots and the runs (default: checkpoints/ablation)")
    p.add_argument("--target-loss", type=float, default=None, help="for the time-to-loss column (default: LayerNorm's final + 2%%)")
    add_arguments(p, ("data", *DEFAULTS, "lr", "norm_p", "seed", "vocab_size", "cache_dir", "device", "flush_denormals"),
                  DEFAULTS)
    return p


def ablate_from_flags(argv=None) -> None:
    args = vars(parser().parse_args(argv))
    norms, vary = args.pop("norms"), args.pop("vary")
    seeds, out, target = args.pop("seeds"), Path(args.pop("out")), args.pop("target_loss")
    if norms is not None:
        names = [n.strip() for n in norms.split(",") if n.strip()]
        unknown = [n for n in names if n not in NORMS]
        if unknown or not names:
            raise ValueError(f"unknown norm {unknown[0]!r} in --norms; choose from {', '.join(NORMS)}" if unknown else "--norms is empty; e.g. --norms rmsnorm,layernorm")
        if len(set(names)) != len(names):
            raise ValueError(f"--norms names a norm twice: {','.join(names)}")
    check_number("--seeds", seeds, 1)
    check_number("--target-loss", target, 0, low_open=True)
    if norms is None and not vary:
        norms = NORMS_BY_DEFAULT
    settings = [parse_vary(item) for item in vary] + ([("norm", [n.strip() for n in norms.split(",") if n.strip()])] if norms else [])
    names = [name for name, _ in settings]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice:
        raise ValueError(f"{flag(twice)} is varied twice ({'--norms and --vary norm' if twice == 'norm' and norms else '--vary'}); "
                         "give its values once")
    variants = [dict(zip(names, values)) for values in itertools.product(*(values for _, values in settings))]
    ablate(variants, seeds, TrainConfig(**args), out, target)


def parse_vary(item: str):
    """--vary FLAG=V1,V2,...: (the TrainConfig field, its values in its type), or one line saying what is wrong."""
    name, sep, values = item.partition("=")
    field_name = name.strip().removeprefix("--").replace("-", "_")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    if not sep or field_name not in fields:
        raise ValueError(f"--vary {item!r}: give a train.py flag and its values, e.g. --vary lr=1e-3,3e-3"
                         + ("" if not sep else f" ({flag(field_name)} is not a train.py flag)"))
    if field_name == "flush_denormals":
        raise ValueError(f"--vary {flag(field_name)}: it sets the whole process (every CPU thread), and the variants train "
                         "in one process; run the ablation once with --flush-denormals and once without")
    if field_name in NOT_VARIED:
        raise ValueError(f"--vary {flag(field_name)}: it says where or how a run is written or watched, not what it trains; "
                         "vary a flag of the model, the data or the optimisation")
    texts = [v.strip() for v in values.split(",")]
    if len(texts) < 2 or "" in texts or len(set(texts)) < len(texts):
        raise ValueError(f"--vary {flag(field_name)} needs two or more different values, comma-separated; got {values!r}")
    kind = next((a for a in typing.get_args(typing.get_type_hints(TrainConfig)[field_name]) if a is not type(None)),
                typing.get_type_hints(TrainConfig)[field_name])
    choices = fields[field_name].metadata.get("choices")
    parsed = []
    for text in texts:
        try:
            value = {"true": True, "false": False}[text.lower()] if kind is bool else kind(text)
        except (KeyError, ValueError):
            raise ValueError(f"--vary {flag(field_name)}: {text!r} is not a{'n' if kind is int else ''} "
                             f"{'true/false' if kind is bool else kind.__name__}") from None
        if choices and value not in choices:
            raise ValueError(f"--vary {flag(field_name)}: {text!r} is not one of {', '.join(choices)}")
        parsed.append(value)
    return field_name, parsed


def main(argv=None) -> int:
    return run_main(ablate_from_flags, argv)


if __name__ == "__main__":
    sys.exit(main())
