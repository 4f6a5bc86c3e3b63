"""Loading checkpoints of every format, against transformers as the independent reference."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llama_mini import ModelArgs, Transformer, generate, load_checkpoint, save_checkpoint
from llama_mini.checkpoint import detect_format

transformers = pytest.importorskip("transformers")

FIXTURE_TOKENIZER = Path("/work/shared/fixtures/llama2-tokenizer.model")
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


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=32, max_seq_len=128)
    return Transformer(ModelArgs(**{**args, **kw})).eval()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """The tiny HF model saved with save_pretrained as several safetensors shards."""
    model = hf_model()
    folder = tmp_path_factory.mktemp("hf")
    model.save_pretrained(folder, max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").is_file()
    return model, folder


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


def test_meta_vocab_size_minus_one_comes_from_the_tokenizer(tmp_path):
    if not FIXTURE_TOKENIZER.is_file():
        pytest.skip("Meta's Llama-2 tokenizer fixture is absent")
    model = tiny_model(dim=16, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=32000, multiple_of=16)
    params = {"dim": 16, "n_layers": 1, "n_heads": 2, "vocab_size": -1, "multiple_of": 16, "norm_eps": 1e-5}
    write_meta(tmp_path / "llama-2-tiny", params, [model.state_dict()])
    (tmp_path / "tokenizer.model").symlink_to(FIXTURE_TOKENIZER)  # Meta's layout: beside the model folder
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
    assert one_line_error(excinfo) == "tensor layers.1.attention.wv.weight has shape (16, 64) but the config implies (32, 64)"


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
