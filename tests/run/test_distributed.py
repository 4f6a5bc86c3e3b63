"""torchrun: two CPU processes (gloo) train exactly what one process trains with the same global batch."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llama_mini.run import corpus
from llama_mini.run.folder import read_metrics

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in"),
              pytest.mark.slow]  # slow: each test starts processes that train together


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    (tmp / "tiny.txt").write_text("\n\n".join(corpus.stories(60_000, seed=11)), encoding="utf-8")
    common = ["--data", tmp / "tiny.txt", "--cache-dir", tmp / "cache", "--device", "cpu", "--vocab-size", "400",
              "--dim", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "32", "--max-steps", "8",
              "--save-every", "4", "--eval-every", "4", "--eval-iters", "2", "--sample-tokens", "0", "--lr", "3e-3",
              "--warmup-steps", "2"]
    single = launch([sys.executable, ROOT / "train.py"], [*common, "--batch-size", "4", "--out", tmp / "single"])
    return tmp, common, single


def launch(cmd, args) -> Path:
    # PYTHONFAULTHANDLER: a process that aborts in C++ prints where each of its threads was.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([*map(str, cmd), *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return Path(args[args.index("--out") + 1])


def torchrun(tmp, common, name, *extra) -> Path:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", ROOT / "train.py"]
    return launch(cmd, [*common, "--batch-size", "2", "--out", tmp / name, *extra])


def final_weights(run: Path) -> dict:
    return load_file(run / "step-000008" / "model.safetensors")


def assert_same_training(single: Path, multi: Path, weight_tolerance=dict(rtol=1e-4, atol=1e-5)):
    one, two = read_metrics(single / "metrics.jsonl"), read_metrics(multi / "metrics.jsonl")
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(9))
    for a, b in zip(one, two):
        for key in ("train_loss", "val_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
    w1, w2 = final_weights(single), final_weights(multi)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], **weight_tolerance)


def test_ddp_on_two_processes_follows_the_single_process_loss_trajectory(setup):
    tmp, common, single = setup
    assert_same_training(single, torchrun(tmp, common, "ddp"))


def test_muon_and_wsd_under_ddp_on_two_processes_follow_the_single_process_trajectory(setup):
    """Muon orthogonalises the averaged gradient of each whole matrix: every process the same
    update. Its Newton-Schulz iteration runs in bfloat16, where the last-bit differences of two
    processes' averaged gradients can round apart: the weights agree to that rounding (an update
    is 0.2 * lr * sqrt(rows) ~ 5e-3 here, a bfloat16 step of it 2e-5, over 8 steps), the losses to 1e-5."""
    tmp, common, _ = setup
    recipe = ["--optimizer", "muon", "--lr-schedule", "wsd"]
    single = launch([sys.executable, ROOT / "train.py"], [*common, *recipe, "--batch-size", "4", "--out", tmp / "muon-single"])
    assert_same_training(single, torchrun(tmp, common, "muon-ddp", *recipe), weight_tolerance=dict(rtol=0, atol=3e-4))


@pytest.fixture(scope="module")
def fsdp_run(setup):
    tmp, common, _ = setup
    return torchrun(tmp, common, "fsdp", "--fsdp")


def test_fsdp2_on_two_processes_follows_the_single_process_loss_trajectory(setup, fsdp_run):
    assert_same_training(setup[2], fsdp_run)


def test_fsdp2_resume_from_a_checkpoint_is_bitwise_exact(setup, fsdp_run):
    """Gathered full state out, sharded state back in: step 4 -> 8 again gives the same weights."""
    tmp, common, _ = setup
    resumed = tmp / "fsdp-resumed"
    shutil.copytree(fsdp_run, resumed)
    shutil.rmtree(resumed / "step-000008")
    (resumed / "latest").write_text("step-000004\n")
    torchrun(tmp, common, "fsdp-resumed", "--fsdp", "--resume")
    ref, ours = final_weights(fsdp_run), final_weights(resumed)
    assert all(torch.equal(ref[k], ours[k]) for k in ref)
