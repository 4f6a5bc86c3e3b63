"""Training: the optimizer recipe, train.py end to end, checkpoints, exact resume, bad input."""

import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import llama_mini
from llama_mini.run import corpus
from llama_mini.run.folder import read_metrics
from llama_mini.trainer import NonFiniteLoss, configure_optimizer, flops_per_token, lr_at
from llama_mini.run.start import start_run
from llama_mini.run.training_run import sample_text
from llama_mini.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
import train as train_cli  # noqa: E402  (the top-level script, imported to call main() in-process)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY = dict(dim=32, n_layers=2, n_heads=2, vocab_size=400, seq_len=32, batch_size=4, eval_iters=2, sample_tokens=20)


def flags(**kw) -> list[str]:
    out = []
    for k, v in kw.items():
        out += [f"--{k.replace('_', '-')}"] if v is True else [f"--{k.replace('_', '-')}", str(v)]
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tiny.txt"
    path.write_text("\n\n".join(corpus.stories(60_000, seed=7)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


class Cli:
    """train.py in a subprocess, its output in files (a full pipe would stall it)."""

    def __init__(self, args, logs: Path):
        logs.mkdir(parents=True, exist_ok=True)
        self.out, self.err = logs / "stdout", logs / "stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            # One thread: a tiny model gains nothing from two, and a loaded machine stalls them.
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, str(ROOT / "train.py"), *map(str, args)]
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, env=env)

    def wait_for(self, path: Path) -> None:
        """Block until path exists, failing if the process ends first."""
        while not path.exists():
            assert self.proc.poll() is None, self.err.read_text()
            time.sleep(0.005)

    def finish(self, timeout=120):
        self.proc.wait(timeout=timeout)
        return self.proc.returncode, self.out.read_text(), self.err.read_text()


def final_weights(run: Path) -> dict:
    return load_file(run / (run / "latest").read_text().strip() / "model.safetensors")


# --- The recipe ---------------------------------------------------------------------------------


def test_lr_warms_up_linearly_then_follows_a_cosine_to_a_tenth():
    hp = TrainConfig(lr=1e-3, warmup_steps=10, max_steps=110).hyperparameters()
    assert lr_at(0, hp) == pytest.approx(1e-4)
    assert lr_at(4, hp) == pytest.approx(5e-4)
    assert lr_at(9, hp) == pytest.approx(1e-3)
    assert lr_at(10, hp) == pytest.approx(1e-3)
    assert lr_at(60, hp) == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway down the cosine
    assert lr_at(110, hp) == pytest.approx(1e-4)


def test_weight_decay_applies_to_matrices_only():
    model = llama_mini.Transformer(llama_mini.ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=50))
    opt = configure_optimizer(model, TrainConfig(weight_decay=0.1).hyperparameters(), torch.device("cpu"))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    assert len(plain["params"]) == 2 * 2 + 1  # two norms per block and the final one


def test_wsd_warms_up_holds_the_peak_and_decays_linearly_over_the_last_fifth():
    hp = TrainConfig(lr=1e-3, warmup_steps=10, max_steps=100, lr_schedule="wsd").hyperparameters()
    assert [lr_at(step, hp) for step in (0, 9)] == pytest.approx([1e-4, 1e-3])
    assert [lr_at(step, hp) for step in (10, 50, 80)] == pytest.approx([1e-3] * 3)  # stable up to the decay's start
    assert lr_at(90, hp) == pytest.approx(1e-3 - 0.5 * 9e-4)  # halfway down the line
    assert lr_at(100, hp) == pytest.approx(1e-4)


def test_muon_takes_the_blocks_matrices_and_adamw_the_embedding_head_and_norms():
    model = llama_mini.Transformer(llama_mini.ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=50))
    opt = configure_optimizer(model, TrainConfig(optimizer="muon").hyperparameters(), torch.device("cpu"))
    muon, adamw = opt.optimizers
    names = {id(p): name for name, p in model.named_parameters()}
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    assert sorted(names[id(p)] for g in muon.param_groups for p in g["params"]) == sorted(
        name for name, p in model.named_parameters() if name.startswith("layers.") and p.dim() == 2)
    assert sorted(names[id(p)] for g in adamw.param_groups for p in g["params"]) == sorted(
        name for name, p in model.named_parameters() if not (name.startswith("layers.") and p.dim() == 2))
    assert len(opt.param_groups) == len(muon.param_groups) + len(adamw.param_groups)  # the schedule sets every one


def test_a_muon_step_moves_a_block_matrix_by_its_gradient_orthogonalised_at_adamws_size():
    """Muon's first update of a matrix is its gradient orthogonalised (Newton-Schulz): a gradient
    whose singular values span 100x gives an update whose singular values are alike, of RMS
    0.2 * lr (match_rms_adamw: the size of a typical AdamW update, so --lr means the same)."""
    torch.manual_seed(0)
    model = llama_mini.Transformer(llama_mini.ModelArgs(dim=64, n_layers=1, n_heads=2, vocab_size=50))
    opt = configure_optimizer(model, TrainConfig(optimizer="muon", lr=1e-3, weight_decay=0.0).hyperparameters(),
                              torch.device("cpu"))
    w = model.layers[0].feed_forward.w1.weight  # (hidden, dim)
    u, _, vh = torch.linalg.svd(torch.randn_like(w), full_matrices=False)
    w.grad = u @ torch.diag(torch.logspace(0, 2, vh.shape[0])) @ vh
    before = w.detach().clone()
    opt.step()
    sv = torch.linalg.svdvals(w.detach() - before)
    assert sv.max() / sv.min() < 2  # the gradient's: 100
    assert (w.detach() - before).square().mean().sqrt().item() == pytest.approx(0.2 * 1e-3, rel=0.3)


def test_flops_per_token_counts_six_per_matmul_weight_plus_attention():
    args = llama_mini.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, multiple_of=32)
    model = llama_mini.Transformer(args)
    matmul_weights = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "tok_embeddings" not in name)
    assert flops_per_token(args, seq_len=128) == 6 * matmul_weights + 12 * 2 * 64 * 128


@pytest.mark.parametrize(
    "field, value", [("max_steps", 0), ("batch_size", -1), ("seq_len", 0), ("grad_accum", 0), ("eval_every", 0)]
)
def test_config_refuses_non_positive_sizes_naming_the_flag(field, value):
    bounds = r"in \[1, 16777216\] tokens" if field == "seq_len" else ">= 1"
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} must be {bounds}, got {value}"):
        TrainConfig(**{field: value})


@pytest.mark.parametrize("slowdown", [14.6, 1.1])
def test_bf16_on_a_cpu_without_fast_bf16_products_says_once_what_it_costs(capsys, monkeypatch, text_file, cache_dir,
                                                                          tmp_path, slowdown):
    """Where torch multiplies bf16 matrices much slower than fp32 ones (CPUs without AVX-512 BF16
    or AMX), --dtype bfloat16 says so once, with the factor and the fix; elsewhere nothing."""
    from llama_mini.support import device

    monkeypatch.setattr(device, "bfloat16_slowdown", lambda: slowdown)
    argv = flags(data=text_file, cache_dir=cache_dir, out=tmp_path / "run", device="cpu", max_steps=2, dtype="bfloat16",
                 **TINY)
    assert train_cli.main(argv) == 0
    note = ("note: on this CPU torch multiplies bfloat16 matrices 15x slower than float32 ones (it has no AVX-512 "
            "BF16 or AMX); --dtype float32 runs faster here")
    assert capsys.readouterr().out.count(note) == (slowdown > 2)


def test_gradient_accumulation_equals_one_big_batch(text_file, cache_dir, tmp_path):
    def one_step(batch_size, grad_accum, out):
        cfg = TrainConfig(data=str(text_file), cache_dir=str(cache_dir), out=str(tmp_path / out), device="cpu",
                          max_steps=3, **{**TINY, "batch_size": batch_size}, grad_accum=grad_accum)
        run = start_run(cfg)
        loss = run.trainer.train_step()
        return loss, run.raw_model.state_dict()

    big_loss, big = one_step(4, 1, "big")
    acc_loss, acc = one_step(2, 2, "acc")
    assert acc_loss == pytest.approx(big_loss, rel=1e-5)
    for name in big:
        torch.testing.assert_close(acc[name], big[name], rtol=1e-4, atol=1e-6)


def test_kernels_off_trains_model_pys_own_code_and_auto_the_fused_layers_with_the_same_first_loss(text_file, cache_dir, tmp_path):
    """--kernels off leaves every RMSNorm and FeedForward the model's own; auto makes them the
    fused kernels', which compute the same function (the norm's forward bit for bit, the gate's
    silu within 2 ulp), so the first step's loss agrees to float rounding."""
    from llama_mini.kernels import FusedFeedForward, FusedRMSNorm, fused_rmsnorm
    from llama_mini.kernels.operators import operators
    from llama_mini.model import FeedForward, RMSNorm

    losses = {}
    for kernels in ("off", "auto"):
        cfg = TrainConfig(data=str(text_file), cache_dir=str(cache_dir), out=str(tmp_path / kernels), device="cpu",
                          max_steps=3, kernels=kernels, **TINY)
        run = start_run(cfg)
        norms = [m for m in run.raw_model.modules() if isinstance(m, RMSNorm)]
        gates = [m for m in run.raw_model.modules() if isinstance(m, FeedForward)]
        fused = kernels == "auto" and fused_rmsnorm.cpu_kernel()[0] is not None
        assert norms and all(type(m) is (FusedRMSNorm if fused else RMSNorm) for m in norms)
        fused = kernels == "auto" and operators() is not None
        assert gates and all(type(m) is (FusedFeedForward if fused else FeedForward) for m in gates)
        losses[kernels] = run.trainer.train_step()
        run.close()
    assert losses["auto"] == pytest.approx(losses["off"], rel=1e-6)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own, compiling
def test_compile_compiles_each_block_and_trains_as_eager_does(text_file, cache_dir, tmp_path):
    """--compile compiles the blocks in place (the weights keep their names), and three steps
    end with eager's losses and weights, up to float32 rounding."""
    runs = {}
    for compile in (False, True):
        cfg = TrainConfig(data=str(text_file), cache_dir=str(cache_dir), out=str(tmp_path / str(compile)), device="cpu",
                          max_steps=3, compile=compile, **TINY)
        run = start_run(cfg)
        assert run.trainer.model is run.raw_model
        losses = [run.trainer.train_step() for _ in range(3)]
        runs[compile] = losses, run.raw_model.state_dict()
        run.close()
    (eager_losses, eager), (compiled_losses, compiled) = runs[False], runs[True]
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5)
    assert compiled.keys() == eager.keys()
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-4, atol=1e-6)


def test_trainer_learns_and_samples(text_file, cache_dir, tmp_path):
    cfg = TrainConfig(data=str(text_file), cache_dir=str(cache_dir), out=str(tmp_path / "run"), device="cpu",
                      max_steps=60, lr=3e-3, warmup_steps=5, **TINY)
    run = start_run(cfg)
    before = run.evaluate()
    assert before["val_loss"] == pytest.approx(math.log(400), rel=0.05)  # near-uniform guess at init
    assert before["val_ppl"] == pytest.approx(math.exp(before["val_loss"]))
    for _ in range(60):
        run.trainer.train_step()
    after = run.evaluate()
    assert after["val_loss"] < before["val_loss"] - 1.0
    text = sample_text(run.raw_model, run.tokenizer, "Once upon a time", 10, seed=cfg.seed)  # train.py's end-of-run sample
    assert text.startswith("Once upon a time") and len(text) > len("Once upon a time")


def test_bits_per_byte_is_the_nats_over_ln2_and_the_bytes_the_scored_text_decodes_to(cache_dir, tmp_path):
    """A model that guesses uniformly loses ln V nats on every token, so its bits per byte is
    log2 V times the tokens scored, over the UTF-8 bytes SentencePiece decodes them to (é, ï
    and 日本 are 2 and 3 bytes each)."""
    text = tmp_path / "text.txt"  # one document: its BOS is the first token, outside the validation split
    text.write_text("\n".join(f"Café {i} naïve 日本 story." for i in range(3000)), encoding="utf-8")
    cfg = TrainConfig(data=str(text), cache_dir=str(cache_dir), out=str(tmp_path / "run"), device="cpu",
                      max_steps=1, **{**TINY, "vocab_size": 300})
    run = start_run(cfg)
    with torch.no_grad():
        run.raw_model.output.weight.zero_()  # every logit 0: the uniform guess
    result = run.evaluate()
    assert result["val_loss"] == pytest.approx(math.log(300), rel=1e-6)
    starts = run.tokens.even_starts("val", cfg.eval_iters * cfg.batch_size, cfg.seq_len)
    x, y = run.tokens.windows("val", starts, cfg.seq_len)
    sp = run.tokenizer.sp
    windows = torch.cat([x[:, :1], y], dim=1).tolist()
    decoded = sum(len(sp.decode(w).encode()) - len(sp.decode(w[:1]).encode()) for w in windows)
    assert decoded > y.numel()  # multi-byte characters
    assert result["val_bpb"] == pytest.approx(y.numel() * math.log2(300) / decoded, rel=1e-6)
    run.close()


def test_non_finite_loss_stops_naming_the_step_without_touching_the_weights(text_file, cache_dir, tmp_path):
    cfg = TrainConfig(data=str(text_file), cache_dir=str(cache_dir), out=str(tmp_path / "run"), device="cpu",
                      max_steps=5, **TINY)
    trainer = start_run(cfg).trainer
    trainer.train_step()
    with torch.no_grad():
        trainer.model.layers[0].feed_forward.w1.weight[0, 0] = float("inf")
    snapshot = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(NonFiniteLoss, match=r"loss is (nan|inf) at step 2; stopped before updating the weights"):
        trainer.train_step()
    assert all(torch.equal(v, snapshot[k]) for k, v in trainer.model.state_dict().items())


# --- train.py end to end -----------------------------------------------------------------------


def uninterrupted_run(text_file, cache_dir, tmp, **recipe) -> dict:
    """One run that nothing stops; the interrupted ones below must end with exactly its weights."""
    base = dict(data=text_file, cache_dir=cache_dir, device="cpu", max_steps=80, save_every=8, eval_every=40, **TINY, **recipe)
    rc, stdout, stderr = Cli([*flags(**base), "--out", tmp / "run"], tmp / "logs").finish()
    assert rc == 0, stderr
    return dict(base=base, args=flags(**base), out=tmp / "run", stdout=stdout)


@pytest.fixture(scope="module")
def reference_run(text_file, cache_dir, tmp_path_factory):
    return uninterrupted_run(text_file, cache_dir, tmp_path_factory.mktemp("ref"))


@pytest.fixture(scope="module")
def muon_wsd_run(text_file, cache_dir, tmp_path_factory):
    """The speedrun anchors' recipe: Muon with AdamW, and a warmup-stable-decay schedule."""
    return uninterrupted_run(text_file, cache_dir, tmp_path_factory.mktemp("muon"), optimizer="muon", lr_schedule="wsd")


def test_run_folder_holds_checkpoints_metrics_and_latest(reference_run):
    out = reference_run["out"]
    assert (out / "latest").read_text().strip() == "step-000080"
    assert sorted(p.name for p in out.glob("step-*")) == ["step-000072", "step-000080"]  # the newest two
    files = {p.name for p in (out / "step-000080").iterdir()}
    assert files == {"model.safetensors", "config.json", "tokenizer.model", "train_state.pt"}
    state = torch.load(out / "step-000080" / "train_state.pt", weights_only=True)
    assert state["step"] == 80 and {"optimizer", "data_rng", "torch_rng", "python_rng"} <= state.keys()
    assert (out / "tokenizer.model").is_file() and (out / "metrics.jsonl").is_file()
    assert not list(out.glob(".tmp*"))


def test_metrics_log_has_a_record_per_step_and_evaluations(reference_run):
    records = read_metrics(reference_run["out"] / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(81))
    assert {"step", "time", "train_loss", "lr", "tokens_per_s"} <= records[1].keys()
    evals = [r["step"] for r in records if "val_loss" in r]
    assert evals == [0, 40, 80]
    assert records[80]["val_ppl"] == pytest.approx(math.exp(records[80]["val_loss"]))
    assert records[80]["val_loss"] < records[0]["val_loss"]
    assert records[80]["val_bpb"] < records[0]["val_bpb"] and all("val_bpb" in records[s] for s in evals)
    assert f"{records[80]['val_bpb']:.4f} bits/byte" in reference_run["stdout"]


def test_run_ends_with_a_sample_from_the_saved_model(reference_run):
    assert "sample from" in reference_run["stdout"] and "\nOnce upon a time" in reference_run["stdout"]


def test_load_checkpoint_returns_the_trained_model(reference_run):
    model = llama_mini.load_checkpoint(reference_run["out"])
    assert isinstance(model, llama_mini.Transformer)
    assert model.args.dim == 32 and model.args.norm == "rmsnorm" and model.args.vocab_size == 400
    weights = final_weights(reference_run["out"])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


@pytest.mark.slow  # each kill, resume and comparison is a train.py run in a subprocess
@pytest.mark.parametrize("attempt", range(3))  # three random kill times per run of the suite
def test_sigkill_at_a_random_moment_then_resume_gives_bitwise_identical_weights(reference_run, tmp_path, attempt):
    kill_at_random_and_resume(reference_run, tmp_path)


@pytest.mark.slow
def test_muon_and_wsd_resume_after_sigkill_with_bitwise_identical_weights_taking_the_recipe_from_the_run(muon_wsd_run, tmp_path):
    """--resume without --optimizer or --lr-schedule: the run's own recipe, Muon's momenta included."""
    kill_at_random_and_resume(muon_wsd_run, tmp_path, resume_flags=[a for a in muon_wsd_run["args"]
                                                                   if a not in ("--optimizer", "muon", "--lr-schedule", "wsd")])
    rc, _, stderr = Cli([*muon_wsd_run["args"], "--out", tmp_path / "run", "--resume", "--optimizer", "adamw"],
                        tmp_path / "refused").finish()
    assert rc == 2 and "it was trained with --optimizer muon (now adamw)" in stderr, stderr


@pytest.mark.usefixtures("kernel_library")
def test_flush_denormals_is_said_recorded_and_kept_by_resume_which_cannot_contradict_it(text_file, cache_dir, tmp_path):
    """--flush-denormals changes a run's arithmetic: the run says so, and it is the run's own."""
    base = dict(data=text_file, cache_dir=cache_dir, device="cpu", save_every=2, eval_every=2, **{**TINY, "sample_tokens": 0})
    run = tmp_path / "run"
    rc, stdout, stderr = Cli([*flags(**base, max_steps=2), "--flush-denormals", "--out", run], tmp_path / "first").finish()
    assert rc == 0 and "cpu float32, subnormals flushed;" in stdout, stderr
    rc, stdout, stderr = Cli([*flags(**base, max_steps=4), "--out", run, "--resume"], tmp_path / "resumed").finish()
    assert rc == 0 and "subnormals flushed" in stdout and "resuming at step 2" in stdout, stderr
    rc, _, stderr = Cli([*flags(**base, max_steps=6), "--out", run, "--resume", "--no-flush-denormals"], tmp_path / "no").finish()
    assert rc == 2 and "it was trained with --flush-denormals True (now False)" in stderr, stderr


# A run started in a fresh process whose torch threads already run, with the flag or without:
# whether every thread then flushes subnormals.
FLUSHED_RUN = """
import json, sys, torch
from llama_mini.kernels.subnormals import every_thread_flushes
from llama_mini.run.config import TrainConfig
from llama_mini.run.start import start_run
torch.set_num_threads(2)
assert not every_thread_flushes()
run = start_run(TrainConfig(**json.loads(sys.argv[1])))
print(every_thread_flushes())
run.close()
"""


@pytest.mark.usefixtures("kernel_library")
@pytest.mark.parametrize("flush", [True, False])
def test_a_run_with_flush_denormals_flushes_on_every_thread_and_one_without_on_none(text_file, cache_dir, tmp_path, flush):
    cfg = dict(data=str(text_file), cache_dir=str(cache_dir), device="cpu", out=str(tmp_path / "run"), flush_denormals=flush,
               **TINY)
    done = subprocess.run([sys.executable, "-c", FLUSHED_RUN, json.dumps(cfg)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(flush)], done.stdout


def test_muon_with_fsdp_is_refused_in_one_line():
    with pytest.raises(ValueError, match="--optimizer muon orthogonalises whole matrices, which --fsdp shards"):
        TrainConfig(optimizer="muon", fsdp=True)


def kill_at_random_and_resume(reference_run, tmp_path, resume_flags=None):
    """Kill a run like reference_run with SIGKILL at a random moment past its first checkpoint,
    resume it (with resume_flags, default its own), and compare its final weights bit for bit."""
    args = [*reference_run["args"], "--out", tmp_path / "run"]
    cli = Cli(args, tmp_path / "killed")
    cli.wait_for(tmp_path / "run" / "latest")  # the first checkpoint (step 8) is written; from here on anything
    target = random.randint(9, 75)  # goes: a training step, an evaluation, a checkpoint write
    while (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") <= target:  # a line per step, from 0
        assert cli.proc.poll() is None, cli.err.read_text()
        time.sleep(0.002)
    time.sleep(random.uniform(0, 0.02))
    assert cli.proc.poll() is None, "the run ended before the kill"
    cli.proc.send_signal(signal.SIGKILL)
    cli.proc.wait()
    killed_at = (tmp_path / "run" / "latest").read_text().strip()
    resume_args = [*(reference_run["args"] if resume_flags is None else resume_flags), "--out", tmp_path / "run", "--resume"]
    rc, _, stderr = Cli(resume_args, tmp_path / "resumed").finish()
    assert rc == 0, stderr
    ref, ours = final_weights(reference_run["out"]), final_weights(tmp_path / "run")
    assert all(torch.equal(ref[k], ours[k]) for k in ref), f"weights differ after a kill near step {target} ({killed_at})"
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(81))  # one history: records after the crash were dropped


@pytest.mark.slow
def test_ctrl_c_saves_exits_cleanly_and_resume_matches(reference_run, tmp_path):
    args = [*reference_run["args"], "--out", tmp_path / "run"]
    cli = Cli(args, tmp_path / "interrupted")
    cli.wait_for(tmp_path / "run" / "latest")
    cli.proc.send_signal(signal.SIGINT)
    rc, stdout, stderr = cli.finish()
    assert rc == 130 and "Traceback" not in stderr, stderr
    step = int((tmp_path / "run" / "latest").read_text().strip().split("-")[1])
    assert 8 <= step < 80
    assert f"interrupted at step {step}" in stdout
    rc, _, stderr = Cli([*args, "--resume"], tmp_path / "resumed").finish()
    assert rc == 0, stderr
    ref, ours = final_weights(reference_run["out"]), final_weights(tmp_path / "run")
    assert all(torch.equal(ref[k], ours[k]) for k in ref)


@pytest.mark.slow
def test_ctrl_c_twice_before_the_first_checkpoint_says_to_start_again_and_that_works(reference_run, tmp_path):
    """A second Ctrl-C stops at once: during the first evaluation there is no checkpoint yet,
    so --resume would find nothing to resume; the same command, run again, starts the run."""
    args = [*flags(**{**reference_run["base"], "max_steps": 2, "eval_iters": 3000}), "--out", tmp_path / "run"]
    cli = Cli(args, tmp_path / "interrupted")
    cli.wait_for(tmp_path / "run" / "run.json")  # the folder is taken; the first evaluation comes next
    time.sleep(1.0)
    for _ in range(2):
        cli.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
    rc, stdout, stderr = cli.finish()
    assert rc == 130 and "Traceback" not in stderr, stderr
    assert ("interrupted at step 0, before the first checkpoint; run the same command again to start over "
            "(there is no checkpoint to --resume)") in stdout
    rc, _, stderr = Cli(args, tmp_path / "again").finish()
    assert rc == 0, stderr
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-000002"
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2]


def test_non_finite_loss_exits_with_one_line_and_keeps_the_last_checkpoint(text_file, cache_dir, tmp_path):
    # No normalisation and a learning rate far too high: activations overflow after a few steps.
    args = flags(data=text_file, cache_dir=cache_dir, out=tmp_path / "run", device="cpu", norm="none", lr=0.3,
                 warmup_steps=10, max_steps=100, save_every=2, **TINY)
    rc, _, stderr = Cli(args, tmp_path / "logs").finish()
    assert rc == 2 and "Traceback" not in stderr
    line = stderr.strip().splitlines()[-1]
    found = re.match(r"error: (loss|gradient norm) is (nan|inf|-inf) at step (\d+); stopped before updating the weights, "
                     r"and the last good checkpoint is (\S+)\. Lower --lr", line)
    assert found, line
    step, checkpoint = int(found[3]), Path(found[4])
    assert checkpoint.name == f"step-{2 * ((step - 1) // 2):06d}"  # the last save before the bad step ...
    assert (tmp_path / "run" / "latest").read_text().strip() == checkpoint.name  # ... is still the latest
    assert llama_mini.load_checkpoint(tmp_path / "run") is not None


# --- Bad input: one line naming the fix, no traceback -------------------------------------------


def cli_error(capsys, *args) -> str:
    """Run train.py's main() in-process; its stderr must end in one error line, no traceback."""
    assert train_cli.main([*args]) == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # progress bars may come before it
    assert last.startswith("error: ") and err.count("error") == 1 and "Traceback" not in err, err
    return last


def test_missing_data_is_one_line_without_traceback_from_the_real_cli(tmp_path):
    rc, _, stderr = Cli(["--data", tmp_path / "missing.txt", "--out", tmp_path / "run"], tmp_path / "logs").finish()
    assert rc == 2
    assert stderr.startswith("error: data not found:") and stderr.count("\n") == 1


def test_empty_data_is_refused(capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    assert "holds no text" in cli_error(capsys, "--data", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "run"))


def test_non_utf8_data_is_refused(capsys, tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    assert "is not UTF-8 text" in cli_error(capsys, "--data", str(tmp_path / "bad.txt"), "--out", str(tmp_path / "run"))


def test_seq_len_longer_than_the_data_is_refused(capsys, tmp_path, cache_dir):
    (tmp_path / "short.txt").write_text("\n".join(corpus.stories(30_000)))
    args = flags(data=tmp_path / "short.txt", cache_dir=cache_dir, out=tmp_path / "run", vocab_size=400, seq_len=4000)
    err = cli_error(capsys, *args)
    assert "--seq-len 4000 is longer than the data" in err and "lower --seq-len" in err


def test_prompt_longer_than_the_context_is_refused_before_training(capsys, tmp_path, text_file, cache_dir):
    args = flags(data=text_file, cache_dir=cache_dir, out=tmp_path / "run", **{**TINY, "seq_len": 8})
    err = cli_error(capsys, *args, "--prompt", "Once upon a time, there was a girl named Lily.")
    assert re.search(r"--prompt is \d+ tokens but the context \(--seq-len\) is 8; shorten it", err)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("flag, value", [("--max-steps", "0"), ("--batch-size", "-2"), ("--seq-len", "0")])
def test_non_positive_sizes_are_refused(capsys, tmp_path, flag, value):
    assert f"{flag} must be " in cli_error(capsys, flag, value, "--out", str(tmp_path / "run"))


def test_resume_with_a_different_model_names_the_flag(capsys, reference_run):
    args = flags(**{**reference_run["base"], "dim": 48})
    err = cli_error(capsys, *args, "--out", str(reference_run["out"]), "--resume")
    assert "cannot --resume" in err and "--dim 32 (now 48)" in err and "pass the flags it was trained with" in err


def test_resume_on_other_data_is_refused(capsys, reference_run, tmp_path):
    (tmp_path / "other.txt").write_text("\n\n".join(corpus.stories(60_000, seed=8)))
    args = flags(**{**reference_run["base"], "data": tmp_path / "other.txt"})
    err = cli_error(capsys, *args, "--out", str(reference_run["out"]), "--resume")
    assert "it was trained on other data than" in err and "pass the --data it was trained on" in err


def test_resume_from_a_torn_training_state_names_the_file(capsys, reference_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference_run["out"], run)
    state = run / "step-000080" / "train_state.pt"
    state.write_bytes(state.read_bytes()[:1000])
    err = cli_error(capsys, *reference_run["args"], "--out", str(run), "--resume")
    assert f"cannot --resume: {state} is corrupt" in err


def test_resume_without_a_checkpoint_says_how_to_start(capsys, tmp_path):
    assert "nothing to resume" in cli_error(capsys, "--out", str(tmp_path / "run"), "--resume")


def test_starting_over_an_existing_run_is_refused(capsys, reference_run):
    err = cli_error(capsys, *reference_run["args"], "--out", str(reference_run["out"]))
    assert "already holds a training run; pass --resume" in err
