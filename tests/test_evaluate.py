"""python -m llama_mini.evaluate: perplexity and bits per byte of a checkpoint on a text file,
by llama.cpp's method, against a direct computation on the same weights for every format."""

import math
import subprocess
import sys

import pytest
import torch

from fixtures import LLAMA2_TOKENIZER, require
from llama2c_files import export, export_sentencepiece
from llama_mini import ModelArgs, Transformer, load_checkpoint, save_checkpoint
from llama_mini.evaluate import main
from llama_mini.formats.convert import convert
from llama_mini.tokenizers import open_tokenizer
from llama_mini.run import corpus

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
CTX = 64
TEXT = "\n\n".join(corpus.stories(6000, seed=5)) + "\nA café, a naïve façade — and Zoë's smörgåsbord.\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny random model over Meta's Llama-2 vocabulary in every format, and a text file."""
    require(LLAMA2_TOKENIZER)
    root = tmp_path_factory.mktemp("evaluate")
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32000, multiple_of=32, max_seq_len=128))
    with torch.no_grad():  # logits spread far beyond uniform, norms not all ones
        model.output.weight.mul_(40)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    native = save_checkpoint(model, root / "native", tokenizer_path=LLAMA2_TOKENIZER)
    export(model, root / "model.bin", 1)
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    return dict(
        root=root, text=root / "text.txt", native=native,
        meta=convert(native, root / "meta", "meta"), hf=convert(native, root / "hf", "hf"),
        gguf_f32=convert(native, root / "f32.gguf", "gguf", gguf_type="f32"),
        gguf_q8_0=convert(native, root / "q8.gguf", "gguf", gguf_type="q8_0"),
        llama2c=root / "model.bin", llama2c_tokenizer=export_sentencepiece(LLAMA2_TOKENIZER, root / "tokenizer.bin"),
    )


def direct(model, tokenizer, text: str, ctx: int):
    """llama.cpp's perplexity, written out: chunks of ctx tokens of the whole text with BOS
    first, each chunk's first token BOS, the second half scored on model.py's own code; and
    the bytes the scored tokens decode to."""
    ids = tokenizer.encode(text, bos=True)
    nll, n_bytes, first = [], 0, ctx // 2
    for start in range(0, len(ids) // ctx * ctx, ctx):
        chunk = [tokenizer.bos_id] + ids[start + 1:start + ctx]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([chunk]))[0].double(), dim=-1)
        nll += [-logp[i, chunk[i + 1]].item() for i in range(first, ctx - 1)]
        n_bytes += len(tokenizer.decode(chunk[first:]).encode()) - len(tokenizer.decode(chunk[first:first + 1]).encode())
    nll = torch.tensor(nll, dtype=torch.float64)
    ppl = math.exp(nll.mean())
    return ppl, (nll.var() / len(nll)).sqrt().item() * ppl, nll.sum().item() / math.log(2) / n_bytes


def figures(out: str):
    """(perplexity, its error, bits per byte) from evaluate's last line."""
    words = out.strip().splitlines()[-1].split()
    return float(words[1]), float(words[3]), float(words[words.index("bits") - 1])


CASES = {  # format: (flags, how the reference loads it, tolerance)
    "native": ([], {}, 1e-5),
    "meta": ([], {}, 1e-5),
    "hf": ([], {}, 1e-5),
    "gguf_f32": ([], {}, 1e-5),
    "gguf_q8_0": ([], {}, 1e-3),  # int8 layers at the file's precision: the kernels' sums, not model.py's order
    "llama2c": (["--tokenizer", "llama2c_tokenizer"], {}, 1e-5),
    "native_int8": (["--quantize", "int8"], {"quantize": "int8"}, 2e-3),
    "native_bf16": (["--dtype", "bfloat16"], {"dtype": torch.bfloat16}, 1e-2),
}


@pytest.mark.parametrize("case", ["native", *(pytest.param(c, marks=pytest.mark.slow) for c in CASES if c != "native")])
def test_perplexity_and_bits_per_byte_equal_a_direct_computation(files, case, capsys):
    extra, load, tolerance = CASES[case]
    ckpt = files[case.removesuffix("_int8").removesuffix("_bf16")]
    extra = [str(files[a]) if a in files else a for a in extra]
    assert main_exit(["--ckpt", str(ckpt), "--data", str(files["text"]), "--ctx", str(CTX), *extra]) == 0
    ppl, error, bpb = figures(capsys.readouterr().out)
    tokenizer = open_tokenizer(files["llama2c_tokenizer"] if case == "llama2c" else LLAMA2_TOKENIZER)
    model = load_checkpoint(ckpt, **load).eval()
    want = direct(model, tokenizer, TEXT, CTX)
    assert ppl == pytest.approx(want[0], rel=tolerance)
    assert error == pytest.approx(want[1], rel=max(tolerance, 1e-3))  # printed to 5 decimals
    assert bpb == pytest.approx(want[2], rel=max(tolerance, 1e-3))
    assert error > 0 and bpb > 0


def main_exit(argv) -> int:
    from llama_mini.support.cli import run_main

    return run_main(main, argv)


def test_chunks_limits_the_chunks_scored(files, capsys):
    assert main_exit(["--ckpt", str(files["native"]), "--data", str(files["text"]), "--ctx", str(CTX), "--chunks", "3"]) == 0
    out = capsys.readouterr().out
    assert f"over {3 * (CTX - 1 - CTX // 2)} tokens (3 chunks of {CTX})" in out


@pytest.mark.parametrize("case, words", [
    ("missing", ["data not found", "nowhere.txt"]),
    ("folder", ["is not a file", "pass --data a UTF-8 text file"]),
    ("latin1", ["not UTF-8", "0xe9", "offset 4"]),
    ("short", ["fewer than --ctx 64 tokens"]),
    ("ctx", ["--ctx 4096 exceeds max_seq_len 128, the model's context; pass --ctx 128 or less"]),
    ("zero_ctx", ["--ctx"]),
])
def test_bad_input_is_refused_in_one_line(files, tmp_path, case, words):
    data = {"missing": tmp_path / "nowhere.txt", "latin1": tmp_path / "latin1.txt", "short": tmp_path / "short.txt",
            "folder": tmp_path}.get(case, files["text"])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1").replace(b"caf", b"cafe"))
    (tmp_path / "short.txt").write_text("Once upon a time.")
    ctx = {"ctx": "4096", "zero_ctx": "0"}.get(case, str(CTX))
    result = subprocess.run([sys.executable, "-m", "llama_mini.evaluate", "--ckpt", str(files["native"]), "--data", str(data),
                             "--ctx", ctx], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def test_ctx_is_llama_cpps_512_or_the_models_context_where_shorter(files, capsys):
    """The fixture's model holds 128 positions: without --ctx its chunks are 128 tokens long."""
    assert main_exit(["--ckpt", str(files["native"]), "--data", str(files["text"]), "--chunks", "2"]) == 0
    assert f"over {2 * 63} tokens (2 chunks of 128)" in capsys.readouterr().out


# --- --kl-divergence, as llama-perplexity --kl-divergence ----------------------------------------


def comparison(out: str) -> dict:
    """The figures of evaluate's KL divergence line."""
    line = out.strip().splitlines()[-1]
    words = line.replace(";", "").replace(",", "").split()
    return {"kld": float(words[words.index("divergence") + 1]), "same": float(words[words.index("token") + 1]),
            "ppl": float(words[words.index("perplexity") + 1]), "base_ppl": float(words[words.index("perplexity") + 3]),
            "ratio": float(words[words.index("ratio") + 1]), "tokens": int(words[words.index("over") + 1])}


def direct_comparison(model, base, tokenizer, text: str, ctx: int) -> dict:
    """KL(base || model) per scored token, the share of equal top tokens and the perplexities,
    written out on the chunks llama.cpp's method scores."""
    ids = tokenizer.encode(text, bos=True)
    kld, same, nll, base_nll, first = [], [], [], [], ctx // 2
    for start in range(0, len(ids) // ctx * ctx, ctx):
        chunk = torch.tensor([[tokenizer.bos_id] + ids[start + 1:start + ctx]])
        with torch.no_grad():
            p, q = (torch.log_softmax(m(chunk)[0, first:ctx - 1].double(), -1) for m in (base, model))
        targets = chunk[0, first + 1:]
        kld += (p.exp() * (p - q)).sum(-1).tolist()
        same += (p.argmax(-1) == q.argmax(-1)).tolist()
        nll += (-q.gather(1, targets[:, None])[:, 0]).tolist()
        base_nll += (-p.gather(1, targets[:, None])[:, 0]).tolist()
    return {"kld": sum(kld) / len(kld), "same": 100 * sum(same) / len(same), "ppl": math.exp(sum(nll) / len(nll)),
            "base_ppl": math.exp(sum(base_nll) / len(base_nll)), "tokens": len(kld)}


@pytest.fixture(scope="module")
def other(files):
    """A second model over the same vocabulary: the fixture's weights, each moved by 5%."""
    torch.manual_seed(1)
    model = load_checkpoint(files["native"])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.05 * torch.randn_like(p))
    return save_checkpoint(model, files["root"] / "other", tokenizer_path=LLAMA2_TOKENIZER)


def run_evaluate(files, ckpt, *flags, capsys):
    code = main_exit(["--ckpt", str(ckpt), "--data", str(files["text"]), "--ctx", str(CTX), *map(str, flags)])
    return code, capsys.readouterr().out


def test_kl_divergence_from_a_base_checkpoint_equals_a_direct_computation(files, other, capsys):
    code, out = run_evaluate(files, files["native"], "--kl-divergence", other, capsys=capsys)
    assert code == 0
    got = comparison(out)
    want = direct_comparison(load_checkpoint(files["native"]).eval(), load_checkpoint(other).eval(),
                             open_tokenizer(LLAMA2_TOKENIZER), TEXT, CTX)
    assert got["tokens"] == want["tokens"] and got["kld"] > 0.01
    assert got["kld"] == pytest.approx(want["kld"], rel=1e-4)
    assert got["same"] == pytest.approx(want["same"], abs=0.001)
    assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-4) and got["base_ppl"] == pytest.approx(want["base_ppl"], rel=1e-4)
    assert got["ratio"] == pytest.approx(want["ppl"] / want["base_ppl"], rel=1e-4)


def test_a_model_against_itself_differs_by_nothing(files, capsys):
    code, out = run_evaluate(files, files["native"], "--kl-divergence", files["native"], capsys=capsys)
    got = comparison(out)
    assert code == 0 and got["kld"] == 0 and got["same"] == 100 and got["ratio"] == 1


def test_saved_base_logits_give_the_base_checkpoints_figures(files, other, tmp_path, capsys):
    saved = tmp_path / "base.logits"
    assert run_evaluate(files, other, "--save-logits", saved, capsys=capsys)[0] == 0
    code, from_file = run_evaluate(files, files["native"], "--kl-divergence", saved, capsys=capsys)
    assert code == 0
    from_model = comparison(run_evaluate(files, files["native"], "--kl-divergence", other, capsys=capsys)[1])
    from_file = comparison(from_file)
    assert from_file["kld"] == pytest.approx(from_model["kld"], rel=1e-3)  # the saved logits' rounding: 1/65535 of a row's range
    assert from_file["same"] == pytest.approx(from_model["same"], abs=0.5)  # near ties of the base's top two may turn
    assert from_file["ppl"] == from_model["ppl"]
    assert from_file["base_ppl"] == pytest.approx(from_model["base_ppl"], rel=1e-4)


@pytest.mark.parametrize("case, words", [
    ("existing", ["already exists; --save-logits writes a new file"]),
    ("other_ctx", ["in chunks of 32; this run has 32000 and chunks of 64", "the same --ctx"]),
    ("truncated", ["ends inside a chunk; it is truncated"]),
    ("not_logits", ["--kl-divergence", "is a file in no format llama_mini reads"]),
])
def test_bad_kl_divergence_input_is_refused_in_one_line(files, tmp_path, case, words):
    saved = tmp_path / "base.logits"
    if case in ("other_ctx", "truncated"):
        assert main_exit(["--ckpt", str(files["native"]), "--data", str(files["text"]), "--ctx", "32" if case == "other_ctx"
                          else str(CTX), "--chunks", "2", "--save-logits", str(saved)]) == 0
        if case == "truncated":
            saved.write_bytes(saved.read_bytes()[:-100])
    else:
        saved.write_text("my notes\n")
    kept = saved.read_bytes()
    flag = "--save-logits" if case == "existing" else "--kl-divergence"
    result = subprocess.run([sys.executable, "-m", "llama_mini.evaluate", "--ckpt", str(files["native"]), "--data",
                             str(files["text"]), "--ctx", str(CTX), flag, str(saved)], capture_output=True, text=True, cwd=ROOT,
                            timeout=180)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr
    assert saved.read_bytes() == kept


def test_save_logits_into_a_missing_folder_is_refused_before_the_model_loads(files, tmp_path):
    result = subprocess.run([sys.executable, "-m", "llama_mini.evaluate", "--ckpt", str(files["native"]), "--data",
                             str(files["text"]), "--save-logits", str(tmp_path / "missing" / "base.logits")],
                            capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert result.returncode == 2 and "Traceback" not in result.stderr and "loaded" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: --save-logits {tmp_path / 'missing' / 'base.logits'}: the folder "
                                                  f"{tmp_path / 'missing'} does not exist; create it first"]
    assert not (tmp_path / "missing").exists()
