"""llama_mini against nanoGPT, trained side by side on Tiny Shakespeare.

nanoGPT's own train.py runs its README's CPU recipe ("I only have a macbook": a 4-layer,
128-wide character model, 64 characters of context, batches of 12, 2000 steps, learning rate
1e-3 with 100 steps of warmup and a cosine to 1e-4, evaluation every 250 steps on 20 batches).
llama_mini's train.py runs at the same time on the same text at the same shape, batch and
schedule, each process on one thread (OMP_NUM_THREADS=1), so that load from other processes
falls on both alike. The bench timestamps every validation point of both on one clock: its
own wall clock from the moment it starts the two processes, startup (imports, building the
model, torch.compile) included.

It reports the validation loss in nats per character at equal steps and at equal wall time,
and the wall time each one takes to reach nanoGPT's final validation loss. llama_mini's
tokenizer has one token per character here (the text's 65 characters plus byte fallbacks and
specials: 323 tokens), so its nats per token are nats per character.

The data is prepared before the clock starts, without network: nanoGPT's
data/shakespeare_char/prepare.py runs on a copy of the fixture text in a scratch folder (it
downloads only when input.txt is missing), and llama_mini trains its tokenizer, tokenizes the
text and builds its CPU kernels there too. nanoGPT's code is not part of this repository:
pass its folder (a checkout of github.com/karpathy/nanoGPT) as --nanogpt.

    python bench/train_vs_nanogpt.py --nanogpt ../nanoGPT
    python bench/train_vs_nanogpt.py --nanogpt ../nanoGPT --llama-args="--compile"      # llama_mini compiled
    python bench/train_vs_nanogpt.py --nanogpt ../nanoGPT --max-steps 200               # a quick look
    python bench/train_vs_nanogpt.py --nanogpt ../nanoGPT --seeds 3                     # three pairs: the spread
    python bench/train_vs_nanogpt.py --nanogpt ../nanoGPT --seeds 3 \
        --llama-args="--multiple-of 32 --n-layers 2 --max-steps 700 --lr 3e-3"         # the fastest recipe found
"""

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
FIXTURE = REPO.parent / "shared" / "fixtures" / "tinyshakespeare" / "input.txt"

# nanoGPT's README, "I only have a macbook", with --max_iters and --lr_decay_iters from --max-steps.
NANOGPT_RECIPE = ("config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1 "
                  "--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --dropout=0.0")
# The same shape, batch and schedule for llama_mini (what it cannot match is listed in the record).
LLAMA_RECIPE = ("--vocab-size 323 --dim 128 --n-layers 4 --n-heads 4 --seq-len 64 --batch-size 12 --lr 1e-3 "
                "--min-lr 1e-4 --warmup-steps 100 --eval-every 250 --eval-iters 20 --sample-tokens 0")
VAL_LINES = {  # how each one prints a validation loss
    "nanoGPT": re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)"),
    "llama_mini": re.compile(r"^step (\d+): val loss ([\d.]+)"),
}


def prepare_nanogpt_data(nanogpt: Path, text: Path, folder: Path) -> Path:
    """nanoGPT's shakespeare_char train.bin, val.bin and meta.pkl, written by its own prepare.py
    beside a copy of the text (so it downloads nothing)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(nanogpt / "data" / "shakespeare_char" / "prepare.py", folder / "prepare.py")
    shutil.copyfile(text, folder / "input.txt")
    # prepare.py imports requests for the download it skips here; a stand-in if it is not installed.
    run = ("import runpy, sys, types\ntry:\n    import requests\nexcept ImportError:\n"
           "    sys.modules['requests'] = types.ModuleType('requests')\nrunpy.run_path('prepare.py', run_name='__main__')")
    subprocess.run([sys.executable, "-c", run], cwd=folder, check=True, stdout=subprocess.DEVNULL)
    return folder


def prepare_llama_mini(text: Path, vocab_size: int, cache_dir: Path) -> None:
    """Train the tokenizer, tokenize the text and build the CPU kernels: one-time work that the
    timed run then finds done."""
    from llama_mini import ModelArgs, Transformer
    from llama_mini.kernels import use_fused_rmsnorm
    from llama_mini.run.data import load_tokenizer, open_corpus, tokenize

    corpus = open_corpus(str(text))
    tokenizer = load_tokenizer(corpus, vocab_size, cache_dir)
    tokenize(corpus, tokenizer, cache_dir)
    n_chars = len(text.read_text(encoding="utf-8"))
    n_tokens = len(tokenizer.encode(text.read_text(encoding="utf-8"), bos=False))
    print(f"llama_mini's tokenizer: {tokenizer.n_words} tokens; {n_chars:,} characters -> {n_tokens:,} tokens")
    use_fused_rmsnorm(Transformer(ModelArgs(dim=64, n_layers=1, n_heads=1, vocab_size=8)))


class Run:
    """One training process; a thread reads its output and timestamps each validation loss."""

    def __init__(self, name: str, cmd: list, cwd: Path, env: dict, log: Path, start: float):
        self.name, self.start, self.points, self.end = name, start, [], None
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            now = time.perf_counter() - self.start
            self.log.write(f"[{now:9.3f}] {line}")
            if m := VAL_LINES[self.name].match(line):
                self.points.append((int(m[1]), now, float(m[2])))
        self.proc.wait()
        self.end = time.perf_counter() - self.start
        self.log.close()

    def wait(self) -> int:
        self.thread.join()
        return self.proc.returncode


def loss_at_time(points, t):
    """The validation loss at wall time t, linear between evaluations after step 0; None
    outside them."""
    pts = [(pt, loss) for step, pt, loss in points if step > 0]
    if pts and t == pts[0][0]:
        return pts[0][1]
    for (t0, l0), (t1, l1) in zip(pts, pts[1:]):
        if t0 <= t <= t1:
            return l0 + (l1 - l0) * (t - t0) / (t1 - t0)
    return None


def time_to(points, target):
    """(wall time, step) at which the loss curve first reaches target, linear between
    evaluations; None if it never does."""
    for (s0, t0, l0), (s1, t1, l1) in zip(points, points[1:]):
        if l1 <= target:
            f = (l0 - target) / (l0 - l1) if l0 > target else 0.0
            return t0 + f * (t1 - t0), s0 + f * (s1 - s0)
    return None


def step_ms(run_dir: Path, nanogpt_log: Path):
    """Median milliseconds per training step of each (llama_mini's metrics.jsonl, nanoGPT's iter lines)."""
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    times = [r["time"] for r in rows if "time" in r]
    llama = statistics.median(b - a for a, b in zip(times[1:], times[2:])) * 1e3
    iters = [float(m[1]) for m in re.finditer(r"iter \d+: loss [\d.]+, time ([\d.]+)ms", nanogpt_log.read_text())]
    return llama, statistics.median(iters[1:])


def plot(path: Path, runs: dict, target: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, run in runs.items():
        pts = [p for p in run.points if p[0] > 0]
        by_time.plot([p[1] for p in pts], [p[2] for p in pts], "o-", label=name)
        by_step.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=name)
    for ax, xlabel in ((by_time, "wall time from start (s), startup included"), (by_step, "step")):
        ax.axhline(target, color="grey", lw=0.8, ls="--", label=f"nanoGPT's final val loss ({target:.3f})")
        ax.set(xlabel=xlabel, ylabel="val loss (nats per character)")
        ax.grid(alpha=0.3)
        ax.legend()
    by_time.set_title("against wall time (one thread each, run together)")
    by_step.set_title("against steps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")


def report(runs: dict, work=None):
    """The tables: loss at equal steps, at equal wall time, and the time to nanoGPT's final loss;
    returns llama_mini's time to that loss as a fraction of nanoGPT's (None if it never gets there)."""
    ng, lm = runs["nanoGPT"], runs["llama_mini"]
    target = ng.points[-1][2]

    print("\nvalidation loss (nats per character) at equal steps; wall time (s) from start")
    print(f"{'step':>6} {'nanoGPT':>9} {'time':>7} {'llama_mini':>11} {'time':>7}")
    lm_by_step = {s: (t, v) for s, t, v in lm.points}
    for s, t, v in ng.points:
        if s > 0 and s in lm_by_step:
            print(f"{s:>6} {v:>9.4f} {t:>7.1f} {lm_by_step[s][1]:>11.4f} {lm_by_step[s][0]:>7.1f}")

    # Each run's loss is known at its evaluations and taken as linear in between: compare at
    # every evaluation of either, from the first time both have evaluated past step 0 until
    # nanoGPT's last (after llama_mini's last, its final model counts).
    print("\nat equal wall time (at the evaluations of either; the other's loss linear between its own)")
    print(f"{'time':>7} {'nanoGPT':>9} {'llama_mini':>11}")
    first = max(next(t for s, t, _ in run.points if s > 0) for run in runs.values())
    times = sorted({t for run in runs.values() for s, t, _ in run.points if s > 0 and first <= t <= ng.points[-1][1]})
    lower_everywhere = True
    for t in times:
        theirs = loss_at_time(ng.points, t)
        ours = loss_at_time(lm.points, t) if t <= lm.points[-1][1] else lm.points[-1][2]
        lower_everywhere &= ours < theirs
        print(f"{t:>7.1f} {theirs:>9.4f} {ours:>11.4f}")
    print(f"(before {first:.1f} s one of them has not evaluated past step 0 yet)")

    ng_time, lm_reach = ng.end, time_to(lm.points, target)
    print(f"\nnanoGPT's final val loss {target:.4f}: nanoGPT's whole run {ng_time:.1f} s (last evaluation at "
          f"{ng.points[-1][1]:.1f} s)")
    if lm_reach:
        print(f"llama_mini reaches it at {lm_reach[0]:.1f} s (step {lm_reach[1]:.0f}): "
              f"{lm_reach[0] / ng.points[-1][1]:.3f} of nanoGPT's time to it (goal: at most 0.2)")
    else:
        print("llama_mini does not reach it")
    print(f"llama_mini's loss is lower at every equal wall time: {'yes' if lower_everywhere else 'no'}")
    print(f"whole runs: nanoGPT {ng.end:.1f} s, llama_mini {lm.end:.1f} s; final val loss nanoGPT {target:.4f}, "
          f"llama_mini {lm.points[-1][2]:.4f}")
    try:
        lm_ms, ng_ms = step_ms(Path(work) / "llama-run", Path(work) / "nanogpt.log")
        print(f"median training step: nanoGPT {ng_ms:.1f} ms, llama_mini {lm_ms:.1f} ms ({lm_ms / ng_ms:.2f}x)")
    except (OSError, ValueError, TypeError):  # no logs (--report)
        pass
    return lm_reach[0] / ng.points[-1][1] if lm_reach else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nanogpt", type=Path, help="a checkout of nanoGPT (its train.py is run)")
    p.add_argument("--data", type=Path, default=FIXTURE, help=f"the text (default: {FIXTURE})")
    p.add_argument("--max-steps", type=int, default=2000, help="steps for both (default: 2000, the recipe's)")
    p.add_argument("--llama-args", default="",
                   help="more train.py flags for llama_mini, e.g. --compile (default: none)")
    p.add_argument("--threads", type=int, default=1, help="threads per process (default: 1)")
    p.add_argument("--seeds", type=int, default=1,
                   help="pairs to run one after another, llama_mini with --seed 1337, 1338, ... (nanoGPT's train.py "
                        "fixes its own seed: its losses repeat, its time varies); the spread of the ratios (default: 1)")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a new temporary one)")
    p.add_argument("--warm-compile-cache", action="store_true",
                   help="keep torch.compile's cache from earlier runs (default: a new, empty one, so "
                        "compiling counts in full)")
    p.add_argument("--json", type=Path, default=None, help="write the validation points here")
    p.add_argument("--plot", type=Path, default=None, help="the PNG (default: WORK/train_vs_nanogpt.png)")
    p.add_argument("--report", type=Path, default=None, help="print the tables (and --plot) of a --json file, without running")
    args = p.parse_args()
    if args.report:
        saved = json.loads(args.report.read_text())
        runs = {name: argparse.Namespace(points=[tuple(pt) for pt in run["points"]], end=run["end"]) for name, run in saved.items()}
        report(runs)
        if args.plot:
            plot(args.plot, runs, runs["nanoGPT"].points[-1][2])
        return
    if args.seeds < 1:
        p.error(f"--seeds {args.seeds}: give at least 1 pair to run")
    if args.nanogpt is None:
        p.error("--nanogpt DIR is required (or --report JSON)")

    nanogpt = args.nanogpt.resolve()
    if not (nanogpt / "train.py").is_file() or not (nanogpt / "data" / "shakespeare_char" / "prepare.py").is_file():
        sys.exit(f"error: {nanogpt} is not a nanoGPT checkout (no train.py or data/shakespeare_char/prepare.py); "
                 "pass --nanogpt the folder of github.com/karpathy/nanoGPT")
    work = (args.work or Path(tempfile.mkdtemp(prefix="train_vs_nanogpt-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)

    # One-time preparation, before the clock starts.
    data_dir = prepare_nanogpt_data(nanogpt, args.data, work / "shakespeare_char")
    prepare_llama_mini(args.data, 323, work / "tokenizer")
    import torch

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "PYTHONUNBUFFERED": "1"}
    if not args.warm_compile_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor-cache")
    nanogpt_cmd = [sys.executable, "train.py", *shlex.split(NANOGPT_RECIPE), f"--max_iters={args.max_steps}",
                   f"--lr_decay_iters={args.max_steps}", f"--dataset={data_dir}", f"--out_dir={work / 'nanogpt-out'}"]
    ratios = []
    for seed in range(1337, 1337 + args.seeds):
        for old in ("nanogpt-out", "llama-run", *(() if args.warm_compile_cache else ("inductor-cache",))):
            shutil.rmtree(work / old, ignore_errors=True)
        llama_cmd = [sys.executable, str(REPO / "train.py"), "--data", str(args.data), *shlex.split(LLAMA_RECIPE),
                     "--max-steps", str(args.max_steps), "--cache-dir", str(work / "tokenizer"),
                     "--out", str(work / "llama-run"), "--seed", str(seed), *shlex.split(args.llama_args)]
        print(f"\nnanoGPT:    (cd {nanogpt} && {shlex.join(nanogpt_cmd[1:])})")
        print(f"llama_mini: {shlex.join(llama_cmd[1:])}")
        print(f"torch {torch.__version__}, {args.threads} thread(s) each, run together; logs in {work}")
        start = time.perf_counter()
        runs = {"nanoGPT": Run("nanoGPT", nanogpt_cmd, nanogpt, env, work / "nanogpt.log", start),
                "llama_mini": Run("llama_mini", llama_cmd, REPO, env, work / "llama_mini.log", start)}
        for name, run in runs.items():
            if run.wait() != 0:
                sys.exit(f"error: {name} exited with {run.proc.returncode}; its output is in {run.log.name}")
        if args.json:
            json_path = args.json if args.seeds == 1 else args.json.with_name(f"{args.json.stem}-seed{seed}{args.json.suffix}")
            json_path.write_text(json.dumps({name: {"points": run.points, "end": run.end} for name, run in runs.items()}, indent=1))
        ratios.append(report(runs, work))
        plot(args.plot or work / "train_vs_nanogpt.png", runs, runs["nanoGPT"].points[-1][2])
    if args.seeds > 1:
        reached = [r for r in ratios if r is not None]
        spread = (f"mean {statistics.mean(reached):.3f}, sd {statistics.stdev(reached):.3f}, "
                  f"{min(reached):.3f} to {max(reached):.3f}" if len(reached) > 1 else "")
        print(f"\n{args.seeds} pairs: llama_mini's time to nanoGPT's final loss, as a fraction of nanoGPT's: "
              f"{', '.join('not reached' if r is None else f'{r:.3f}' for r in ratios)}; {spread}")

if __name__ == "__main__":
    main()
