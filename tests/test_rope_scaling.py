"""Llama-3 RoPE scaling as data: parity with transformers for factors 8 and 32, the
parameters read and written in every format, and rope types we do not implement refused.

The models are tiny and random, with an original context of 64 positions: sequences of a
few hundred positions then run far past the low frequencies' wavelengths, where the
scaling decides the rotation angles (a model with the scaling ignored is checked to fail).
"""

import dataclasses
import json

import pytest
import torch

from llama_mini import ModelArgs, Transformer, load_checkpoint, save_checkpoint
from llama_mini.formats.meta import meta_rope_scaling_factor

transformers = pytest.importorskip("transformers")

ORIGINAL_CONTEXT = 64
SEQ_LEN = 300


def llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL_CONTEXT}


def hf_llama(factor: float, tied: bool):
    """A random transformers LlamaForCausalLM (GQA, theta 500000, as Llama-3.2) with weights
    large enough that attention, and so the rotation, shapes the logits."""
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=512, rope_theta=500000.0, rope_scaling=llama3_rope(factor),
        tie_word_embeddings=tied, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if name.endswith("norm.weight") else torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(params=[(8.0, False), (32.0, True)], ids=["factor8", "factor32-tied"])
def hf_folder(request, tmp_path):
    """(an HF folder written by transformers' save_pretrained, its logits on SEQ_LEN tokens, tokens)."""
    factor, tied = request.param
    model = hf_llama(factor, tied)
    model.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 97, (1, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits
    return tmp_path / "hf", logits, tokens, factor


def reference_model(args):
    torch.manual_seed(0)
    return Transformer(args)


def max_error(model, tokens, expected) -> float:
    with torch.no_grad():
        return (model(tokens) - expected).abs().max().item()


def test_hf_llama3_scaling_loads_with_its_parameters_and_matches_transformers(hf_folder):
    folder, expected, tokens, factor = hf_folder
    model = load_checkpoint(folder)
    args = model.args
    assert (args.use_scaled_rope, args.rope_scaling_factor, args.rope_original_max_seq_len) == (True, factor, ORIGINAL_CONTEXT)
    assert (args.rope_low_freq_factor, args.rope_high_freq_factor) == (1.0, 4.0)
    assert max_error(model, tokens, expected) <= 1e-4
    # The test can fail: the same weights without the scaling, or with the other factor, are far off.
    model.args = dataclasses.replace(args, use_scaled_rope=False)
    assert max_error(model, tokens, expected) > 1e-2
    model.args = dataclasses.replace(args, rope_scaling_factor=40.0 - factor)  # 32 <-> 8
    assert max_error(model, tokens, expected) > 1e-2


def test_scaling_survives_hf_to_meta_to_hf(hf_folder, tmp_path):
    folder, expected, tokens, factor = hf_folder
    save_checkpoint(load_checkpoint(folder), tmp_path / "meta", format="meta")
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    assert params["use_scaled_rope"] is True and params["rope_scaling_factor"] == factor
    from_meta = load_checkpoint(tmp_path / "meta")
    assert max_error(from_meta, tokens, expected) <= 1e-4
    save_checkpoint(from_meta, tmp_path / "native")
    assert max_error(load_checkpoint(tmp_path / "native"), tokens, expected) <= 1e-4
    save_checkpoint(from_meta, tmp_path / "back", format="hf")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    assert theirs.config.rope_parameters["factor"] == factor
    with torch.no_grad():
        assert (theirs(tokens).logits - expected).abs().max().item() <= 1e-4


def test_meta_params_without_a_factor_get_metas_8_except_llama32_1b_and_3b():
    """Meta's params.json never states the factor (its llama3 code hard-codes 8); Llama-3.2
    1B and 3B, trained with 32, are known by their published shapes."""
    llama31_8b = {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "use_scaled_rope": True}
    llama32_1b = {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "use_scaled_rope": True}
    llama32_3b = {"dim": 3072, "n_layers": 28, "n_heads": 24, "n_kv_heads": 8, "use_scaled_rope": True}
    assert [meta_rope_scaling_factor(p) for p in (llama31_8b, llama32_1b, llama32_3b)] == [8.0, 32.0, 32.0]


def test_meta_params_that_say_only_use_scaled_rope_load_metas_constants(tmp_path):
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=32, use_scaled_rope=True, rope_theta=500000.0)
    save_checkpoint(reference_model(args), tmp_path, format="meta")
    params = json.loads((tmp_path / "params.json").read_text())
    for name in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len"):
        del params[name]  # as Meta writes it
    (tmp_path / "params.json").write_text(json.dumps(params))
    loaded = load_checkpoint(tmp_path).args
    assert (loaded.rope_scaling_factor, loaded.rope_low_freq_factor, loaded.rope_high_freq_factor) == (8.0, 1.0, 4.0)
    assert loaded.rope_original_max_seq_len == 8192 and loaded == args


# --- Refusals --------------------------------------------------------------------------------


def write_hf_folder(folder, rope_key: str, rope: dict):
    """A valid HF folder of a tiny model whose config.json says rope under rope_key."""
    save_checkpoint(reference_model(ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=16)), folder, format="hf")
    config = json.loads((folder / "config.json").read_text())
    config[rope_key] = rope
    (folder / "config.json").write_text(json.dumps(config))


def refusal(folder) -> str:
    with pytest.raises(ValueError) as error:
        load_checkpoint(folder)
    message = str(error.value)
    assert "\n" not in message and str(folder / "config.json") in message
    return message


@pytest.mark.parametrize("rope_key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope", "linear"])
def test_unsupported_rope_type_is_refused_in_one_line(tmp_path, rope_key, rope_type):
    write_hf_folder(tmp_path, rope_key, {"rope_type": rope_type, "factor": 4.0, "original_max_position_embeddings": 64})
    assert f"rope_type {rope_type!r}, which llama_mini does not implement" in refusal(tmp_path)


def test_legacy_type_key_is_read_and_refused_too(tmp_path):
    write_hf_folder(tmp_path, "rope_scaling", {"type": "dynamic", "factor": 2.0})
    assert "rope_type 'dynamic'" in refusal(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"factor": None}, "lacks factor;"),
    ({"low_freq_factor": None, "high_freq_factor": None}, "lacks low_freq_factor, high_freq_factor;"),
    ({"factor": "32"}, "rope_scaling_factor to be a positive number, got '32'"),
    ({"factor": 0.5}, "rope_scaling_factor must be >= 1"),
    ({"low_freq_factor": 4.0}, "rope_high_freq_factor (4.0) must be greater than rope_low_freq_factor (4.0)"),
    ({"original_max_position_embeddings": -1}, "rope_original_max_seq_len to be a positive number, got -1"),
])
def test_llama3_scaling_with_missing_or_invalid_parameters_is_refused_in_one_line(tmp_path, change, message):
    write_hf_folder(tmp_path, "rope_scaling", {**llama3_rope(32.0), **change})
    assert message in refusal(tmp_path)


def test_rope_scaling_that_is_not_an_object_is_refused_in_one_line(tmp_path):
    write_hf_folder(tmp_path, "rope_scaling", ["llama3", 32])
    assert "must be a JSON object, got ['llama3', 32]" in refusal(tmp_path)
