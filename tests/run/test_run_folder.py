"""The run folder is the run's own: train.py writes only into a folder it may call its own,
deletes only checkpoints it wrote (by step number), reads only checkpoints inside it, and a
refused run leaves nothing behind. Bad flags are refused in one line, as a table."""

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from safetensors.torch import load_file

import llama_mini
from llama_mini import ModelArgs, Transformer
from llama_mini.run import corpus
from llama_mini.run.folder import RunFolder, read_metrics
from llama_mini.trainer import NonFiniteLoss
from llama_mini.run.start import start_run
from llama_mini.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
import train as train_cli  # noqa: E402  (the top-level script, called in-process)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY = ["--dim", 32, "--n-layers", 1, "--n-heads", 2, "--seq-len", 32, "--batch-size", 4, "--vocab-size", 400,
        "--eval-iters", 1, "--eval-every", 10, "--sample-tokens", 0, "--device", "cpu"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small text and a token cache shared by every run here: --data and --cache-dir."""
    root = tmp_path_factory.mktemp("data")
    (root / "small.txt").write_text("\n\n".join(corpus.stories(60_000, seed=5)), encoding="utf-8")
    return ["--data", root / "small.txt", "--cache-dir", root / "cache"]


def train(*args) -> int:
    return train_cli.main([str(a) for a in args])


def refused(capsys, *args) -> str:
    """train.py's main() in-process: exit code 2 and one `error:` line, which is returned."""
    rc = train(*args)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and err.count("error: ") == 1, err
    return err.strip().splitlines()[-1]


def tree(path: Path) -> dict:
    """Every file under path with its bytes, and every folder: to show nothing changed."""
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


@pytest.fixture(scope="module")
def no_bos_tokenizer(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "no-bos.model"
    lines = "\n\n".join(corpus.stories(20_000, seed=1)).splitlines()
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=f, model_type="bpe", vocab_size=300,
                                       bos_id=-1, eos_id=-1, unk_id=0, minloglevel=2)
    return path


# --- Bad flags: one line, and no folder left behind --------------------------------------------


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--grad-clip", "nan"], "--grad-clip must be a finite number >= 0, got nan"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan"),
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--min-lr", "nan"], "--min-lr must be a finite number in [0, 0.004] (at most --lr), got nan"),
        (["--norm-p", "nan"], "--norm-p must be a finite number in (0, 1], got nan"),
        (["--seed", 2**63], f"--seed must be in [0, 2**63), got {2**63}"),
        (["--seed", -1], "--seed must be in [0, 2**63), got -1"),
        (["--device", "meta"], "unknown device 'meta'; use cpu, cuda, cuda:N or mps"),
        (["--device", "xla"], "unknown device 'xla'; use cpu, cuda, cuda:N or mps"),
        (["--tokenizer", "NO_BOS"], "without BOS/EOS tokens"),
        (["--prompt", "Once upon a time " * 20, "--sample-tokens", 5], "--prompt is"),  # found once the tokenizer is built
        (["--init-from", "MISSING"], "checkpoint not found"),
        # Sizes no machine holds: refused from the shape, before a tokenizer, a folder or an allocation.
        (["--dim", 2**31, "--n-heads", 8], "error: training 5.5e+19 parameters on batches of 4 x 32 tokens needs at least 2**69 bytes, and cpu has"),
        (["--dim", 2**63, "--n-heads", 8], "training 1.0e+39 parameters on batches of 4 x 32 tokens needs at least 2**133 bytes, and cpu has"),
        (["--n-layers", 2**31], "training 61,710,090.12M parameters on batches of 4 x 32 tokens needs at least 930.0 TiB, and cpu has"),
        (["--batch-size", 2**31], f"training 0.04M parameters on batches of {2**31} x 32 tokens needs at least 208.0 TiB, and cpu has"),
    ],
)
def test_bad_flag_is_refused_in_one_line_leaving_no_folder(capsys, tmp_path, data, no_bos_tokenizer, args, fragment):
    args = [{"NO_BOS": no_bos_tokenizer, "MISSING": tmp_path / "missing"}.get(a, a) for a in args]
    err = refused(capsys, *data, *TINY, "--max-steps", 2, "--out", tmp_path / "new" / "run", *args)
    assert fragment in err
    assert not (tmp_path / "new").exists()  # not the run folder, nor the folder above it, nor train.lock


def test_an_out_folder_whose_name_is_not_utf8_is_refused_before_any_work(tmp_path, data):
    """Python hands argv's non-UTF-8 bytes over as lone surrogates, which no printed line or plot holds."""
    out = os.fsencode(tmp_path) + b"/run\xff"
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *map(str, data), *map(str, TINY), "--max-steps", "2",
                             "--out", out], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: --out is not UTF-8 text (byte 0xff at offset {len(os.fsencode(tmp_path)) + 4}); pass UTF-8"]
    assert not os.path.exists(out)


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", "", "ABSOLUTE"])
def test_run_name_that_leaves_checkpoints_is_refused(capsys, tmp_path, monkeypatch, data, name):
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    name = str(tmp_path / "abs") if name == "ABSOLUTE" else name
    err = refused(capsys, *data, *TINY, "--run-name", name)
    assert f"--run-name {name!r} must be a plain folder name under checkpoints/" in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b"]


def test_run_name_names_a_folder_under_checkpoints():
    assert TrainConfig(run_name="tiny-1").run_dir() == Path("checkpoints/tiny-1")


def test_out_that_is_a_file_is_refused(capsys, tmp_path, data):
    (tmp_path / "notes.txt").write_text("mine")
    assert "is a file; pass --out a folder" in refused(capsys, *data, *TINY, "--out", tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine"


# --- A folder that is not ours --------------------------------------------------------------


def test_folder_that_is_not_a_run_is_refused_and_left_as_it_was(tmp_path, data):
    """The issue's repro: pruning used to delete these and overwrite tokenizer.model."""
    out = tmp_path / "m"
    for name in ("step-2023-photos", "step-by-step-guide", ".tmp-step-x"):
        (out / name).mkdir(parents=True)
        (out / name / "photo.jpg").write_bytes(b"\xff\xd8 mine")
    (out / "tokenizer.model").write_text("mine\n")
    before = tree(out)
    cmd = [sys.executable, ROOT / "train.py", *data, *TINY, "--out", out, "--max-steps", 4, "--save-every", 2,
           "--keep-checkpoints", 1]
    result = subprocess.run([str(a) for a in cmd], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {out} is not empty (.tmp-step-x, step-2023-photos, step-by-step-guide, ...)")
    assert "pass --out a new folder" in result.stderr and result.stderr.count("\n") == 1
    assert tree(out) == before


def test_resume_in_a_folder_that_is_not_a_run_says_there_is_nothing_to_resume(capsys, tmp_path, data):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tokenizer.model").write_text("mine\n")
    err = refused(capsys, *data, *TINY, "--out", tmp_path / "m", "--resume")
    assert "nothing to resume" in err and (tmp_path / "m" / "tokenizer.model").read_text() == "mine\n"


def test_a_run_of_ours_stopped_before_its_first_checkpoint_can_start_again(tmp_path, data):
    out = tmp_path / "run"
    folder = RunFolder(out, resume=False)
    folder.open(data[1])  # marks the folder as ours; no checkpoint yet
    folder.close()
    assert train(*data, *TINY, "--out", out, "--max-steps", 2, "--save-every", 2) == 0
    assert (out / "latest").read_text() == "step-000002\n"


# --- Pruning ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(data, tmp_path_factory) -> Path:
    """A 4-step run, checkpoints at steps 2 and 4 (both kept)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train(*data, *TINY, "--out", out, "--max-steps", 4, "--save-every", 2) == 0
    return out


def test_pruning_deletes_only_checkpoints_this_run_wrote(tmp_path, data, finished_run):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    theirs = ["step-2023-photos", "step-by-step-guide", ".tmp-step-x", "step-000001", "step-999"]
    for name in theirs:  # put there by a user while the run was stopped
        (out / name).mkdir()
        (out / name / "keep.txt").write_text("mine")
    before = {name: tree(out / name) for name in theirs}
    assert train(*data, *TINY, "--out", out, "--max-steps", 8, "--save-every", 2, "--keep-checkpoints", 1, "--resume") == 0
    assert {name: tree(out / name) for name in theirs} == before
    assert sorted(p.name for p in out.glob("step-0000*")) == ["step-000001", "step-000008"]
    assert (out / "latest").read_text() == "step-000008\n" and (out / "step-000008" / "train_state.pt").is_file()


def tiny_state(step: int) -> dict:
    torch.manual_seed(step)
    return {"model": Transformer(ModelArgs(dim=8, n_layers=1, n_heads=2, vocab_size=16)).state_dict(), "step": step}


def test_pruning_orders_checkpoints_by_step_number_past_a_million(tmp_path):
    """In string order step-1000000 sorts before step-999999 and was deleted as the oldest."""
    (tmp_path / "tokenizer.model").write_bytes(b"any")
    folder = RunFolder(tmp_path / "run", resume=False)
    folder.open(tmp_path / "tokenizer.model")
    args = ModelArgs(dim=8, n_layers=1, n_heads=2, vocab_size=16)
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        folder.save(step, args, tiny_state(step), {}, keep=2)
    folder.close()
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-1000000", "step-1000001"]
    assert (tmp_path / "run" / "latest").read_text() == "step-1000001\n"
    model = llama_mini.load_checkpoint(tmp_path / "run")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in tiny_state(1_000_001)["model"].items())


def test_a_checkpoint_name_this_run_did_not_write_is_never_overwritten(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"any")
    folder = RunFolder(tmp_path / "run", resume=False)
    folder.open(tmp_path / "tokenizer.model")
    (tmp_path / "run" / "step-000002").mkdir()
    (tmp_path / "run" / "step-000002" / "keep.txt").write_text("mine")
    with pytest.raises(OSError, match="step-000002: it exists and this run did not write it"):
        folder.save(2, ModelArgs(dim=8, n_layers=1, n_heads=2, vocab_size=16), tiny_state(2), {}, keep=2)
    assert (tmp_path / "run" / "step-000002" / "keep.txt").read_text() == "mine"


# --- Resuming reads only the run's own checkpoints --------------------------------------------


@pytest.mark.parametrize(
    "latest, fragment",
    [
        ("../../elsewhere", "names '../../elsewhere', not a step-N checkpoint of this run"),
        ("ABSOLUTE", "not a step-N checkpoint of this run"),
        ("step-000002/../../elsewhere", "not a step-N checkpoint of this run"),
        ("step-000099", "names step-000099, which is missing from"),
    ],
)
def test_latest_naming_anything_but_a_checkpoint_of_the_run_is_refused(capsys, tmp_path, data, finished_run, latest, fragment):
    out = tmp_path / "deep" / "er" / "run"
    shutil.copytree(finished_run, out)
    shutil.copytree(finished_run / "step-000004", tmp_path / "elsewhere")  # a complete checkpoint, outside
    latest = str(tmp_path / "elsewhere") if latest == "ABSOLUTE" else latest
    (out / "latest").write_text(latest + "\n")
    before = tree(out)
    err = refused(capsys, *data, *TINY, "--out", out, "--max-steps", 6, "--resume")
    assert err.startswith(f"error: cannot --resume: {out / 'latest'}") and fragment in err
    assert tree(out) == before


# --- Non-finite losses and full disks ---------------------------------------------------------


def test_the_checkpoint_called_last_good_holds_finite_weights(tmp_path, data):
    """No normalisation and a huge learning rate diverge within a few steps, saving every step."""
    out = tmp_path / "run"
    cmd = [sys.executable, ROOT / "train.py", *data, *TINY, "--out", out, "--n-layers", 2, "--norm", "none", "--lr", 0.3,
           "--warmup-steps", 10, "--max-steps", 100, "--save-every", 1]
    result = subprocess.run([str(a) for a in cmd], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert "stopped before updating the weights, and the last good checkpoint is " in line, line
    named = Path(line.split("the last good checkpoint is ")[1].split(". ")[0])
    weights = load_file(named / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert (out / "latest").read_text().strip() == named.name


def test_weights_that_are_not_finite_are_never_saved(tmp_path, data):
    cfg = TrainConfig(data=str(data[1]), cache_dir=str(data[3]), out=str(tmp_path / "run"), device="cpu",
                      dim=32, n_layers=1, n_heads=2, vocab_size=400, seq_len=32, batch_size=4, max_steps=4)
    run = start_run(cfg)
    run.trainer.train_step()
    with torch.no_grad():
        run.raw_model.layers[0].attention.wq.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteLoss, match=r"weights hold NaN or inf after step 1 \(layers.0.attention.wq.weight\); "
                                            "not saved, and no checkpoint was saved yet"):
        run.save()
    run.close()
    assert not list((tmp_path / "run").glob("*step-*")) and not (tmp_path / "run" / "latest").exists()


def test_full_disk_while_writing_the_training_state_is_one_line_and_keeps_the_last_checkpoint(tmp_path, data, finished_run):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    (out / "latest").write_text("step-000002\n")
    shutil.rmtree(out / "step-000004")
    weights, state = out / "step-000002" / "model.safetensors", out / "step-000002" / "train_state.pt"
    limit = (weights.stat().st_size + state.stat().st_size) // 2  # the weights fit, the optimizer's moments do not
    assert weights.stat().st_size < limit < state.stat().st_size

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    before = tree(out / "step-000002")
    cmd = [sys.executable, ROOT / "train.py", *data, *TINY, "--out", out, "--max-steps", 4, "--save-every", 2, "--resume"]
    result = subprocess.run([str(a) for a in cmd], capture_output=True, text=True, timeout=120, preexec_fn=small_disk,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = result.stderr.replace("\r", "\n").strip().splitlines()[-1]  # after the progress bar
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert line == f"error: cannot save {out / 'step-000004'}: File too large; latest still names step-000002. Free some space and --resume"
    assert (out / "latest").read_text() == "step-000002\n" and tree(out / "step-000002") == before
    assert not list(out.glob(".tmp*")) and not (out / "step-000004").exists()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(5))  # steps 3-4 ran, then the save failed


def test_a_run_records_its_format_and_a_run_json_without_one_resumes(tmp_path, data, finished_run):
    """run.json without a format record was written by a llama_mini older than 0.1.0 in today's layout."""
    from llama_mini.formats.record import FORMAT_VERSION

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    record = json.loads((out / "run.json").read_text())
    assert (record["format_version"], record["llama_mini_version"]) == (FORMAT_VERSION, llama_mini.__version__)
    (out / "run.json").write_text(json.dumps({"llama_mini_run": 1, "checkpoints": record["checkpoints"]}))
    assert train(*data, *TINY, "--out", out, "--max-steps", 6, "--save-every", 2, "--keep-checkpoints", 1, "--resume") == 0
    assert sorted(p.name for p in out.glob("step-*")) == ["step-000006"]


def test_a_run_folder_from_before_run_json_is_refused_naming_the_version_and_the_fix(capsys, tmp_path, data, finished_run):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    (out / "run.json").unlink()
    before = tree(out)
    err = refused(capsys, *data, *TINY, "--out", out, "--max-steps", 6, "--resume")
    assert err == (f"error: {out} was written by a llama_mini older than 0.1.0 (it has no format record) and has no run.json, "
                   "the list of the checkpoints a run may prune; go on from its newest checkpoint in a new run: "
                   f"--init-from {out / 'step-000004'} --out NEW_FOLDER")
    assert tree(out) == before


def test_a_run_folder_of_a_newer_format_is_refused_naming_the_version_that_wrote_it(capsys, tmp_path, data, finished_run):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    record = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**record, "format_version": 99, "llama_mini_version": "5.0.0"}))
    before = tree(out)
    err = refused(capsys, *data, *TINY, "--out", out, "--max-steps", 6, "--resume")
    assert err.startswith(f"error: {out / 'run.json'} was written by llama_mini 5.0.0 in format 99; this is llama_mini ")
    assert err.endswith("upgrade llama_mini") and tree(out) == before


@pytest.mark.parametrize("record", ['{"checkpoints": ["../../elsewhere"]}', '{"checkpoints": "step-000002"}', "[1, 2"])
def test_a_run_record_naming_anything_but_checkpoints_is_refused(capsys, tmp_path, data, finished_run, record):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    (out / "run.json").write_text(record)
    err = refused(capsys, *data, *TINY, "--out", out, "--max-steps", 6, "--resume")
    assert f"error: {out / 'run.json'}" in err and ("is corrupt" in err or "not step-N checkpoints of this run" in err)
    assert sorted(p.name for p in out.glob("step-*")) == ["step-000002", "step-000004"]


# --- A run's own files are checked like anyone else's ------------------------------------------


@pytest.mark.parametrize("state, problem", [
    ({}, "optimizer, step, elapsed, data_rng, torch_rng, cuda_rng, python_rng, config, data_digest missing"),
    ([1, 2], "a list, not a dict"),
    ("STEP_2", "it says step 2, in the folder of step 4"),
    ("STEP_FLOAT", "step of the wrong type"),
])
def test_a_training_state_that_is_not_whole_is_refused_and_no_checkpoint_is_lost(capsys, tmp_path, data, finished_run, state, problem):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    file = out / "step-000004" / "train_state.pt"
    if isinstance(state, str):  # the run's own state from step 2, or with its step a float
        real = torch.load(out / "step-000002" / "train_state.pt", weights_only=True)
        state = real if state == "STEP_2" else {**real, "step": 4.0}
    torch.save(state, file)
    before = tree(out)
    err = refused(capsys, *data, *TINY, "--out", out, "--max-steps", 6, "--save-every", 2, "--keep-checkpoints", 1, "--resume")
    assert err == (f"error: cannot --resume: {file} is not a training state of this run ({problem}); "
                   "point latest at an earlier checkpoint, or start a new --out")
    assert tree(out) == before  # both checkpoints kept, nothing written


@pytest.mark.parametrize("line", ["{}", "[1]", '{"step": "2"}', "not json"])
def test_a_metrics_line_that_is_not_a_record_is_refused_naming_the_file_and_line(capsys, tmp_path, data, finished_run, line):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([*lines[:2], line, *lines[2:]]) + "\n")
    before = tree(out)
    err = refused(capsys, *data, *TINY, "--out", out, "--max-steps", 6, "--resume")
    assert err == f"error: {metrics} line 3 is not a metrics record of this run (a JSON object with a step); remove that line to resume"
    assert tree(out) == before


def test_a_torn_last_metrics_line_is_dropped_with_a_notice_and_the_run_resumes(capsys, tmp_path, data, finished_run):
    """A crash mid-write leaves exactly this: a record cut off, with no newline after it."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    metrics = out / "metrics.jsonl"
    records = read_metrics(metrics)
    metrics.write_text(metrics.read_text() + '{"step": 5, "time": 1.2, "train_lo')
    assert train(*data, *TINY, "--out", out, "--max-steps", 6, "--resume") == 0
    assert f"{metrics}: dropped its last line, cut short by a crash" in capsys.readouterr().err
    resumed = read_metrics(metrics)
    assert resumed[: len(records)] == records and [r["step"] for r in resumed[len(records):]] == [5, 6]
