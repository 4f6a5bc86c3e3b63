"""Hostile input: each bad file or value the README promises to refuse, as a table.

Every row runs the real CLI in a subprocess and checks three things: a non-zero exit code,
no Traceback on stderr, and a message that names the problem. Crash safety (kill -9 and
resume), Ctrl-C and non-finite losses are proven in test_training.py.
"""

import os
import pickle
import resource
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llama2c_files import export  # llama2.c's export.py layout
import llama_mini
from llama_mini import ModelArgs, Transformer
from llama_mini.formats.checkpoint import save_checkpoint
from llama_mini.run.lock import RunLock
from llama_mini.tokenizers.spm import train_sentencepiece

ROOT = Path(__file__).resolve().parents[1]
TEXT = "Tom had a red ball. He gave it to Sue, and she was glad. 'Thank you,' said Sue. " * 40


def run(script, *args, timeout=120, **kw) -> subprocess.CompletedProcess:
    """Run a top-level script (generate.py) or a module (llama_mini.convert) of the repository."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    target = [str(ROOT / script)] if script.endswith(".py") else ["-m", script]
    cmd = [sys.executable, *target, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)


def assert_refused(result, fragment):
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    assert fragment in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr  # a loading line at most, then the error


# --- Checkpoints and generate.py ---------------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny model in all three formats with its tokenizer, and a second, different tokenizer."""
    root = tmp_path_factory.mktemp("ckpts")
    tok = train_sentencepiece(TEXT.split(". "), vocab_size=300, model_path=root / "tok.model")
    train_sentencepiece(TEXT.split(". "), vocab_size=350, model_path=root / "other.model")
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=tok.n_words, max_seq_len=64))
    for fmt in ("native", "meta", "hf"):
        save_checkpoint(model, root / fmt, format=fmt, tokenizer_path=tok.model_path)
    return root


def broken_copy(files, tmp_path, fmt, damage):
    """A copy of the checkpoint in format fmt, with damage(folder) applied."""
    folder = tmp_path / fmt
    shutil.copytree(files / fmt, folder)
    damage(folder)
    return folder


def truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def garbage_header(file):
    file.write_bytes((1000).to_bytes(8, "little") + b"{not json at all" + bytes(2000))


def edit_json(file, **changes):
    import json

    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def nan_weights(folder):
    state = load_file(folder / "model.safetensors")
    state["norm.weight"] = torch.full_like(state["norm.weight"], float("nan"))
    from safetensors.torch import save_file

    save_file(state, folder / "model.safetensors")


def write_json(file, value):
    import json

    file.write_text(json.dumps(value))


def point_latest_at(folder, name_of):
    """folder becomes a run whose `latest` names name_of(copy), a complete checkpoint outside it:
    were the name followed, the checkpoint would load and the run would exit 0."""
    outside = folder.parent / "elsewhere"
    shutil.copytree(folder, outside)
    (folder / "latest").write_text(name_of(outside) + "\n")


def index_naming(folder, name_of):
    """An HF folder whose index names name_of(copy) for every tensor, a valid weights file outside it."""
    outside = folder.parent / "x.safetensors"
    shutil.copy(folder / "model.safetensors", outside)
    names = load_file(folder / "model.safetensors").keys()
    (folder / "model.safetensors").unlink()
    write_json(folder / "model.safetensors.index.json", {"weight_map": {k: name_of(outside) for k in names}})


def retype_weights(folder, dtype):
    state = load_file(folder / "model.safetensors")
    state["norm.weight"] = state["norm.weight"].to(dtype)
    from safetensors.torch import save_file

    save_file(state, folder / "model.safetensors")


class Payload:
    """Unpickling this would run code: it creates the file named in marker."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


BAD_CHECKPOINTS = {
    # name: (format, damage, expected fragment of the error)
    "truncated safetensors": ("native", lambda d: truncate(d / "model.safetensors"), "is truncated or corrupt"),
    "garbage safetensors header": ("native", lambda d: garbage_header(d / "model.safetensors"), "is truncated or corrupt"),
    "truncated pth": ("meta", lambda d: truncate(d / "consolidated.00.pth"), "consolidated.00.pth is truncated or corrupt"),
    "params.json disagrees": ("meta", lambda d: edit_json(d / "params.json", n_kv_heads=1), "has shape (32, 32) but the config implies (16, 32)"),
    "config.json disagrees": ("hf", lambda d: edit_json(d / "config.json", intermediate_size=64), "tensor model.layers.0.mlp.down_proj.weight has shape (32, 256) but the config implies (32, 64)"),
    "missing tokenizer": ("native", lambda d: (d / "tokenizer.model").unlink(), "neither it nor its parent holds tokenizer.model"),
    "unknown format": ("native", lambda d: (d / "config.json").unlink(), "not a checkpoint folder of a known format"),
    "nan weights": ("native", nan_weights, "NaN"),
    # Our own files' layout is their format record's to say (llama_mini/formats/record.py).
    "native of a newer format": ("native", lambda d: edit_json(d / "config.json", format_version=99, llama_mini_version="5.0.0"),
                                 "was written by llama_mini 5.0.0 in format 99; this is llama_mini"),
    "native naming norm_impl, no record": ("native", lambda d: write_json(d / "config.json", {"llama_mini": {"dim": 32, "norm_impl": "fused"}}),
                                           "older than 0.1.0 (it has no format record) and names norm_impl"),
    # Reads stay inside the folder the user named.
    "latest climbs out": ("native", lambda d: point_latest_at(d, lambda x: "../elsewhere"), "latest names '../elsewhere', not a step-N checkpoint of this run"),
    "latest is absolute": ("native", lambda d: point_latest_at(d, str), "elsewhere', not a step-N checkpoint of this run"),
    "latest names a missing step": ("native", lambda d: (d / "latest").write_text("step-000009\n"), "latest names step-000009, which is missing from"),
    "index climbs out": ("hf", lambda d: index_naming(d, lambda x: "../x.safetensors"), "names '../x.safetensors', which is outside"),
    "index is absolute": ("hf", lambda d: index_naming(d, str), "x.safetensors', which is outside"),
    "index weight_map is a list": ("hf", lambda d: write_json(d / "model.safetensors.index.json", {"weight_map": ["model.safetensors"]}), "has no weight_map naming the weight files"),
    "index weight_map is empty": ("hf", lambda d: write_json(d / "model.safetensors.index.json", {"weight_map": {}}), "has no weight_map naming the weight files"),
    # One config field must not cost memory or time before it is checked.
    "params.json claims 10M layers": ("meta", lambda d: edit_json(d / "params.json", n_layers=10_000_000), "the config says 10000000 layers; the weights hold 1"),
    "config.json claims 10M layers": ("hf", lambda d: edit_json(d / "config.json", num_hidden_layers=10_000_000), "the config says 10000000 layers; the weights hold 1"),
    # Values of the wrong type or range: one line, not a traceback.
    "I32 tensor": ("native", lambda d: retype_weights(d, torch.int32), "stores tensor norm.weight as I32"),
    "params.json dim -32": ("meta", lambda d: edit_json(d / "params.json", dim=-32), "params.json: field 'dim' is -32; it must be a whole number"),
    "params.json dim string": ("meta", lambda d: edit_json(d / "params.json", dim="32"), "params.json: field 'dim' is '32'; it must be a whole number"),
    "config.json is a list": ("hf", lambda d: write_json(d / "config.json", [1, 2]), "config.json holds a JSON list, not an object"),
    "native n_heads 0": ("native", lambda d: write_json(d / "config.json", {"llama_mini": {"dim": 32, "n_heads": 0}}), "field 'n_heads' is 0"),
    "HF n_heads 0": ("hf", lambda d: edit_json(d / "config.json", num_attention_heads=0), "config.json: field 'num_attention_heads' is 0"),
    "HF field null": ("hf", lambda d: edit_json(d / "config.json", hidden_size=None), "config.json: field 'hidden_size' is null"),
    "HF field string": ("hf", lambda d: edit_json(d / "config.json", rms_norm_eps="1e-5"), "field 'rms_norm_eps' is '1e-5'; it must be a finite number"),
    "pth holds lists": ("meta", lambda d: torch.save([[1.0, 2.0]], d / "consolidated.00.pth"), "consolidated.00.pth holds a list, not a state dict"),
    "pth holds int tensors": ("meta", lambda d: torch.save({"norm.weight": torch.ones(32, dtype=torch.int64)}, d / "consolidated.00.pth"), "stores tensor norm.weight as torch.int64"),
}


# A command line each (about 1.5 s): the quick suite refuses every third damage, CI every one.
@pytest.mark.parametrize("case", [case if i % 3 == 0 else pytest.param(case, marks=pytest.mark.slow)
                                  for i, case in enumerate(BAD_CHECKPOINTS)])
def test_bad_checkpoint_is_refused_in_one_line(files, tmp_path, case):
    fmt, damage, fragment = BAD_CHECKPOINTS[case]
    folder = broken_copy(files, tmp_path, fmt, damage)
    assert_refused(run("generate.py", "--ckpt", folder, "--prompt", "Tom", "--max-new-tokens", 4), fragment)


BAD_LLAMA2C_FILES = {
    # name: (damage to a llama2.c v0 export of the tiny model, expected fragment of the error)
    "truncated bin": (truncate, "but its llama2.c v0 header implies"),
    "bin claiming 10M layers": (lambda f: f.write_bytes(f.read_bytes()[:8] + (10_000_000).to_bytes(4, "little") + f.read_bytes()[12:]),
                                "but its llama2.c v0 header implies"),
    "state dict saved as .pt": (lambda f: torch.save({"norm.weight": torch.ones(32)}, f), "is a PyTorch file but not llama2.c's training checkpoint"),
    "text file": (lambda f: f.write_text("hello"), "is a file in no format llama_mini reads"),
}


@pytest.mark.parametrize("case", BAD_LLAMA2C_FILES)
def test_bad_llama2c_file_is_refused_in_one_line(files, tmp_path, case):
    damage, fragment = BAD_LLAMA2C_FILES[case]
    export(llama_mini.load_checkpoint(files / "native"), tmp_path / "model.bin", 0)
    shutil.copy(files / "native" / "tokenizer.model", tmp_path)
    damage(tmp_path / "model.bin")
    assert_refused(run("generate.py", "--ckpt", tmp_path / "model.bin", "--prompt", "Tom", "--max-new-tokens", 4), fragment)


def replace_once(file, old: bytes, new: bytes):
    """file with the bytes old (found once, by what they are) replaced by new, of the same length."""
    data = file.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    file.write_bytes(data.replace(old, new))


def gguf_string(text: str) -> bytes:
    return len(text).to_bytes(8, "little") + text.encode()


BAD_GGUF_FILES = {
    # name: (damage to a GGUF export of the tiny model, expected fragment of the error)
    "truncated gguf": (truncate, "is truncated or corrupt"),
    "gguf of another architecture": (lambda f: replace_once(f, gguf_string("general.architecture") + bytes([8, 0, 0, 0]) + gguf_string("llama"),
                                                            gguf_string("general.architecture") + bytes([8, 0, 0, 0]) + gguf_string("qwen2")),
                                     "holds a model of architecture 'qwen2'; llama_mini reads GGUF files of llama.cpp's llama architecture"),
    "gguf without a vocabulary": (lambda f: replace_once(f, gguf_string("tokenizer.ggml.model"), gguf_string("tokenizer.ggml.mod_l")),
                                  "holds no vocabulary; llama_mini reads GGUF vocabularies of type 'llama'"),
    "gguf claiming 10M layers": (lambda f: replace_once(f, gguf_string("llama.block_count") + bytes([4, 0, 0, 0]) + (1).to_bytes(4, "little"),
                                                        gguf_string("llama.block_count") + bytes([4, 0, 0, 0]) + (10_000_000).to_bytes(4, "little")),
                                 "the config says 10000000 layers; the weights hold 1"),
}


@pytest.mark.parametrize("case", BAD_GGUF_FILES)
def test_bad_gguf_file_is_refused_in_one_line(files, tmp_path, case):
    from llama_mini.formats.gguf import export_gguf

    damage, fragment = BAD_GGUF_FILES[case]
    path = export_gguf(llama_mini.load_checkpoint(files / "native"), tmp_path / "model.gguf", files / "tok.model", "f32")
    damage(path)
    assert_refused(run("generate.py", "--ckpt", path, "--prompt", "Tom", "--max-new-tokens", 4), fragment)


def test_missing_checkpoint_is_refused(tmp_path):
    assert_refused(run("generate.py", "--ckpt", tmp_path / "nope", "--prompt", "Tom"), f"checkpoint not found: {tmp_path / 'nope'}")


def test_tokenizer_with_another_vocabulary_is_refused(files):
    result = run("generate.py", "--ckpt", files / "native", "--tokenizer", files / "other.model", "--prompt", "Tom")
    assert_refused(result, "has 350 tokens but the model's vocabulary has 300")


def test_pickle_payload_is_refused_and_never_runs(files, tmp_path):
    marker = tmp_path / "payload-ran"
    folder = broken_copy(files, tmp_path, "meta", lambda d: torch.save({"x": Payload(marker)}, d / "consolidated.00.pth"))
    result = run("generate.py", "--ckpt", folder, "--prompt", "Tom")
    assert_refused(result, "holds pickled objects other than tensors (possibly code); refusing to load it")
    assert not marker.exists()
    pickle.loads(pickle.dumps(Payload(marker)))  # plain unpickling of the same object runs it
    assert marker.exists()


@pytest.mark.parametrize(
    "flag, value, fragment",
    [
        ("--temperature", "-0.5", "--temperature must be >= 0"),
        ("--top-p", "0", "--top-p must be in (0, 1]"),
        ("--top-p", "1.5", "--top-p must be in (0, 1]"),
        ("--top-k", "-1", "--top-k must be >= 0"),
        ("--max-new-tokens", "0", "--max-new-tokens must be >= 1"),
    ],
)
def test_bad_sampling_argument_is_refused_before_loading(tmp_path, flag, value, fragment):
    # The checkpoint does not even exist: the argument is checked before any heavy work.
    assert_refused(run("generate.py", "--ckpt", tmp_path / "nope", "--prompt", "Tom", flag, value), fragment)


def test_prompt_longer_than_the_context_is_refused(files):
    result = run("generate.py", "--ckpt", files / "native", "--prompt", "Tom had a red ball. " * 40)
    assert_refused(result, "+ 1 new token exceeds max_seq_len 64, the model's context; shorten the prompt")


def address_space(gib):
    """A cap on the child's memory: a read without bound fails within it, not on the machine."""
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))


def test_endless_prompt_file_is_refused_after_a_bounded_read(files):
    result = run("generate.py", "--ckpt", files / "native", "--prompt-file", "/dev/zero", preexec_fn=address_space(4))
    assert_refused(result, "--prompt-file /dev/zero is longer than 16 MiB, more text than any Llama context holds")


@pytest.mark.slow
def test_a_temperature_too_small_for_float32_decodes_greedily(files):
    """logits / 1e-40 overflow float32: the distribution such a temperature stands for is greedy's."""
    common = ["--ckpt", files / "native", "--prompt", "Tom", "--max-new-tokens", 12, "--seed", 3]
    tiny, greedy = run("generate.py", *common, "--temperature", "1e-40"), run("generate.py", *common, "--temperature", 0)
    assert tiny.returncode == 0 and "Traceback" not in tiny.stderr, tiny.stderr
    assert tiny.stdout == greedy.stdout and len(tiny.stdout) > len("Tom\n")


# --- python -m llama_mini.formats.convert ----------------------------------------------------------


def full_disk():  # files may not grow past 4 KiB: the first weights file cannot be written
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


BAD_CONVERSIONS = {
    # name: (extra arguments, preexec_fn, expected fragment of the error)
    "shards that do not divide the heads": (["--to", "meta", "--shards", 3], None, "n_kv_heads 2 is not divisible by 3"),
    "full disk during --to meta": (["--to", "meta"], full_disk, "cannot write {out}/consolidated.00.pth"),
    "full disk during --to hf": (["--to", "hf"], full_disk, "cannot write {out}/model.safetensors"),
    "full disk during --to gguf": (["--to", "gguf"], full_disk, "cannot write {out}: File too large"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_CONVERSIONS)
def test_refused_conversion_leaves_no_destination(files, tmp_path, case):
    """A refusal or a failed write leaves nothing behind that would block the next try."""
    extra, preexec, fragment = BAD_CONVERSIONS[case]
    result = run("llama_mini.formats.convert", files / "meta", tmp_path / "out", *extra, preexec_fn=preexec)
    assert_refused(result, fragment.format(out=tmp_path / "out"))
    assert ".tmp-" not in result.stderr  # the user's name for the destination, never the hidden one written first
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither out nor a hidden .out.tmp-PID
    retry = run("llama_mini.formats.convert", files / "meta", tmp_path / "out", "--to", "meta")
    assert retry.returncode == 0, retry.stderr


BAD_CONVERT_FLAGS = {
    # name: (arguments after SRC DST, expected fragment of the error)
    "max-shard-gb nan": (["--to", "hf", "--max-shard-gb", "nan"], "--max-shard-gb must be a finite number in (0, 1000000] (a million GB: one file), got nan"),
    "max-shard-gb inf": (["--to", "hf", "--max-shard-gb", "inf"], "--max-shard-gb must be a finite number in (0, 1000000] (a million GB: one file), got inf"),
    "max-shard-gb 1e308": (["--to", "hf", "--max-shard-gb", "1e308"], "--max-shard-gb must be in (0, 1000000] (a million GB: one file), got 1e+308"),
    "max-seq-len 0": (["--to", "native", "--max-seq-len", 0], "--max-seq-len must be in [1, 16777216] tokens, got 0"),
    "max-seq-len -5": (["--to", "hf", "--max-seq-len", -5], "--max-seq-len must be in [1, 16777216] tokens, got -5"),
    "gguf max-seq-len -1": (["--to", "gguf", "--max-seq-len", -1], "--max-seq-len must be in [1, 16777216] tokens, got -1"),
    "shards 0": (["--to", "meta", "--shards", 0], "--shards must be >= 1, got 0"),
    "missing tokenizer": (["--to", "native", "--tokenizer", "/nonexistent"], "tokenizer not found: /nonexistent"),
    "gguf missing tokenizer": (["--to", "gguf", "--tokenizer", "/nonexistent"], "tokenizer not found: /nonexistent"),
    "tokenizer of another vocabulary": (["--to", "hf", "--tokenizer", "OTHER"], "has 350 tokens but the model's vocabulary has 300"),
    "gguf tokenizer of another vocabulary": (["--to", "gguf", "--tokenizer", "OTHER"], "has 350 tokens but the model's vocabulary has 300"),
}


@pytest.mark.parametrize("case", BAD_CONVERT_FLAGS)
def test_bad_convert_flag_is_refused_and_writes_nothing(files, tmp_path, case):
    """Checked before anything is written: a checkpoint that no loader accepts is never made."""
    extra, fragment = BAD_CONVERT_FLAGS[case]
    extra = [files / "other.model" if a == "OTHER" else a for a in extra]
    dst = tmp_path / "new" / ("out.gguf" if "gguf" in extra else "out")
    assert_refused(run("llama_mini.formats.convert", files / "native", dst, *extra), fragment)
    assert list(tmp_path.iterdir()) == []


def test_gguf_export_creates_missing_folders_as_the_other_formats_do(files, tmp_path):
    result = run("llama_mini.formats.convert", files / "native", tmp_path / "new" / "deeper" / "m.gguf", "--to", "gguf")
    assert result.returncode == 0, result.stderr
    assert [p.name for p in (tmp_path / "new" / "deeper").iterdir()] == ["m.gguf"]


def test_conversion_into_a_users_folder_is_refused_and_touches_nothing(files, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    result = run("llama_mini.formats.convert", files / "native", tmp_path / "out", "--to", "hf")
    assert_refused(result, "is not empty (notes.txt); only a new or empty folder is written to")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"]
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --- python -m llama_mini.run.corpus ---------------------------------------------------


def symlink_to_a_file(path):
    path.with_name("target.txt").write_text("mine")
    path.symlink_to(path.with_name("target.txt"))


NOT_REGULAR_FILES = {
    # name: (make it at path, what the message calls it, whether it is still there as it was)
    "symlink": (symlink_to_a_file, "a symbolic link", lambda p: p.is_symlink() and p.read_text() == "mine"),
    "dangling symlink": (lambda p: p.symlink_to(p.with_name("nowhere")), "a symbolic link", lambda p: p.is_symlink()),
    "FIFO": (os.mkfifo, "a FIFO", lambda p: p.is_fifo()),
    "folder": (lambda p: (p / "notes").mkdir(parents=True), "a folder", lambda p: (p / "notes").is_dir()),
}


@pytest.mark.parametrize("case", NOT_REGULAR_FILES)
def test_corpus_replaces_nothing_but_a_regular_file(tmp_path, case):
    make, kind, unchanged = NOT_REGULAR_FILES[case]
    path = tmp_path / "out.txt"
    make(path)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run("llama_mini.run.corpus", path)
    assert_refused(result, f"{path} is {kind}; only a regular file is replaced")
    assert unchanged(path) and sorted(p.name for p in tmp_path.iterdir()) == before


def test_corpus_refuses_a_device_node(tmp_path):
    """A device of its own, never the machine's: /dev/full itself was replaced by a 2.2 MB file."""
    try:
        os.mknod(tmp_path / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node needs root")
    assert_refused(run("llama_mini.run.corpus", tmp_path / "null"), f"{tmp_path / 'null'} is a device")
    assert (tmp_path / "null").is_char_device()


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_corpus_help_prints_usage_and_writes_nothing(tmp_path, flag):
    result = run("llama_mini.run.corpus", flag, cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("usage: python -m llama_mini.run.corpus"), result.stderr
    assert list(tmp_path.iterdir()) == []


def test_corpus_into_folders_that_do_not_exist_creates_them(tmp_path):
    result = run("llama_mini.run.corpus", tmp_path / "new" / "deeper" / "stories.txt")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert (tmp_path / "new" / "deeper" / "stories.txt").stat().st_size > 2_000_000


# --- train.py ------------------------------------------------------------------------------

TINY_TRAIN = ["--dim", 32, "--n-layers", 1, "--n-heads", 2, "--seq-len", 16, "--batch-size", 4, "--vocab-size", 300,
              "--eval-iters", 1, "--eval-every", 2, "--sample-tokens", 0, "--device", "cpu"]


@pytest.fixture(scope="module")
def story_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "story.txt"
    path.write_text(TEXT * 5)
    return path


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--max-steps", 0], "--max-steps must be >= 1, got 0"),
        (["--batch-size", -1], "--batch-size must be >= 1, got -1"),
        (["--seq-len", 0], "--seq-len must be in [1, 16777216] tokens, got 0"),
        (["--data", "missing.txt"], "data not found: missing.txt"),
        (["--data", "empty.txt"], "holds no text"),
        (["--data", "latin1.txt"], "is not UTF-8 text"),
    ],
)
def test_bad_training_input_is_refused_before_any_work(tmp_path, args, fragment):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    result = run("train.py", *args, "--out", tmp_path / "run", "--cache-dir", tmp_path / "cache", cwd=tmp_path)
    assert_refused(result, fragment)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_vocab_size_below_the_texts_characters_names_the_smallest_that_trains(story_file, tmp_path):
    common = ["--data", story_file, "--cache-dir", tmp_path / "cache", "--max-steps", 1, *TINY_TRAIN]
    result = run("train.py", *common, "--vocab-size", 100, "--out", tmp_path / "run")
    assert_refused(result, "cannot train a tokenizer with --vocab-size 100 on story: a token for each of its characters")
    assert "character_coverage" not in result.stderr and not (tmp_path / "run").exists()
    smallest = int(result.stderr.split("pass --vocab-size ")[1].split()[0])
    retry = run("train.py", *common, "--vocab-size", smallest, "--out", tmp_path / "run")
    assert retry.returncode == 0, retry.stderr
    too_small = run("train.py", *common, "--vocab-size", smallest - 1, "--out", tmp_path / "run2")
    assert_refused(too_small, f"pass --vocab-size {smallest} or more")


@pytest.mark.slow
def test_full_disk_before_the_first_checkpoint_says_to_run_again_not_to_resume(story_file, tmp_path):
    """--resume would find nothing to resume: the same command, run again, starts the run."""
    common = ["--data", story_file, "--cache-dir", tmp_path / "cache", "--max-steps", 2, "--save-every", 2, *TINY_TRAIN]
    assert run("train.py", *common, "--out", tmp_path / "warm").returncode == 0  # the tokenizer and token caches

    def small_disk():  # the run's small files fit, its weights do not
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, 32 << 10))

    result = run("train.py", *common, "--out", tmp_path / "run", preexec_fn=small_disk)
    assert_refused(result, "no checkpoint was saved. Free some space and run the same command again")
    assert "--resume" not in result.stderr.replace("there is no checkpoint to --resume", "")
    again = run("train.py", *common, "--out", tmp_path / "run")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-000002"


def test_second_run_on_the_same_out_is_refused(story_file, tmp_path):
    with RunLock(tmp_path / "run"):  # a live run holds the folder
        result = run("train.py", "--data", story_file, "--out", tmp_path / "run", "--cache-dir", tmp_path / "cache",
                     "--max-steps", 2, *TINY_TRAIN)
    assert_refused(result, f"{tmp_path / 'run' / 'train.lock'} is held by another training run (pid {os.getpid()})")
    assert not (tmp_path / "run" / "latest").exists()


def test_stale_lock_of_a_dead_run_is_taken_over(story_file, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.lock").write_text(f"{dead.pid}\n")
    result = run("train.py", "--data", story_file, "--out", tmp_path / "run", "--cache-dir", tmp_path / "cache",
                 "--max-steps", 2, "--save-every", 2, *TINY_TRAIN)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-000002"


@pytest.mark.slow
def test_failed_checkpoint_write_keeps_the_previous_one_and_says_why(story_file, tmp_path):
    common = ["--data", story_file, "--out", tmp_path / "run", "--cache-dir", tmp_path / "cache", "--save-every", 2, *TINY_TRAIN]
    assert run("train.py", *common, "--max-steps", 2).returncode == 0
    before = load_file(tmp_path / "run" / "step-000002" / "model.safetensors")

    def full_disk():  # files may not grow past 4 KiB: the next weights file cannot be written
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    result = run("train.py", *common, "--max-steps", 4, "--resume", preexec_fn=full_disk)
    assert_refused(result, "File too large")
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-000002"
    model = llama_mini.load_checkpoint(tmp_path / "run")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert not list((tmp_path / "run").glob(".tmp*")) and not list((tmp_path / "run").glob("step-000002/.*tmp*"))


def test_generation_from_nan_logits_raises_a_clear_error():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=50, max_seq_len=32)).eval()
    with torch.no_grad():
        model.layers[0].feed_forward.w2.weight.fill_(float("nan"))
    for temperature in (0.0, 0.8):
        with pytest.raises(ValueError, match="NaN"):
            llama_mini.generate(model, [[1, 2, 3]], 5, temperature=temperature)


def test_a_destination_that_cannot_be_created_is_named_as_the_user_named_it(files, tmp_path, monkeypatch, capsys):
    """A read-only parent folder (simulated: root may write anywhere) fails the hidden folder's
    creation; the message names the destination."""
    from llama_mini.support.cli import run_main
    from llama_mini.formats import convert

    real_mkdir = Path.mkdir

    def read_only(path, *args, **kwargs):
        if ".tmp-" in path.name:
            raise PermissionError(13, "Permission denied", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert run_main(convert.main, [str(files / "native"), str(tmp_path / "out"), "--to", "hf"]) == 2
    assert capsys.readouterr().err == f"error: cannot write {tmp_path / 'out'}: Permission denied\n"


def test_the_corpus_writer_names_its_file_on_a_full_disk_and_refuses_a_folder(tmp_path):
    def full_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    result = run("llama_mini.run.corpus", tmp_path / "stories.txt", preexec_fn=full_disk)
    assert_refused(result, f"cannot write {tmp_path / 'stories.txt'}: File too large")
    folder = run("llama_mini.run.corpus", f"{tmp_path / 'out'}/")
    assert_refused(folder, f"{tmp_path / 'out'}/ is a folder; name the file to write, such as {tmp_path / 'out' / 'stories.txt'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
