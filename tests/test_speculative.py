"""Speculative decoding: a draft's tokens change the speed, never the output.

Greedy with a draft gives plain greedy decoding's tokens, bit for bit where every position is
computed as it would be alone (the CPU kernels: each type); sampling follows the model's own
distribution (a chi-square test against the exact distribution, which the draft's own fails).
Drafts used: a perfect one (the target less a block that adds nothing), an opposite one (its
head negated: every proposal refused), a cut one (the target's first block and head) and
prompt lookup.
"""

import re

import pytest
import torch

from fixtures import tiny_model
from llama_mini import generate, quantize
from llama_mini.generation import NGRAM, _ngram_proposals, generate_stream
from llama_mini.kernels import on_kernels, use_cpu_kernels, use_fused_rmsnorm
from llama_mini.kernels.operators import operators

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 7, 9, 5, 7], [1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11]]  # ragged
on_cpu_kernels = pytest.mark.skipif(operators() is None, reason="no vector kernels on this machine (x86-64 with AVX2 and FMA)")


def target_and_drafts(dtype=torch.float32, quantization=None, kernels=True, **shape):
    """A 3-block target whose last block adds nothing (wo and w2 zero) and its drafts: perfect
    (its first two blocks: the same logits), opposite (those with the head negated) and cut
    (its first block)."""
    target = tiny_model(0, n_layers=3, **shape)
    with torch.no_grad():
        target.layers[2].attention.wo.weight.zero_()
        target.layers[2].feed_forward.w2.weight.zero_()
    drafts = {}
    for name, blocks in (("perfect", 2), ("opposite", 2), ("cut", 1)):
        draft = tiny_model(0, n_layers=blocks, **shape)
        draft.load_state_dict({k: v for k, v in target.state_dict().items()
                               if not k.startswith("layers.") or int(k.split(".")[1]) < blocks})
        if name == "opposite":
            with torch.no_grad():
                draft.output.weight.neg_()
        drafts[name] = draft
    for model in (target, *drafts.values()):
        model.to(dtype)
        if quantization:
            quantize(model, quantization)
        if kernels:
            use_cpu_kernels(use_fused_rmsnorm(model))
    return target, drafts


def speculative(target, draft, lookahead, max_new=24, eos_id=None, **sampling):
    tally = {}
    out = [[] for _ in PROMPTS]
    steps = generate_stream(target, PROMPTS, max_new, sampling.pop("temperature", 0.0), sampling.pop("top_p", 1.0),
                            sampling.pop("top_k", None), eos_id, sampling.pop("seed", 0), draft, lookahead, tally)
    for step in steps:
        for row, token in zip(out, step):
            if token is not None:
                row.append(token)
    return out, tally


@on_cpu_kernels
@pytest.mark.parametrize("dtype, quantization", [(torch.float32, None), (torch.bfloat16, None),
                                                 (torch.float32, "int8"), (torch.float32, "int4")],
                         ids=["fp32", "bf16", "int8", "int4"])
def test_greedy_with_any_draft_gives_plain_greedy_tokens_on_the_kernels(dtype, quantization):
    target, drafts = target_and_drafts(dtype, quantization)
    assert on_kernels(target)
    plain = generate(target, PROMPTS, 24, temperature=0)
    assert all(len(row) == 24 for row in plain)
    for name, draft in [*drafts.items(), (NGRAM, NGRAM)]:
        for lookahead in (1, 3, 8):
            got, tally = speculative(target, draft, lookahead)
            assert got == plain, (name, lookahead)
            if name == "perfect":
                assert tally["accepted"] == tally["drafted"] > 0, "the same logits: every proposal kept"
            if name == "opposite":
                assert tally["accepted"] == 0 and tally["drafted"] > 0, "the argmin proposed: every proposal refused"


def test_greedy_with_a_draft_stops_each_row_at_its_own_eos_as_plain_decoding_does():
    target, drafts = target_and_drafts(torch.float64, kernels=False)
    plain = generate(target, PROMPTS, 30, temperature=0)
    eos = plain[0][5]  # a token the first row meets early
    expected = generate(target, PROMPTS, 30, temperature=0, eos_id=eos)
    assert expected[0] == plain[0][:plain[0].index(eos)]
    for draft in (drafts["cut"], drafts["perfect"], NGRAM):
        assert speculative(target, draft, 4, max_new=30, eos_id=eos)[0] == expected


def test_with_a_draft_exactly_max_new_tokens_come_back_or_none():
    target, drafts = target_and_drafts(torch.float64, kernels=False)
    for draft in (drafts["cut"], NGRAM):
        for n in (0, 1, 2, 7):
            assert [len(row) for row in speculative(target, draft, 4, max_new=n)[0]] == [n] * len(PROMPTS)


def test_off_the_kernels_in_float64_greedy_with_a_draft_gives_plain_greedy_tokens():
    """torch's code sums a batch of positions in another order than one position: in float64 the
    rounding is far below any gap between two logits of this model."""
    target, drafts = target_and_drafts(torch.float64, kernels=False)
    plain = generate(target, PROMPTS, 24, temperature=0)
    for draft in (*drafts.values(), NGRAM):
        assert speculative(target, draft, 5)[0] == plain


@pytest.mark.parametrize("broken", ["target", "draft"])
def test_nan_weights_in_the_model_or_the_draft_are_reported_not_sampled(broken):
    target, drafts = target_and_drafts(kernels=False)
    draft = drafts["cut"]
    with torch.no_grad():
        (target if broken == "target" else draft).norm.weight[0] = float("nan")
    name = "model" if broken == "target" else "draft"
    for temperature in (0.0, 0.8):
        with pytest.raises(ValueError, match=f"the {name}'s logits at position \\d+ are NaN or infinite"):
            generate(target, [[1, 2, 3]], 8, temperature=temperature, draft=draft)


def test_sampling_with_a_draft_is_reproducible_for_a_seed():
    target, drafts = target_and_drafts(kernels=False)
    first = speculative(target, drafts["cut"], 4, temperature=0.8, top_p=0.9, seed=7)[0]
    assert first == speculative(target, drafts["cut"], 4, temperature=0.8, top_p=0.9, seed=7)[0]
    assert first != speculative(target, drafts["cut"], 4, temperature=0.8, top_p=0.9, seed=8)[0]


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of counts drawn from probs (Pearson's test, cells expected fewer than 5 pooled)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].sum().double().reshape(1)])
    expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((len(expected) - 1) / 2, dtype=torch.float64), statistic / 2).item()


@torch.no_grad()
def second_token_distribution(model, prompt, temperature, top_p, top_k):
    """The exact distribution of the second new token: sum over x1 of p(x1) p(x2 | x1), as generate samples them."""
    from llama_mini.generation import probabilities

    first = probabilities(model(torch.tensor([prompt]))[0, -1], temperature, top_p, top_k)
    contexts = torch.tensor([prompt + [x] for x in range(model.args.vocab_size)])
    second = probabilities(model(contexts)[:, -1], temperature, top_p, top_k)
    return first @ second


@pytest.mark.parametrize("sampling", [dict(temperature=1.0, top_p=1.0, top_k=None), dict(temperature=0.7, top_p=0.9, top_k=8)],
                         ids=["plain", "filtered"])
def test_sampling_with_a_draft_follows_the_models_distribution(sampling):
    """3,000 seeds of the second new token (the first a draft proposes): a chi-square test
    against the model's exact distribution passes; the same test on the draft's own samples
    fails, so it can tell them apart."""
    shape = dict(vocab_size=12, dim=32, multiple_of=16)
    target, drafts = target_and_drafts(kernels=False, **shape)
    draft = tiny_model(5, n_layers=1, **shape)  # another model: its proposals are often refused
    with torch.no_grad():  # peaked distributions, far from uniform and from each other
        target.output.weight.mul_(8)
        draft.output.weight.mul_(8)
    prompt, n = [1, 4, 2], 3000
    tally = {}
    rows = [row for seed in range(0, n, 100) for row in generate_stream_all(target, draft, prompt, seed, sampling, tally)]
    counts = torch.bincount(torch.tensor([row[1] for row in rows]), minlength=12)
    assert 0.1 < tally["accepted"] / tally["drafted"] < 0.9, "some proposals kept, some refused"
    assert chi_square_p_value(counts, second_token_distribution(target, prompt, **sampling)) > 1e-3
    own = generate(draft, [prompt] * n, 2, seed=1, **sampling)
    own_counts = torch.bincount(torch.tensor([row[1] for row in own]), minlength=12)
    assert chi_square_p_value(own_counts, second_token_distribution(target, prompt, **sampling)) < 1e-3


def generate_stream_all(target, draft, prompt, seed, sampling, tally):
    """100 samples of three new tokens after prompt (the second one proposed by the draft), one
    generator seeded once (rows run one after another)."""
    out = [[] for _ in range(100)]
    steps = generate_stream(target, [prompt] * 100, 3, sampling["temperature"], sampling["top_p"], sampling["top_k"], None,
                            seed, draft, 3, tally)
    for step in steps:
        for row, token in zip(out, step):
            if token is not None:
                row.append(token)
    return out


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    assert _ngram_proposals([7, 2, 3, 4, 9, 2, 3, 5, 8, 2, 3], 2) == [5, 8]  # "2 3" last seen before 5
    assert _ngram_proposals([7, 1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], 4) == [4, 9, 2, 3]  # "1 2 3" beats "2 3"
    assert _ngram_proposals([1, 2, 3, 4], 3) == []  # 4 never occurred before
    assert _ngram_proposals([5, 5, 5], 4) == [5]  # what follows the match, as far as the text goes


@pytest.mark.parametrize("change, message", [
    (lambda t, d: (t, tiny_model(0, n_layers=1, vocab_size=97), 4), "vocabulary has 97 tokens and the model's 96"),
    (lambda t, d: (d, t, 4), "is not smaller than the model"),
    (lambda t, d: (t, t, 4), "is not smaller than the model"),
    (lambda t, d: (t, d, 0), r"lookahead must be an integer in \[1, 32\]"),
    (lambda t, d: (t, d, 33), r"lookahead must be an integer in \[1, 32\]"),
    (lambda t, d: (t, "bigram", 4), "draft must be a Transformer or 'ngram'"),
    (lambda t, d: (t, tiny_model(0, n_layers=1, max_seq_len=8), 4), "the draft's context: 14 positions exceeds"),
])
def test_a_draft_that_cannot_serve_is_refused_in_one_line_before_any_step(change, message):
    target, drafts = target_and_drafts(kernels=False)
    model, draft, lookahead = change(target, drafts["cut"])
    with pytest.raises(ValueError, match=message):
        generate_stream(model, [[1, 2, 3, 4]], 10, draft=draft, lookahead=lookahead)


# --- generate.py --draft ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A target, its perfect draft, a draft of another tokenizer and one of another vocabulary
    size, saved as runs save them; a copy of the target whose weights file is torn."""
    from llama_mini import save_checkpoint
    from llama_mini.tokenizers.spm import train_sentencepiece

    root = tmp_path_factory.mktemp("drafts")
    text = "Tom had a red ball. He gave it to Sue, and she was glad. 'Thank you,' said Sue. " * 40
    tokenizer = train_sentencepiece(text.split(". "), vocab_size=300, model_path=root / "tok.model")
    other = train_sentencepiece(text.upper().split(". "), vocab_size=300, model_path=root / "other.model")
    target, drafts = target_and_drafts(kernels=False, vocab_size=tokenizer.n_words)
    paths = {"target": save_checkpoint(target, root / "target", tokenizer_path=tokenizer.model_path),
             "draft": save_checkpoint(drafts["perfect"], root / "draft", tokenizer_path=tokenizer.model_path),
             "other_tokenizer": save_checkpoint(drafts["cut"], root / "other_tokenizer", tokenizer_path=other.model_path),
             "other_vocabulary": save_checkpoint(tiny_model(0, n_layers=1, vocab_size=tokenizer.n_words + 8), root / "other_vocabulary")}
    torn = root / "torn"
    torn.mkdir()
    for name in ("config.json", "tokenizer.model"):
        (torn / name).write_bytes((paths["target"] / name).read_bytes())
    (torn / "model.safetensors").write_bytes((paths["target"] / "model.safetensors").read_bytes()[:100])
    paths["torn"] = torn
    return paths


def test_generate_py_with_a_draft_prints_the_same_text_and_the_acceptance(checkpoints):
    from generate_cli_helpers import run

    common = ["--ckpt", checkpoints["target"], "--prompt", "Tom had", "--max-new-tokens", 40, "--temperature", 0]
    plain = run(*common)
    assert plain.returncode == 0, plain.stderr
    assert "\nprompt " in plain.stderr and " tokens/s after the first" in plain.stderr
    assert "draft:" not in plain.stderr
    for draft in (checkpoints["draft"], "ngram"):
        result = run(*common, "--draft", draft, "--lookahead", 5)
        assert result.returncode == 0, result.stderr
        assert result.stdout == plain.stdout
        assert " proposed tokens accepted (" in result.stderr
        if draft != "ngram":
            accepted, proposed = re.search(r"draft: (\d+) of (\d+) proposed", result.stderr).groups()
            assert accepted == proposed != "0"  # the perfect draft


def test_generate_py_chat_with_a_draft_answers_as_without_it(checkpoints):
    from generate_cli_helpers import run

    common = ["--ckpt", checkpoints["target"], "--chat", "--max-new-tokens", 12, "--temperature", 0]
    plain = run(*common, stdin="Hello\nTom had\n")
    drafted = run(*common, "--draft", checkpoints["draft"], stdin="Hello\nTom had\n")
    assert plain.returncode == drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout and drafted.stderr.count("proposed tokens accepted") == 2


@pytest.mark.parametrize("draft, flags, words", [
    ("missing", [], ["--draft", "checkpoint not found"]),
    ("other_tokenizer", [], ["--draft", "tokenizer", "is not the model's"]),
    ("other_vocabulary", [], ["--draft", "vocabulary has 308 tokens and the model's 300"]),
    ("torn", [], ["--draft", "not fewer than the model's"]),  # a draft as large as the model (the model itself)
    ("draft", ["--lookahead", 0], ["--lookahead must be in [1, 32]"]),
    ("draft", ["--lookahead", 33], ["--lookahead must be in [1, 32]"]),
])
def test_a_bad_draft_is_one_line_before_any_weight_is_read(checkpoints, draft, flags, words, capsys):
    """The model's weights file is torn: had it been read first, its error would show instead."""
    from generate_cli_helpers import assert_clean_error, run_in_process

    path = checkpoints.get(draft, checkpoints["target"].parent / draft)
    result = run_in_process("--ckpt", checkpoints["torn"], "--prompt", "Tom", "--draft", path, *flags, capsys=capsys)
    assert_clean_error(result, *words)
    assert "truncated or corrupt" not in result.stderr


@pytest.mark.slow  # the benchmark in a child process
def test_the_speculative_bench_runs_and_finds_plain_decodings_tokens():
    """bench/speculative_speed.py at its smallest setting: it exits with an error where any
    configuration's tokens differ from plain decoding's (no figures are checked)."""
    import subprocess
    import sys

    from generate_cli_helpers import ROOT

    result = subprocess.run([sys.executable, str(ROOT / "bench" / "speculative_speed.py"), "--quick", "--threads", "1"],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "| plain |" in result.stdout and "| K=2" in result.stdout and "| K=4" in result.stdout
