"""The format record (llama_mini/formats/record.py): every checkpoint says which layout it is in
and which llama_mini wrote it; an older layout is read only where the record says a reader is
kept, and otherwise refused in one line naming the version that wrote it and the fix."""

import json

import pytest
import torch

import llama_mini
import train as train_cli  # the top-level script, called in-process
from fixtures import TINY, tiny_model
from generate_cli_helpers import run_in_process
from llama_mini import load_checkpoint, quantize, save_checkpoint
from llama_mini import evaluate
from llama_mini.support.cli import run_main
from llama_mini.formats import convert
from llama_mini.formats.record import FORMAT_VERSION
from llama_mini.run import corpus
from llama_mini.tokenizers.spm import train_sentencepiece

OLDER = "was written by a llama_mini older than 0.1.0 (it has no format record)"


def edit_config(folder, change) -> None:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def without_record(config: dict) -> None:
    """config.json as a llama_mini before 0.1.0 wrote it: the same fields, no format record."""
    del config["format_version"], config["llama_mini_version"]


def refusal(path) -> str:
    with pytest.raises(ValueError) as excinfo:
        load_checkpoint(path)
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_a_checkpoint_records_its_format_and_the_llama_mini_that_wrote_it(tmp_path):
    save_checkpoint(tiny_model(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["format_version"], config["llama_mini_version"]) == (FORMAT_VERSION, llama_mini.__version__)


def test_a_full_precision_checkpoint_without_a_record_is_in_todays_layout_and_loads(tmp_path):
    model = tiny_model()
    save_checkpoint(model, tmp_path)
    edit_config(tmp_path, without_record)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.equal(load_checkpoint(tmp_path)(tokens), model(tokens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_format_2_int4_checkpoint_reads_its_zeros_as_offsets(tmp_path, dtype):
    """Format 2 stored each int4 group's zero (the value code 8 stands for); format 3 its offset
    (code 0's). A format-2 file, written here as 0.2.0 wrote it, loads as the same weights to
    within one rounding of the scales' dtype, and its logits follow."""
    model = quantize(tiny_model().to(dtype), "int4")
    save_checkpoint(model, tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "model.safetensors")
    for name in [name for name in state if name.endswith(".offsets")]:
        layer = name[: -len("offsets")]
        state[layer + "zeros"] = (state.pop(name).float() + 8 * state[layer + "scales"].float()).to(dtype)
    save_file(state, tmp_path / "model.safetensors")
    edit_config(tmp_path, lambda config: config.update(format_version=2, llama_mini_version="0.2.0"))
    loaded = load_checkpoint(tmp_path)
    for (name, theirs), ours in zip(model.named_modules(), loaded.modules()):
        if hasattr(ours, "offsets"):
            step = theirs.group_scales_and_offsets()[0].float().abs().amax().item()
            assert (ours.dequantize(torch.float32) - theirs.dequantize(torch.float32)).abs().amax() <= \
                step * (1e-6 if dtype == torch.float32 else 2 ** -6), name
    tokens = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).float(), model(tokens).float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_quantized_checkpoint_without_a_record_is_refused_naming_the_version_and_the_fix(tmp_path, method):
    """llama_mini before 0.1.0 wrote several int8 and int4 layouts under one quantization
    record: the file cannot say which it holds, so none is guessed from the tensors."""
    save_checkpoint(quantize(tiny_model(), method), tmp_path)
    edit_config(tmp_path, without_record)
    assert refusal(tmp_path) == (
        f"{tmp_path / 'config.json'} {OLDER} and holds quantized weights in a layout it does not name; quantize again "
        f"from the full-precision checkpoint: python -m llama_mini.formats.convert SOURCE NEW_FOLDER --to native --quantize {method}"
    )


def test_a_config_naming_norm_impl_is_refused_and_loads_once_the_field_is_deleted(tmp_path):
    model = tiny_model()
    save_checkpoint(model, tmp_path)
    edit_config(tmp_path, lambda config: (without_record(config), config["llama_mini"].update(norm_impl="reference")))
    assert refusal(tmp_path) == (
        f"{tmp_path / 'config.json'} {OLDER} and names norm_impl, which said which RMSNorm code ran and is no longer "
        "stored; delete that field from it (the weights need no change)"
    )
    edit_config(tmp_path, lambda config: config["llama_mini"].pop("norm_impl"))
    tokens = torch.randint(0, TINY["vocab_size"], (1, 5))
    with torch.no_grad():
        assert torch.equal(load_checkpoint(tmp_path)(tokens), model(tokens))


def test_a_checkpoint_of_a_newer_format_is_refused_naming_the_version_that_wrote_it(tmp_path):
    save_checkpoint(tiny_model(), tmp_path)
    edit_config(tmp_path, lambda config: config.update(format_version=FORMAT_VERSION + 1, llama_mini_version="9.1.0"))
    assert refusal(tmp_path) == (
        f"{tmp_path / 'config.json'} was written by llama_mini 9.1.0 in format {FORMAT_VERSION + 1}; this is llama_mini "
        f"{llama_mini.__version__}, which reads formats up to {FORMAT_VERSION}: upgrade llama_mini"
    )


@pytest.mark.parametrize("record", ["2", 0, -1, True, 2.0, None, [2]])
def test_a_record_that_is_not_a_format_number_is_refused_in_one_line(tmp_path, record):
    save_checkpoint(tiny_model(), tmp_path)
    edit_config(tmp_path, lambda config: config.update(format_version=record))
    assert refusal(tmp_path).startswith(f"{tmp_path / 'config.json'}: format_version is ")


def test_a_version_too_odd_to_print_is_shown_quoted_on_the_same_line(tmp_path):
    save_checkpoint(tiny_model(), tmp_path)
    edit_config(tmp_path, lambda config: config.update(format_version=99, llama_mini_version="1.0\nrm -rf /"))
    assert "was written by llama_mini '1.0\\nrm -rf /' in format 99" in refusal(tmp_path)


# --- Every command: one line, no traceback --------------------------------------------------


@pytest.fixture(scope="module")
def old_int8(tmp_path_factory):
    """An int8 checkpoint without a format record, its tokenizer beside it, and a text."""
    root = tmp_path_factory.mktemp("old")
    (root / "text.txt").write_text("\n\n".join(corpus.stories(20_000, seed=3)), encoding="utf-8")
    tokenizer = train_sentencepiece((root / "text.txt").read_text().splitlines(), 400, root / "tok.model")
    model = quantize(tiny_model(vocab_size=tokenizer.n_words), "int8")
    save_checkpoint(model, root / "int8", tokenizer_path=tokenizer.model_path)
    edit_config(root / "int8", without_record)
    return root


def run_command(command: str, root, capsys):
    """(exit code, stderr) of command run on the old checkpoint, in-process, through its one error path."""
    ckpt, text = root / "int8", root / "text.txt"
    if command == "generate.py":
        result = run_in_process("--ckpt", ckpt, "--prompt", "Tom", capsys=capsys)
        return result.returncode, result.stderr
    main, argv = {
        "convert": (lambda argv: run_main(convert.main, argv), [ckpt, root / "hf", "--to", "hf"]),
        "evaluate": (lambda argv: run_main(evaluate.main, argv), ["--ckpt", ckpt, "--data", text]),
        "train.py --init-from": (train_cli.main, ["--init-from", ckpt, "--data", text, "--out", root / "run", "--device", "cpu"]),
    }[command]
    return main([str(a) for a in argv]), capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate.py", "convert", "evaluate", "train.py --init-from"])
def test_every_command_refuses_an_older_layout_in_one_line_naming_the_version(old_int8, capsys, command):
    capsys.readouterr()
    code, err = run_command(command, old_int8, capsys)
    assert code == 2 and "Traceback" not in err and err.count("error: ") == 1, err
    assert f"error: {old_int8 / 'int8' / 'config.json'} {OLDER}" in err
    assert not (old_int8 / "hf").exists() and not (old_int8 / "run").exists()
