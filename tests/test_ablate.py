"""The normalisation ablation: the --norm flag end to end, fair comparisons, the report."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from llama_mini import ModelArgs, RMSNorm, Transformer, load_checkpoint, save_checkpoint
from llama_mini.run import corpus
from llama_mini.ablate import Run, main, summarize, table, time_to_reach
from llama_mini.trainer import NonFiniteLoss, Trainer
from llama_mini.run.start import start_run
from llama_mini.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
import train as train_cli  # noqa: E402  (the top-level script, called in-process)

TINY = dict(dim=32, n_layers=1, n_heads=2, vocab_size=400, seq_len=32, batch_size=4, eval_iters=2)


def flags(**kw) -> list:
    return [a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small text file and a cache folder, so tokenizers train in a moment."""
    root = tmp_path_factory.mktemp("ablate")
    path = root / "tiny.txt"
    path.write_text("\n\n".join(corpus.stories(40_000, seed=3)), encoding="utf-8")
    return {"data": str(path), "cache_dir": str(root / "cache")}


# --- The flag reaches the model and the checkpoint --------------------------------------------


@pytest.mark.parametrize("norm, layer_type", [("rmsnorm", RMSNorm), ("prmsnorm", RMSNorm), ("layernorm", nn.LayerNorm), ("none", nn.Identity)])
def test_checkpoint_rebuilds_the_norm_it_was_saved_with(tmp_path, norm, layer_type):
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=40, norm=norm, norm_p=0.25))
    for p in model.parameters():  # non-trivial norm weights and biases, so loading them matters
        p.data.add_(0.1 * torch.randn_like(p))
    loaded = load_checkpoint(save_checkpoint(model, tmp_path / "ckpt"))
    assert all(isinstance(m, layer_type) for m in (loaded.norm, loaded.layers[0].ffn_norm))  # an RMSNorm may be the fused one
    if norm == "prmsnorm":
        assert loaded.norm.n_rms == 8  # ceil(32 * 0.25)
    tokens = torch.randint(0, 40, (2, 7))
    torch.testing.assert_close(loaded(tokens), model.eval()(tokens))


def test_train_py_norm_flags_reach_the_model_and_its_checkpoint(tmp_path, data):
    run = tmp_path / "run"
    args = flags(**TINY, **data, norm="prmsnorm", norm_p=0.25, max_steps=2, out=run, device="cpu", sample_tokens=0)
    assert train_cli.main(args) == 0
    checkpoint = run / (run / "latest").read_text().strip()
    config = json.loads((checkpoint / "config.json").read_text())["llama_mini"]
    assert (config["norm"], config["norm_p"]) == ("prmsnorm", 0.25)
    model = load_checkpoint(run)
    assert isinstance(model.norm, RMSNorm) and model.norm.n_rms == 8


# --- Fairness: only the norm differs ------------------------------------------------------------


def test_variants_start_from_the_same_matrices_and_see_the_same_batches(tmp_path, data):
    runs = [start_run(TrainConfig(**TINY, **data, norm=n, out=str(tmp_path / n), device="cpu")) for n in ("rmsnorm", "layernorm")]
    states = [run.raw_model.state_dict() for run in runs]
    matrices = [k for k, v in states[0].items() if v.dim() >= 2]
    assert matrices and all(torch.equal(states[0][k], states[1][k]) for k in matrices)
    for _ in range(3):
        x0, y0 = next(runs[0].trainer.batches)
        x1, y1 = next(runs[1].trainer.batches)
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_runs_step_in_a_fresh_order_each_round_which_changes_no_number(tmp_path, data, monkeypatch):
    """A fixed order would give each position its own cache state, hence its own speed."""
    order, real_step = [], Trainer.train_step

    def recording_step(self):
        order.append(self.model.args.norm)
        return real_step(self)

    def train_losses(out, norm):
        with open(out / "metrics.csv") as f:
            return [r["train_loss"] for r in csv.DictReader(f) if r["norm"] == norm and r["train_loss"]]

    common = dict(**TINY, **data, seeds=1, max_steps=6, warmup_steps=1, eval_every=3, device="cpu")
    monkeypatch.setattr(Trainer, "train_step", recording_step)
    assert main(flags(**common, norms="rmsnorm,layernorm,none", out=tmp_path / "three")) == 0
    rounds = [tuple(order[i : i + 3]) for i in range(0, 18, 3)]
    assert all(sorted(r) == ["layernorm", "none", "rmsnorm"] for r in rounds)  # each run once per round
    assert len(set(rounds)) > 1 and len({r[0] for r in rounds}) > 1  # in changing orders
    assert main(flags(**common, norms="layernorm", out=tmp_path / "alone")) == 0
    assert train_losses(tmp_path / "three", "layernorm") == train_losses(tmp_path / "alone", "layernorm")


# --- The report ---------------------------------------------------------------------------------


class FakeTrainer:
    """Stands in for Trainer where only the bookkeeping is under test."""

    def __init__(self, losses=(), diverge_at=None):
        self.losses, self.diverge_at, self.step = list(losses), diverge_at, 0

    def train_step(self):
        if self.step + 1 == self.diverge_at:
            raise NonFiniteLoss("loss is nan")
        self.step += 1
        return self.losses[self.step - 1]


class FakeTraining:
    """Stands in for a TrainingRun: its Trainer and its size."""

    n_params = 1000

    def __init__(self, losses=(), diverge_at=None):
        self.trainer = FakeTrainer(losses, diverge_at)


def run_with_evals(norm, seed, evals):
    """A Run whose evaluations were (step, seconds, val_loss); its bits per byte are half its nats per token."""
    run = Run(norm, seed, FakeTraining())
    run.steps = [{"step": s, "time": t, "val_loss": v, "val_bpb": v / 2} for s, t, v in evals]
    run.seconds = evals[-1][1]
    return run


def test_time_to_reach_interpolates_between_evaluations():
    run = run_with_evals("rmsnorm", 0, [(0, 0.0, 7.0), (10, 4.0, 5.0), (20, 8.0, 3.0)])
    assert time_to_reach(run, 4.0) == pytest.approx(6.0)  # halfway from 5.0 at 4 s to 3.0 at 8 s
    assert time_to_reach(run, 5.0) == pytest.approx(4.0)
    assert time_to_reach(run, 2.0) is None


def test_summary_is_mean_and_sd_over_seeds_with_layernorm_plus_2_percent_as_target():
    runs = [
        run_with_evals("rmsnorm", 0, [(0, 0.0, 7.0), (10, 2.0, 2.0)]),
        run_with_evals("rmsnorm", 1, [(0, 0.0, 7.0), (10, 2.0, 2.2)]),
        run_with_evals("layernorm", 0, [(0, 0.0, 7.0), (10, 4.0, 2.5)]),
        run_with_evals("layernorm", 1, [(0, 0.0, 7.0), (10, 4.0, 2.5)]),
    ]
    rms, ln = summarize(runs, ["rmsnorm", "layernorm"], tokens_per_step=100)
    assert rms["val_loss"] == pytest.approx(2.1) and rms["val_loss_sd"] == pytest.approx(math.sqrt(0.02))
    assert rms["target_loss"] == pytest.approx(2.55)
    assert rms["steps_per_s"] == pytest.approx(20 / 4.0) and rms["tokens_per_s"] == pytest.approx(2000 / 4.0)
    assert ln["time_to_target"] == pytest.approx(4.0 * (7.0 - 2.55) / (7.0 - 2.5))
    assert rms["val_bpb"] == pytest.approx(1.05) and rms["val_bpb_sd"] == pytest.approx(math.sqrt(0.02) / 2)
    assert "| rmsnorm | 2.1000 ± 0.1414 | 1.0500 ± 0.0707 |" in table([rms, ln])


def test_diverged_run_stops_and_is_reported():
    run = Run("none", 0, FakeTraining(losses=[5.0, 4.0, 9.0], diverge_at=3))
    run.steps = [{"step": 0, "time": 0.0, "val_loss": 7.0}]
    for _ in range(3):
        run.step()
    assert run.diverged_at == 3 and [r["step"] for r in run.steps] == [0, 1, 2]
    (row,) = summarize([run], ["none"], tokens_per_step=10, target_loss=1.0)
    assert "| none | diverged (1/1 diverged, at step 3) |" in table([row])


def test_cli_writes_report_metrics_and_plots(tmp_path, data):
    out = tmp_path / "ablation"
    args = flags(**TINY, **data, norms="rmsnorm,layernorm", seeds=2, max_steps=4, warmup_steps=1, eval_every=2, out=out, device="cpu")
    assert main(args) == 0
    report = (out / "report.md").read_text()
    assert "| rmsnorm |" in report and "| layernorm |" in report and "±" in report
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * (4 + 1)  # norms x seeds x (steps + the evaluation at step 0)
    assert sum(1 for r in rows if r["val_loss"]) == sum(1 for r in rows if r["val_bpb"]) == 2 * 2 * 3  # steps 0, 2 and 4
    assert "bits/byte" in report
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "val_loss_vs_step.png").stat().st_size > 0 and (out / "val_loss_vs_time.png").stat().st_size > 0


def test_the_norms_time_is_reported_apart_from_the_steps(tmp_path, data):
    """Each norm's forward and backward, timed apart after training on the step's activations:
    a share of the step's time for RMSNorm, none for the model without norms."""
    out = tmp_path / "ablation"
    assert main(flags(**TINY, **data, norms="rmsnorm,none", seeds=1, max_steps=2, warmup_steps=1, eval_every=2, out=out,
                      device="cpu")) == 0
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in (out / "report.md").read_text().splitlines()
            if line.startswith(("| rmsnorm |", "| none |"))}
    rms, share = rows["rmsnorm"][5].split(" ms (")
    assert float(rms) > 0 and 0 < float(share.rstrip("%)")) < 100
    assert rows["none"][5] == "0.00 ms (0.0%)"


def test_unknown_norm_is_a_one_line_error(capsys):
    assert main(["--norms", "rmsnorm,batchnorm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown norm 'batchnorm' in --norms; choose from") and err.count("\n") == 1


@pytest.mark.parametrize("flags, message", [
    (["--seeds", "0"], "--seeds must be >= 1, got 0"),
    (["--target-loss", "nan"], "--target-loss must be a finite number > 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
])
def test_a_bad_flag_is_a_one_line_error_naming_it(capsys, flags, message):
    assert main(flags) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_out_holding_a_users_files_is_refused_and_left_as_it_was(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "report.md").write_text("my report")
    (out / "metrics.csv").write_text("my,metrics\n")
    assert main(["--out", str(out), "--max-steps", "1"]) == 2
    assert capsys.readouterr().err == (f"error: {out} is not empty (metrics.csv, report.md); only a new or empty "
                                       "folder is written to: pass --out a new folder\n")
    assert sorted(p.name for p in out.iterdir()) == ["metrics.csv", "report.md"]
    assert (out / "report.md").read_text() == "my report" and (out / "metrics.csv").read_text() == "my,metrics\n"


def test_seeds_past_the_last_are_refused_before_anything_is_written(tmp_path, capsys, data):
    out = tmp_path / "ablation"
    args = flags(**TINY, **data, norms="rmsnorm", seeds=2, seed=2**63 - 1, max_steps=1, out=out, device="cpu")
    assert main(args) == 2
    assert capsys.readouterr().err == f"error: --seed {2**63 - 1} with --seeds 2 runs seeds past 2**63 - 1; pass a smaller --seed\n"
    assert not out.exists()


# --- Any flag varied, and a verdict -------------------------------------------------------------


def test_a_varied_flag_other_than_the_norm_trains_its_variants_from_the_same_matrices_on_the_same_batches(tmp_path, data, monkeypatch):
    from llama_mini import ablate
    from llama_mini.run.data import TrainBatches

    runs, batches, real_start, real_next = [], {}, ablate.start_run, TrainBatches.__next__

    def recording_next(self):
        x, y = real_next(self)
        batches.setdefault(id(self), []).append(x.clone())
        return x, y

    monkeypatch.setattr(ablate, "start_run", lambda cfg: runs.append(real_start(cfg)) or runs[-1])
    monkeypatch.setattr(TrainBatches, "__next__", recording_next)
    args = flags(**TINY, **data, seeds=2, max_steps=3, warmup_steps=1, eval_every=3, out=tmp_path / "lr", device="cpu")
    assert main([*args, "--vary", "lr=1e-3,3e-3"]) == 0
    for seed in {run.cfg.seed for run in runs}:
        a, b = sorted((run for run in runs if run.cfg.seed == seed), key=lambda run: run.cfg.lr)
        assert (a.cfg.lr, b.cfg.lr, a.cfg.norm, b.cfg.norm) == (1e-3, 3e-3, "rmsnorm", "rmsnorm")
        assert all(torch.equal(x, y) for x, y in zip(batches[id(a.batches)], batches[id(b.batches)]))
        assert len(batches[id(a.batches)]) == 3
    report = (tmp_path / "lr" / "report.md").read_text()
    assert "Varied: --lr;" in report and "| 0.001 vs 0.003 |" in report
    with open(tmp_path / "lr" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    first = {r["lr"]: r["train_loss"] for r in rows if r["step"] == "1" and r["seed"] == str(runs[0].cfg.seed)}
    assert first["0.001"] == first["0.003"]  # the same matrices and batch: the first loss, before any update, agrees


def test_two_flags_varied_train_every_combination():
    from llama_mini.ablate import label, parse_vary

    assert parse_vary("lr=1e-3,3e-3") == ("lr", [1e-3, 3e-3])
    assert parse_vary("--n-layers=2,4") == ("n_layers", [2, 4])
    assert parse_vary("tie-embeddings=true,false") == ("tie_embeddings", [True, False])
    assert label({"norm": "rmsnorm"}) == "rmsnorm" and label({"norm": "rmsnorm", "lr": 0.001}) == "norm=rmsnorm lr=0.001"


def test_paired_statistics_equal_a_direct_computation_on_a_known_table():
    """Student's t quantiles as printed in every table (Fisher & Yates), and a p-value integrated
    from t's density directly: the paired interval and test of a known set of differences."""
    from llama_mini.support.paired import paired, t_quantile

    for df, printed in ((1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (29, 2.045)):
        assert t_quantile(0.975, df) == pytest.approx(printed, abs=5e-4)
    a, b = [2.5, 2.7, 2.6, 2.9], [2.4, 2.4, 2.4, 2.5]  # differences 0.1, 0.3, 0.2, 0.4
    result = paired(a, b)
    mean, se = 0.25, math.sqrt(sum((d - 0.25) ** 2 for d in (0.1, 0.3, 0.2, 0.4)) / 3) / 2
    assert result.n == 4 and result.mean == pytest.approx(mean)
    assert (result.low, result.high) == pytest.approx((mean - 3.182446 * se, mean + 3.182446 * se), abs=1e-6)
    density = lambda t: math.gamma(2) / (math.sqrt(3 * math.pi) * math.gamma(1.5)) * (1 + t * t / 3) ** -2  # df 3
    t, step = mean / se, 1e-3
    tail = sum(density(t + (i + 0.5) * step) for i in range(200_000)) * step  # t out to t + 200
    assert result.p == pytest.approx(2 * tail, rel=1e-3) and result.detected
    assert paired([1.0, None, 3.0], [0.5, 2.0, 2.0]).n == 2  # a seed that diverged is left out of the pairs
    assert paired([1.0], [0.5]).low is None  # one seed: no interval


def test_identical_variants_get_no_difference_detected(tmp_path, data, capsys):
    """--dtype auto is float32 on a CPU: two names for one training, so the same bits per byte."""
    args = flags(**TINY, **data, seeds=2, max_steps=3, warmup_steps=1, eval_every=3, out=tmp_path / "same", device="cpu")
    assert main([*args, "--vary", "dtype=auto,float32"]) == 0
    row = next(line for line in (tmp_path / "same" / "report.md").read_text().splitlines() if line.startswith("| auto vs float32 |"))
    bpb = row.split(" | ")[2]
    assert bpb.startswith("+0.0000 [+0.0000, +0.0000], p 1: no difference detected"), row
    assert "no difference detected" in capsys.readouterr().out


@pytest.mark.usefixtures("kernel_library")
def test_flush_denormals_holds_for_every_variant_and_the_report_says_so(tmp_path, data):
    """The mode is the process's, so every run of the ablation trains with it (in a subprocess: it stays set)."""
    args = flags(**TINY, **data, seeds=1, max_steps=2, warmup_steps=1, eval_every=2, out=tmp_path / "flushed", device="cpu")
    done = subprocess.run([sys.executable, "-m", "llama_mini.ablate", *args, "--norms", "rmsnorm,layernorm", "--flush-denormals"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr
    assert ", --flush-denormals True, " in (tmp_path / "flushed" / "report.md").read_text()


@pytest.mark.parametrize("vary, message", [
    (["--vary", "learning-rate=1e-3,3e-3"], "(--learning-rate is not a train.py flag)"),
    (["--vary", "lr"], "--vary 'lr': give a train.py flag and its values"),
    (["--vary", "lr=1e-3"], "--vary --lr needs two or more different values, comma-separated; got '1e-3'"),
    (["--vary", "lr=1e-3,1e-3"], "--vary --lr needs two or more different values"),
    (["--vary", "lr=1e-3,fast"], "--vary --lr: 'fast' is not a float"),
    (["--vary", "lr=1e-3,-1"], "--lr must be > 0, got -1.0"),
    (["--vary", "norm=rmsnorm,batchnorm"], "--vary --norm: 'batchnorm' is not one of rmsnorm, prmsnorm, layernorm, none"),
    (["--vary", "out=a,b"], "--vary --out: it says where or how a run is written or watched"),
    (["--vary", "flush-denormals=true,false"], "--vary --flush-denormals: it sets the whole process (every CPU thread)"),
    (["--vary", "lr=1e-3,3e-3", "--vary", "lr=1e-2,3e-2"], "--lr is varied twice (--vary)"),
    (["--norms", "rmsnorm,layernorm", "--vary", "norm=rmsnorm,none"], "--norm is varied twice (--norms and --vary norm)"),
])
def test_a_bad_vary_is_one_line_before_any_work(tmp_path, capsys, vary, message):
    out = tmp_path / "ablation"
    assert main(["--out", str(out), "--max-steps", "1", *vary]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists()
