"""Loading checkpoints of every format, against transformers as the independent reference."""

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llama_mini import generate, load_checkpoint, save_checkpoint
from llama_mini.formats.checkpoint import detect_format
from fixtures import LLAMA2_TOKENIZER, TINY, require, tiny_model

transformers = pytest.importorskip("transformers")

# GQA, a SwiGLU size no Meta rule gives, a non-default rope_theta and eps: all read from config.json.
HF_CONFIG = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
    vocab_size=128, max_position_embeddings=256, rope_theta=5000.0, rms_norm_eps=1e-5,
)


def hf_model(seed=0, **overrides):
    """A tiny transformers LlamaForCausalLM from a config, with random norm weights too."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF_CONFIG, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model

@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """The tiny HF model saved with save_pretrained as several safetensors shards."""
    model = hf_model()
    folder = tmp_path_factory.mktemp("hf")
    model.save_pretrained(folder, max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").is_file()
    return model, folder


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def max_logit_diff(ours, theirs, tokens):
    with torch.no_grad():
        return (ours(tokens) - theirs(tokens).logits).abs().max().item()


TOKENS = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
PROMPT = [1, 17, 42, 99, 5]


# --- Hugging Face ------------------------------------------------------------------------------


def test_sharded_hf_safetensors_give_transformers_logits(hf_folder):
    hf, folder = hf_folder
    model = load_checkpoint(folder)
    assert detect_format(folder) == "hf"
    assert (model.args.n_kv_heads, model.args.ffn_dim, model.args.rope_theta, model.args.norm_eps) == (2, 96, 5000.0, 1e-5)
    assert max_logit_diff(model, hf, TOKENS) <= 1e-4


def test_greedy_generate_equals_transformers_for_50_tokens(hf_folder):
    hf, folder = hf_folder
    ours = generate(load_checkpoint(folder), [PROMPT], max_new_tokens=50, temperature=0)[0]
    theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=50, min_new_tokens=50, do_sample=False, pad_token_id=0)
    assert ours == theirs[0, len(PROMPT):].tolist()


def test_meta_round_trip_with_two_shards_keeps_logits_and_greedy_text(hf_folder, tmp_path):
    hf, folder = hf_folder
    save_checkpoint(load_checkpoint(folder), tmp_path / "meta", format="meta", shards=2)
    assert sorted(p.name for p in (tmp_path / "meta").glob("*.pth")) == ["consolidated.00.pth", "consolidated.01.pth"]
    save_checkpoint(load_checkpoint(tmp_path / "meta"), tmp_path / "hf", format="hf")
    back = load_checkpoint(tmp_path / "hf")
    assert max_logit_diff(back, hf, TOKENS) <= 1e-4
    theirs = hf.generate(torch.tensor([PROMPT]), max_new_tokens=50, min_new_tokens=50, do_sample=False, pad_token_id=0)
    assert generate(back, [PROMPT], 50, temperature=0)[0] == theirs[0, len(PROMPT):].tolist()


def test_pytorch_model_bin_loads(tmp_path):
    hf = hf_model(seed=1)
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    assert max_logit_diff(load_checkpoint(tmp_path), hf, TOKENS) <= 1e-4


def deflate(file):
    """Rewrite a torch.save zip with compressed entries, as any zip tool may: still a valid file."""
    data = file.read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as plain, zipfile.ZipFile(file, "w", zipfile.ZIP_DEFLATED) as packed:
        for entry in plain.infolist():
            packed.writestr(entry.filename, plain.read(entry.filename))


def test_compressed_pytorch_model_bin_loads_its_true_weights(tmp_path):
    # Memory-mapping a compressed entry reads the compressed bytes as weights (values ~1e20).
    hf = hf_model(seed=1)
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    deflate(tmp_path / "pytorch_model.bin")
    with zipfile.ZipFile(tmp_path / "pytorch_model.bin") as packed:
        assert any(entry.compress_type == zipfile.ZIP_DEFLATED for entry in packed.infolist())
    assert max_logit_diff(load_checkpoint(tmp_path), hf, TOKENS) <= 1e-4


def test_symlinks_the_user_made_are_followed(hf_folder, tmp_path):
    # The folder itself a link, and a shard linked into a folder: the user's own choices.
    hf, folder = hf_folder
    (tmp_path / "link").symlink_to(folder, target_is_directory=True)
    assert max_logit_diff(load_checkpoint(tmp_path / "link"), hf, TOKENS) <= 1e-4
    (tmp_path / "linked").mkdir()
    for file in folder.iterdir():
        (tmp_path / "linked" / file.name).symlink_to(file)
    assert max_logit_diff(load_checkpoint(tmp_path / "linked"), hf, TOKENS) <= 1e-4


def test_mixed_dtypes_load_in_the_embeddings_dtype(tmp_path):
    # A file with fp32 norms beside bf16 matrices: one dtype for the whole model, or the first
    # matmul after a norm would fail on mismatched dtypes.
    model = tiny_model()
    save_checkpoint(model, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    save_file({k: v if "norm" in k else v.to(torch.bfloat16) for k, v in state.items()}, tmp_path / "model.safetensors")
    loaded = load_checkpoint(tmp_path)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded(TOKENS[:, :8] % 96).isfinite().all()


# The cap is set once torch and the loaders are imported (import llama_mini imports neither; a
# CUDA build of torch maps 3 GiB of libraries), so it counts what they map and leaves 1 GiB for
# the load itself, against the 8 GB a table for the whole context would take.
LOAD_UNDER_MEMORY_CAP = """
import resource, sys
import torch
import llama_mini.formats
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + 2**30, hard))  # 1 GiB beyond what the imports mapped
model = llama_mini.formats.load_checkpoint(sys.argv[1])
print(model.args.max_seq_len)
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_a_huge_context_length_allocates_nothing_for_it(tmp_path):
    # max_position_embeddings 250M: 8 GB of cos/sin tables if built for the whole context.
    save_checkpoint(tiny_model(), tmp_path, format="hf")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 250_000_000}))
    result = subprocess.run([sys.executable, "-c", LOAD_UNDER_MEMORY_CAP, str(tmp_path)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert result.returncode == 0 and result.stdout.strip() == "250000000", result.stderr[-2000:]


def test_hf_tied_embeddings_load_as_one_tensor(tmp_path):
    hf = hf_model(seed=2, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)
    model = load_checkpoint(tmp_path)
    assert model.output.weight is model.tok_embeddings.weight
    assert max_logit_diff(model, hf, TOKENS) <= 1e-4


def test_rope_theta_is_read_from_transformers5_rope_parameters(hf_folder):
    _, folder = hf_folder
    config = json.loads((folder / "config.json").read_text())
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 5000.0
    assert load_checkpoint(folder).args.rope_theta == 5000.0


# --- Meta --------------------------------------------------------------------------------------


def write_meta(folder, params, shards):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.json").write_text(json.dumps(params))
    for i, shard in enumerate(shards):
        torch.save(shard, folder / f"consolidated.{i:02d}.pth")


def test_meta_shards_are_merged_on_meta_dims(tmp_path):
    # Two ranks written by hand as Meta's model-parallel layers lay them out.
    model = tiny_model(n_layers=1)
    sd = model.state_dict()
    dims = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1, "tok_embeddings": 1}
    shards = [{}, {}]
    for key, t in sd.items():
        name = key.split(".")[-2]
        for rank in range(2):
            shards[rank][key] = t.clone() if t.dim() == 1 else t.chunk(2, dim=dims[name])[rank].clone()
            shards[rank]["rope.freqs"] = torch.ones(8)  # in Meta's files; recomputed by us
    assert shards[0]["layers.0.attention.wo.weight"].shape == (64, 32)
    params = {"dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 96, "multiple_of": 32, "norm_eps": 1e-5}
    write_meta(tmp_path, params, shards)
    loaded = load_checkpoint(tmp_path).state_dict()
    assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], sd[k]) for k in sd)


def test_legacy_format_pth_loads(tmp_path):
    # torch.save(..., _use_new_zipfile_serialization=False): valid, but cannot be memory-mapped.
    model = tiny_model(n_layers=1)
    params = {"dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 96, "multiple_of": 32}
    write_meta(tmp_path, params, [])
    torch.save(model.state_dict(), tmp_path / "consolidated.00.pth", _use_new_zipfile_serialization=False)
    assert_same_state(load_checkpoint(tmp_path), model)


def test_shards_with_different_shapes_are_refused_in_one_line(tmp_path):
    save_checkpoint(tiny_model(), tmp_path, format="meta", shards=2)
    shard = torch.load(tmp_path / "consolidated.01.pth", weights_only=True)
    shard["layers.0.attention.wq.weight"] = shard["layers.0.attention.wq.weight"][:16].clone()
    torch.save(shard, tmp_path / "consolidated.01.pth")
    with pytest.raises(ValueError, match=r"tensor layers.0.attention.wq.weight has different shapes in the model-parallel shards \(\(32, 64\), \(16, 64\)\)") as excinfo:
        load_checkpoint(tmp_path)
    one_line_error(excinfo)


# Llama-3.2 1B's params.json at small scale: Meta's format has no tying flag.
LLAMA32_PARAMS = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 96, "multiple_of": 32,
                  "norm_eps": 1e-5, "rope_theta": 500000.0}


def test_meta_head_equal_to_the_embedding_loads_as_one_shared_tensor(tmp_path):
    # Meta's Llama-3.2 consolidated.00.pth stores output.weight as a copy of tok_embeddings.weight.
    model = tiny_model(tie_embeddings=True, rope_theta=500000.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}  # two storages, equal values
    write_meta(tmp_path / "meta", LLAMA32_PARAMS, [state])
    loaded = load_checkpoint(tmp_path / "meta")
    assert loaded.args.tie_embeddings and loaded.output.weight is loaded.tok_embeddings.weight
    assert len(list(loaded.parameters())) == len(state) - 1  # the head is not a parameter of its own
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS % 96), model(TOKENS % 96))
    save_checkpoint(loaded, tmp_path / "hf", format="hf")  # and it is written as tied where a format can say so
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")


def test_meta_head_that_differs_from_the_embedding_stays_its_own_tensor(tmp_path):
    model = tiny_model(rope_theta=500000.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["output.weight"] = state["tok_embeddings.weight"].clone()
    state["output.weight"][-1, -1] += 1.0  # equal but for one number, in the last row
    write_meta(tmp_path, LLAMA32_PARAMS, [state])
    loaded = load_checkpoint(tmp_path)
    assert not loaded.args.tie_embeddings and loaded.output.weight is not loaded.tok_embeddings.weight
    assert torch.equal(loaded.output.weight, state["output.weight"])


def test_meta_vocab_size_minus_one_comes_from_the_tokenizer(tmp_path):
    require(LLAMA2_TOKENIZER)
    model = tiny_model(dim=16, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=32000, multiple_of=16)
    params = {"dim": 16, "n_layers": 1, "n_heads": 2, "vocab_size": -1, "multiple_of": 16, "norm_eps": 1e-5}
    write_meta(tmp_path / "llama-2-tiny", params, [model.state_dict()])
    (tmp_path / "tokenizer.model").symlink_to(LLAMA2_TOKENIZER)  # Meta's layout: beside the model folder
    assert load_checkpoint(tmp_path / "llama-2-tiny").args.vocab_size == 32000


def test_meta_ffn_dim_multiplier_is_honoured(tmp_path):
    # 70B's rule at small scale: int(2 * 4 * 64 / 3) = 170, * 1.3 = 221, up to a multiple of 32 = 224.
    model = tiny_model(ffn_dim_multiplier=1.3)
    assert model.args.ffn_dim == 224
    params = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 96, "multiple_of": 32, "ffn_dim_multiplier": 1.3}
    write_meta(tmp_path, params, [model.state_dict()])
    assert load_checkpoint(tmp_path).layers[0].feed_forward.w1.weight.shape == (224, 64)


def test_context_length_defaults_to_4096_and_can_be_overridden(tmp_path):
    save_checkpoint(tiny_model(), tmp_path, format="meta")  # params.json states no context length
    assert load_checkpoint(tmp_path).args.max_seq_len == 4096
    model = load_checkpoint(tmp_path, max_seq_len=64)
    assert model.args.max_seq_len == 64
    with pytest.raises(ValueError, match="exceeds max_seq_len 64"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("fmt", ["native", "meta", "hf"])
def test_stored_dtype_is_kept_unless_asked(tmp_path, fmt):
    save_checkpoint(tiny_model().to(torch.bfloat16), tmp_path, format=fmt)
    assert load_checkpoint(tmp_path).output.weight.dtype == torch.bfloat16
    assert load_checkpoint(tmp_path, dtype=torch.float32).output.weight.dtype == torch.float32


def mapped_file(tensor):
    """The file whose memory map holds tensor's data, or None for ordinary (anonymous) memory."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return Path(fields[5].strip()) if len(fields) == 6 and fields[5].startswith("/") else None
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
@pytest.mark.parametrize("fmt", ["native", "meta", "hf"])
def test_loaded_weights_stay_memory_mapped_from_the_files(tmp_path, fmt):
    # No copy in RAM: each parameter is a view of the checkpoint file, read from disk on first
    # use. HF's wq and wk are the exception: their rows are permuted back to Meta's order.
    save_checkpoint(tiny_model(), tmp_path, format=fmt)
    model = load_checkpoint(tmp_path)
    for name, p in model.named_parameters():
        if fmt == "hf" and name.endswith(("wq.weight", "wk.weight")):
            continue
        assert mapped_file(p) is not None and mapped_file(p).parent == tmp_path, name


# --- Errors: one line that names the problem -------------------------------------------------


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


class Payload:
    """Unpickling this runs open(marker, "w"): code execution, made visible as a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_pickle_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload_ran"
    state = tiny_model(n_layers=1).state_dict()
    state["evil"] = Payload(marker)
    write_meta(tmp_path / "ckpt", {"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 96}, [state])
    with pytest.raises(ValueError, match="pickled objects other than tensors") as excinfo:
        load_checkpoint(tmp_path / "ckpt")
    one_line_error(excinfo)
    assert not marker.exists()
    torch.load(tmp_path / "ckpt" / "consolidated.00.pth", weights_only=False)  # an unsafe load does run it
    assert marker.exists()


def test_truncated_safetensors_is_a_one_line_error(tmp_path):
    save_checkpoint(tiny_model(), tmp_path, format="hf")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors is truncated or corrupt") as excinfo:
        load_checkpoint(tmp_path)
    one_line_error(excinfo)


def test_corrupt_pth_is_a_one_line_error(tmp_path):
    save_checkpoint(tiny_model(), tmp_path, format="meta")
    (tmp_path / "consolidated.00.pth").write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="consolidated.00.pth is truncated or corrupt") as excinfo:
        load_checkpoint(tmp_path)
    one_line_error(excinfo)


def test_mismatched_shape_names_the_tensor_and_both_shapes(tmp_path):
    save_checkpoint(tiny_model(), tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["layers.1.attention.wv.weight"] = state["layers.1.attention.wv.weight"][:16].clone()
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as excinfo:
        load_checkpoint(tmp_path)
    assert one_line_error(excinfo) == (
        f"{tmp_path}: tensor layers.1.attention.wv.weight has shape (16, 64) but the config implies (32, 64); "
        "the config was not written for these weights: restore the one that came with them, or download or convert the checkpoint again"
    )


def every_format(folder) -> dict:
    """The tiny model saved in every format a reader takes (int8 too), by format: their paths."""
    from gguf import GGMLQuantizationType as T
    from gguf_files import gguf_names, write_gguf
    from llama2c_files import export
    from llama_mini import quantize

    model = tiny_model()
    paths = {fmt: save_checkpoint(model, folder / fmt, format=fmt) for fmt in ("native", "meta", "hf")}
    paths["int8"] = save_checkpoint(quantize(tiny_model(), "int8"), folder / "int8")
    paths["gguf"] = write_gguf(folder / "model.gguf", model.args, {n: (a, T.F32) for n, a in gguf_names(model).items()})
    paths["llama2c-bin"] = folder / "model.bin"
    export(model, paths["llama2c-bin"], 1)
    paths["llama2c-pt"] = folder / "ckpt.pt"
    torch.save({"model": model.state_dict(), "model_args": TINY}, paths["llama2c-pt"])
    return paths


def test_every_reader_checks_names_and_shapes_once_per_checkpoint(tmp_path, monkeypatch):
    from llama_mini.formats import gguf, hf, llama2c, meta, native, state_dict

    paths = every_format(tmp_path)
    checked = []
    for reader in (gguf, hf, llama2c, meta, native):
        monkeypatch.setattr(reader, "check_fits_config", lambda *a, **k: checked.append(a[2]) or state_dict.check_fits_config(*a, **k))
    for fmt, path in paths.items():
        checked.clear()
        load_checkpoint(path)
        assert checked == [path], fmt


def test_read_args_gives_each_formats_config_without_reading_a_tensor(tmp_path, monkeypatch):
    """What a draft is checked by before any weight is read (generate.py --draft): each format's
    ModelArgs, as load_checkpoint builds them, with every tensor reader made to fail."""
    from llama_mini.formats import hf, llama2c, meta, native
    from llama_mini.formats.checkpoint import read_args

    paths = every_format(tmp_path)
    del paths["llama2c-pt"]  # unpickled to find its config (its tensors mapped, not read)
    expected = {fmt: load_checkpoint(path).args for fmt, path in paths.items()}

    def no_tensors(*args, **kwargs):
        raise AssertionError("a tensor was read")

    for module, name in ((native, "read_safetensors"), (hf, "read_safetensors"), (hf, "torch_load"), (meta, "torch_load"),
                         (llama2c.torch, "from_file")):
        monkeypatch.setattr(module, name, no_tensors)
    for fmt, path in paths.items():
        assert read_args(path) == expected[fmt], fmt


def test_config_that_disagrees_with_weights_is_refused(tmp_path):
    save_checkpoint(tiny_model(), tmp_path, format="hf")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"does not fit the config: missing \['layers\.2\.") as excinfo:
        load_checkpoint(tmp_path)
    one_line_error(excinfo)


def test_missing_checkpoint_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "no-such-folder")


def test_meta_params_without_weights_is_file_not_found(tmp_path):
    (tmp_path / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 1, "n_heads": 4, "vocab_size": 96}))
    with pytest.raises(FileNotFoundError, match=r"needs consolidated\.00\.pth"):
        load_checkpoint(tmp_path)


def test_unknown_format_is_refused(tmp_path):
    (tmp_path / "weights.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="not a checkpoint folder of a known format"):
        load_checkpoint(tmp_path)


def test_non_llama_hf_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="'gpt2' model; only Llama"):
        load_checkpoint(tmp_path)
