"""Writing every format, and converting between them with python -m llama_mini.formats.convert."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import tiny_model
from llama2c_files import export  # llama2.c's export.py layout
from llama_mini import ModelArgs, load_checkpoint, save_checkpoint
from llama_mini.formats.checkpoint import detect_format
from llama_mini.formats.meta import meta_params
from llama_mini.tokenizers.spm import train_sentencepiece

ROOT = Path(__file__).resolve().parents[2]

def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_native_to_meta_to_hf_to_native_is_exact(tmp_path):
    model = tiny_model(rope_theta=5e5, norm_eps=1e-6)
    save_checkpoint(model, tmp_path / "native")
    save_checkpoint(load_checkpoint(tmp_path / "native"), tmp_path / "meta", format="meta", shards=2)
    save_checkpoint(load_checkpoint(tmp_path / "meta"), tmp_path / "hf", format="hf")
    save_checkpoint(load_checkpoint(tmp_path / "hf"), tmp_path / "back")
    assert [detect_format(tmp_path / f) for f in ("native", "meta", "hf", "back")] == ["native", "meta", "hf", "native"]
    back = load_checkpoint(tmp_path / "back")
    assert_same_weights(back, model)
    assert (back.args.rope_theta, back.args.norm_eps, back.args.ffn_dim) == (5e5, 1e-6, model.args.ffn_dim)


def test_meta_shards_split_on_meta_dims(tmp_path):
    save_checkpoint(tiny_model(), tmp_path, format="meta", shards=2)
    shard = torch.load(tmp_path / "consolidated.01.pth", weights_only=True)
    # hidden 192 = 32 * ceil(170 / 32); wk holds 2 kv heads of 16 rows.
    expected = {
        "tok_embeddings.weight": (96, 32), "output.weight": (48, 64), "norm.weight": (64,),
        "layers.0.attention.wq.weight": (32, 64), "layers.0.attention.wk.weight": (16, 64),
        "layers.0.attention.wv.weight": (16, 64), "layers.0.attention.wo.weight": (64, 32),
        "layers.0.feed_forward.w1.weight": (96, 64), "layers.0.feed_forward.w3.weight": (96, 64),
        "layers.0.feed_forward.w2.weight": (64, 96), "layers.0.attention_norm.weight": (64,),
    }
    assert {k: tuple(shard[k].shape) for k in expected} == expected


def test_meta_params_json_has_meta_fields_only(tmp_path):
    save_checkpoint(tiny_model(), tmp_path, format="meta")
    params = json.loads((tmp_path / "params.json").read_text())
    assert params == {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 96, "multiple_of": 32, "norm_eps": 1e-5}


@pytest.mark.parametrize("hidden_dim", [96, 100, 192, 300, 11008])
def test_meta_params_reproduce_a_stated_swiglu_size(hidden_dim):
    # HF configs state intermediate_size outright; params.json must give it through Meta's rule.
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=96, hidden_dim=hidden_dim)
    assert ModelArgs(**meta_params(args)).ffn_dim == hidden_dim


def test_hf_output_opens_in_transformers_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny_model(tie_embeddings=True)
    save_checkpoint(model, tmp_path, format="hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - model(tokens)).abs().max().item() <= 1e-4


def test_tied_embeddings_survive_meta_format(tmp_path):
    model = tiny_model(tie_embeddings=True)
    save_checkpoint(model, tmp_path, format="meta")  # Meta's format stores the head twice
    back = load_checkpoint(tmp_path)
    assert torch.equal(back.output.weight, model.output.weight)


def test_shards_that_do_not_divide_the_heads_are_refused(tmp_path):
    with pytest.raises(ValueError, match="n_kv_heads 2 is not divisible by 4"):
        save_checkpoint(tiny_model(), tmp_path, format="meta", shards=4)


def test_unknown_output_format_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown checkpoint format 'gguf'"):
        save_checkpoint(tiny_model(), tmp_path, format="gguf")


def convert_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "llama_mini.formats.convert", *map(str, args)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_convert_cli_writes_hf_with_the_tokenizer(tmp_path):
    text = "Tom had a red ball. He gave it to Sue, and she was glad. " * 40
    tokenizer = train_sentencepiece(text.split(". "), vocab_size=300, model_path=tmp_path / "tok.model")
    save_checkpoint(tiny_model(vocab_size=tokenizer.n_words), tmp_path / "run", tokenizer_path=tokenizer.model_path)
    result = convert_cli(tmp_path / "run", tmp_path / "hf", "--to", "hf")
    assert result.returncode == 0, result.stderr
    assert detect_format(tmp_path / "hf") == "hf"
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == (tmp_path / "tok.model").read_bytes()
    assert_same_weights(load_checkpoint(tmp_path / "hf"), load_checkpoint(tmp_path / "run"))


def test_convert_refuses_a_tokenizer_it_cannot_read_before_writing(tmp_path):
    """convert copies the tokenizer found with the checkpoint; one generate.py would refuse is refused now."""
    save_checkpoint(tiny_model(), tmp_path / "run", tokenizer_path=Path(__file__))  # not a tokenizer
    result = convert_cli(tmp_path / "run", tmp_path / "hf", "--to", "hf")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {tmp_path / 'run' / 'tokenizer.model'} is not a tokenizer llama_mini reads")
    assert not (tmp_path / "hf").exists()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One model (GQA, tied head, non-default theta) as a checkpoint of every format convert reads."""
    root = tmp_path_factory.mktemp("sources")
    model = tiny_model(tie_embeddings=True, rope_theta=5e5)
    for fmt in ("native", "meta", "hf"):
        save_checkpoint(model, root / fmt, format=fmt)
    export(model, root / "stories.bin", 0)
    return model, root


@pytest.mark.parametrize("src", ["native", *(pytest.param(s, marks=pytest.mark.slow) for s in ("meta", "hf", "stories.bin"))])
def test_convert_cli_from_each_format_to_each_other_keeps_the_model(sources, tmp_path, src):
    model, root = sources
    targets = ["hf"] if src == "stories.bin" else [to for to in ("native", "meta", "hf") if to != src]
    for to in targets:
        result = convert_cli(root / src, tmp_path / to, "--to", to)
        assert result.returncode == 0 and result.stderr.strip() == f"wrote {to} checkpoint to {tmp_path / to}", result.stderr
        assert detect_format(tmp_path / to) == to
        converted = load_checkpoint(tmp_path / to)
        assert_same_weights(converted, model)
        assert converted.output.weight is converted.tok_embeddings.weight
        assert converted.args.rope_theta == 5e5 or src == "stories.bin"  # llama2.c's files have theta 10000 built in
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(targets)  # no temporary folder left


@pytest.mark.slow
@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["umask 022", "umask 027"])
def test_every_file_of_a_checkpoint_gets_the_mode_new_files_get(sources, tmp_path, umask):
    """safetensors writes its files 0600; on a shared machine the weights alone would be private."""
    _, root = sources
    for to in ("native", "hf"):
        result = subprocess.run([sys.executable, "-m", "llama_mini.formats.convert", root / "meta", tmp_path / to, "--to", to],
                                capture_output=True, text=True, timeout=120, cwd=ROOT, preexec_fn=lambda: os.umask(umask))
        assert result.returncode == 0, result.stderr
        modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / to).iterdir()}
        assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_convert_cli_into_a_users_folder_is_refused_and_touches_nothing(sources, tmp_path):
    _, root = sources
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("my own file")
    result = convert_cli(root / "native", tmp_path / "mine", "--to", "meta")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: {tmp_path / 'mine'} is not empty (config.json); only a new or empty folder is written to: choose a new destination"
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["config.json"]
    assert (tmp_path / "mine" / "config.json").read_text() == "my own file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_convert_cli_fills_an_empty_folder(sources, tmp_path):
    _, root = sources
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty", target_is_directory=True)  # the user's link to it
    assert convert_cli(root / "meta", tmp_path / "link", "--to", "hf").returncode == 0
    assert (tmp_path / "link").is_symlink() and detect_format(tmp_path / "empty") == "hf"


def test_convert_cli_refuses_to_overwrite_without_traceback(tmp_path):
    save_checkpoint(tiny_model(), tmp_path / "a")
    save_checkpoint(tiny_model(), tmp_path / "b")
    result = convert_cli(tmp_path / "a", tmp_path / "b", "--to", "meta")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "error:" in result.stderr and "is not empty" in result.stderr and "only a new or empty folder is written to" in result.stderr


def test_hf_output_is_sharded_by_size_as_save_pretrained_does(tmp_path):
    """Files of at most max_shard_bytes, an index naming each tensor's file, and a folder that
    transformers and load_checkpoint both open with the same logits."""
    transformers = pytest.importorskip("transformers")
    model = tiny_model()
    limit = 60_000  # bytes; the largest tensor, a 192 x 64 fp32 FFN matrix, is 49,152
    save_checkpoint(model, tmp_path, format="hf", max_shard_bytes=limit)
    files = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(files) > 2 and not (tmp_path / "model.safetensors").exists()
    assert files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert index["metadata"]["total_size"] == sum(p.numel() * 4 for p in hf.parameters())
    from safetensors import safe_open

    for f in files:  # each file within the limit, in tensor bytes
        with safe_open(f, "pt") as shard:
            assert sum(shard.get_tensor(k).numel() * 4 for k in shard.keys()) <= limit
    tokens = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - model(tokens)).abs().max().item() <= 1e-4
    assert_same_weights(load_checkpoint(tmp_path), model)

    save_checkpoint(model, tmp_path, format="hf")  # rewritten as one file: index and shards go
    assert sorted(f.name for f in tmp_path.glob("model*")) == ["model.safetensors"]
    assert_same_weights(load_checkpoint(tmp_path), model)


@pytest.mark.slow
def test_convert_cli_max_shard_size(tmp_path):
    save_checkpoint(tiny_model(), tmp_path / "run")
    result = convert_cli(tmp_path / "run", tmp_path / "hf", "--to", "hf", "--max-shard-gb", "0.00006")
    assert result.returncode == 0, result.stderr
    assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 2
    assert_same_weights(load_checkpoint(tmp_path / "hf"), load_checkpoint(tmp_path / "run"))
    bad = convert_cli(tmp_path / "run", tmp_path / "hf2", "--to", "hf", "--max-shard-gb", "0")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--max-shard-gb must be in (0, 1000000]" in bad.stderr
