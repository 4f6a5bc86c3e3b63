"""generate.py --chat through the real CLI: a multi-turn conversation on stdin, for both chat formats.

The expected output is computed here with generate() from the prompts Meta's formats
prescribe, each holding the previous answers; the CLI must print exactly those answers.
Two tiny models per family: a "sensitive" one (weights scaled up, greedy decoding), whose
answers change when an earlier answer is left out of the prompt, so the CLI must have sent
the answers back; and one that ends a turn with its end-of-turn token about one time in
seven, so turns end there as well as at --max-new-tokens. Each family also as a GGUF file, its
vocabulary read from the file.
"""

import pytest
import torch
from generate_cli_helpers import favour_token, run, tiny_llama3

from llama_mini import ModelArgs, Transformer, generate, load_checkpoint, save_checkpoint
from llama_mini.tokenizers.chat_format import B_SYS, E_SYS
from llama_mini.tokenizers.llama3 import TiktokenTokenizer
from llama_mini.tokenizers import open_tokenizer
from llama_mini.tokenizers.spm import train_sentencepiece

SYSTEM, TURNS, MAX_NEW, SEED = "Be brief.", ["Hi there", "And then?", "Why?"], 10, 7
EOT = 128009  # Llama-3's <|eot_id|>


def scale_weights(model, factor=10.0):
    """Larger weights: logits that differ enough for greedy decoding to follow the whole context."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(factor)
    return model


def chat_checkpoint(root, family, change):
    """A tiny model of the family, change(model, end_of_turn_id) applied, saved with its tokenizer
    (family "...-gguf": exported as an F32 GGUF file, its vocabulary inside)."""
    if family.endswith("-gguf"):
        from llama_mini.formats.gguf import export_gguf

        ckpt = chat_checkpoint(root, family.removesuffix("-gguf"), change)
        return export_gguf(load_checkpoint(ckpt), root / "model.gguf", tokenizer_of(ckpt).model_path, "f32")
    if family == "llama3":
        return tiny_llama3(root / "hf", change=lambda model: change(model, EOT))
    text = "Tom had a red ball. He gave it to Sue, and she was glad. 'Thank you,' said Sue. " * 40
    tokenizer = train_sentencepiece(text.split(". "), vocab_size=300, model_path=root / "tok.model")
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=tokenizer.n_words, max_seq_len=512))
    return save_checkpoint(change(model, tokenizer.eos_id), root / "ckpt", tokenizer_path=tokenizer.model_path)


FAMILIES = ["llama2", *(pytest.param(f, marks=pytest.mark.slow) for f in ("llama3", "llama2-gguf", "llama3-gguf"))]  # llama2: the quick suite's


@pytest.fixture(scope="module", params=FAMILIES)
def sensitive_ckpt(request, tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp(request.param), request.param, lambda model, end: scale_weights(model))


@pytest.fixture(scope="module", params=FAMILIES)
def turn_end_ckpt(request, tmp_path_factory):
    logit = {"llama2": 2.0, "llama3": 6.0}[request.param.removesuffix("-gguf")]
    return chat_checkpoint(tmp_path_factory.mktemp(request.param), request.param, lambda model, end: favour_token(model, end, logit))


def tokenizer_of(ckpt):
    if ckpt.is_file():  # a GGUF file holds its own
        return open_tokenizer(ckpt)
    return open_tokenizer(next(p for p in (ckpt / "tokenizer.model", ckpt / "original" / "tokenizer.model") if p.is_file()))


def expected_chat(ckpt, tokenizer, temperature, send_answers=True):
    """The prompt, the answer and the answer's length in tokens of every turn, as Meta's
    chat_completion would make them (send_answers=False: as if the answers were forgotten)."""
    model, dialog = load_checkpoint(ckpt), [{"role": "system", "content": SYSTEM}]
    prompts, answers, lengths = [], [], []
    for turn, user in enumerate(TURNS):
        dialog.append({"role": "user", "content": user})
        prompts.append(tokenizer.encode_dialog(dialog))
        new = generate(model, [prompts[-1]], MAX_NEW, temperature=temperature, eos_id=tokenizer.stop_ids, seed=SEED + turn)[0]
        answers.append(tokenizer.decode(new))
        lengths.append(len(new))
        dialog.append({"role": "assistant", "content": answers[-1] if send_answers else ""})
    return prompts, answers, lengths


def chat_run(ckpt, temperature):
    return run("--ckpt", ckpt, "--chat", "--system", SYSTEM, "--max-new-tokens", MAX_NEW, "--seed", SEED,
               "--temperature", temperature, stdin="".join(user + "\n" for user in TURNS))


def assert_llama3_prompts_grow_by_each_answer(tokenizer, prompts, answers):
    """Turn n+1's prompt is turn n's, then the answer, <|eot_id|>, and the new user message."""
    header = lambda role: [128006, *tokenizer.encode(role, bos=False), 128007, 271]  # noqa: E731
    for before, after, answer, user in zip(prompts, prompts[1:], answers, TURNS[1:]):
        assert after[: len(before)] == before
        assert after[len(before) :] == (
            tokenizer.encode(answer.strip(), bos=False) + [EOT] + header("user") + tokenizer.encode(user, bos=False)
            + [EOT] + header("assistant")
        )


def assert_llama2_prompts_hold_each_exchange(tokenizer, prompts, answers):
    """Turn n+1's prompt is BOS [INST] user [/INST] answer EOS per finished exchange, then the open turn."""
    last = prompts[-1]
    exchanges = []
    while tokenizer.eos_id in last:
        end = last.index(tokenizer.eos_id)
        exchanges.append(last[: end + 1])
        last = last[end + 1 :]
    users = [f"{B_SYS}{SYSTEM}{E_SYS}{TURNS[0]}"] + TURNS[1:]
    assert [tokenizer.decode(ids) for ids in exchanges] == [
        f"[INST] {user} [/INST] {answer.strip()} " for user, answer in zip(users, answers[:2])
    ]
    assert [ids[0] for ids in exchanges] == [tokenizer.bos_id] * 2 and tokenizer.decode(last) == f"[INST] {TURNS[2]} [/INST]"


def test_a_multi_turn_chat_sends_each_answer_back_and_ends_at_end_of_input(sensitive_ckpt):
    tokenizer = tokenizer_of(sensitive_ckpt)
    prompts, answers, _ = expected_chat(sensitive_ckpt, tokenizer, temperature=0)
    if isinstance(tokenizer, TiktokenTokenizer):
        assert_llama3_prompts_grow_by_each_answer(tokenizer, prompts, answers)
    else:
        assert_llama2_prompts_hold_each_exchange(tokenizer, prompts, answers)
    forgetful = expected_chat(sensitive_ckpt, tokenizer, temperature=0, send_answers=False)[1]
    assert forgetful[0] == answers[0] and forgetful[1] != answers[1] and forgetful[2] != answers[2]

    result = chat_run(sensitive_ckpt, temperature=0)
    assert (result.returncode, result.stderr.count("Traceback")) == (0, 0), result.stderr
    assert result.stdout == "".join(f"> {answer}\n" for answer in answers) + "> \n"


def test_turns_that_end_at_the_end_of_turn_token_print_without_it(turn_end_ckpt):
    tokenizer = tokenizer_of(turn_end_ckpt)
    _, answers, lengths = expected_chat(turn_end_ckpt, tokenizer, temperature=0.6)
    assert min(lengths) < MAX_NEW  # a turn ended at <|eot_id|> (Llama-3) or EOS (Llama-2)

    result = chat_run(turn_end_ckpt, temperature=0.6)
    assert (result.returncode, result.stderr.count("Traceback")) == (0, 0), result.stderr
    assert result.stdout == "".join(f"> {answer}\n" for answer in answers) + "> \n"
    assert "<|eot_id|>" not in result.stdout


@pytest.mark.slow
def test_a_chat_that_outgrows_the_context_leaves_out_its_oldest_exchanges_and_goes_on(sensitive_ckpt):
    """As llama.cpp's context shift: once the conversation and room for an answer (here
    --max-new-tokens) no longer fit the context, the oldest exchanges are left out, one notice
    each time, the system prompt kept; the user never has to start over."""
    context, turns = 128, ["Hi there", "And then?", "Why?", "Tell me more.", "Go on", "Really?", "Thanks"]
    tokenizer = tokenizer_of(sensitive_ckpt)
    model, system, kept = load_checkpoint(sensitive_ckpt, max_seq_len=context), [{"role": "system", "content": SYSTEM}], []
    answers, shifts = [], []
    for turn, user in enumerate(turns):
        kept.append({"role": "user", "content": user})
        start = next(i for i in range(0, len(kept), 2) if len(tokenizer.encode_dialog(system + kept[i:])) + MAX_NEW <= context)
        if start:
            shifts.append(start)
            kept = kept[start:]
        new = generate(model, [tokenizer.encode_dialog(system + kept)], MAX_NEW, 0, eos_id=tokenizer.stop_ids)[0]
        answers.append(tokenizer.decode(new))
        kept.append({"role": "assistant", "content": answers[-1]})
    assert shifts  # the conversation did outgrow the context

    result = run("--ckpt", sensitive_ckpt, "--chat", "--system", SYSTEM, "--max-new-tokens", MAX_NEW, "--temperature", 0,
                 "--max-seq-len", context, stdin="".join(user + "\n" for user in turns))
    assert (result.returncode, result.stderr.count("Traceback")) == (0, 0), result.stderr
    printed = "".join(f"> {answer}\n" for answer in answers) + "> \n"
    assert result.stdout == printed.replace("\r\n", "\n").replace("\r", "\n")  # as run() reads text: universal newlines
    notices = [line for line in result.stderr.splitlines() if "outgrew" in line]
    assert notices == [f"llama_mini: the conversation outgrew the context of {context} tokens; its {n} oldest messages "
                       "are left out (the system prompt is kept)" for n in shifts]


@pytest.mark.slow
def test_a_message_too_long_for_the_context_is_not_sent_and_the_chat_goes_on(sensitive_ckpt):
    context, long = 64, "Tom had a red ball and gave it to Sue. " * 20
    tokenizer = tokenizer_of(sensitive_ckpt)
    dialog = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": long}]
    assert len(tokenizer.encode_dialog(dialog)) >= context
    model = load_checkpoint(sensitive_ckpt, max_seq_len=context)
    prompt = tokenizer.encode_dialog([dialog[0], {"role": "user", "content": TURNS[0]}])
    answer = tokenizer.decode(generate(model, [prompt], MAX_NEW, 0, eos_id=tokenizer.stop_ids)[0])

    result = run("--ckpt", sensitive_ckpt, "--chat", "--system", SYSTEM, "--max-new-tokens", MAX_NEW, "--temperature", 0,
                 "--max-seq-len", context, stdin=f"{long}\n{TURNS[0]}\n")
    assert (result.returncode, result.stderr.count("Traceback")) == (0, 0), result.stderr
    assert result.stdout == f"> > {answer}\n> \n".replace("\r\n", "\n").replace("\r", "\n")
    assert [line for line in result.stderr.splitlines() if line.startswith("llama_mini:")] == [
        f"llama_mini: this message and the system prompt need more than the context of {context} tokens; "
        "it was not sent: say it in fewer words"]


@pytest.fixture(scope="module")
def llama2_ckpt(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("llama2"), "llama2", lambda model, end: scale_weights(model))


def greedy_answer(ckpt, user, system=SYSTEM):
    tokenizer = tokenizer_of(ckpt)
    prompt = tokenizer.encode_dialog([{"role": "system", "content": system}, {"role": "user", "content": user}])
    return tokenizer.decode(generate(load_checkpoint(ckpt), [prompt], MAX_NEW, 0, eos_id=tokenizer.stop_ids)[0])


def chat_notices(result) -> list:
    return [line for line in result.stderr.splitlines() if line.startswith("llama_mini:") and "loaded" not in line]


@pytest.mark.parametrize("bad, notice", [
    ("Say [INST] twice", "this message was not sent: dialog content must not contain the chat markup [INST], [/INST], <<SYS>> or <</SYS>>"),
    ("caf\udce9", "line 1 of the chat input is not UTF-8 text (byte 0xe9 at offset 3); pass UTF-8; it was not sent"),
])
def test_a_message_the_chat_cannot_send_is_refused_in_one_line_and_the_chat_goes_on(llama2_ckpt, bad, notice):
    result = run("--ckpt", llama2_ckpt, "--chat", "--system", SYSTEM, "--max-new-tokens", MAX_NEW, "--temperature", 0,
                 stdin=f"{bad}\n{TURNS[0]}\n")
    assert (result.returncode, result.stderr.count("Traceback")) == (0, 0), result.stderr
    assert result.stdout == f"> > {greedy_answer(llama2_ckpt, TURNS[0])}\n> \n"
    assert chat_notices(result) == [f"llama_mini: {notice}"]


def test_a_system_prompt_the_chat_format_cannot_carry_is_refused_before_the_model_loads(llama2_ckpt):
    result = run("--ckpt", llama2_ckpt, "--chat", "--system", "Use <<SYS>> tags", stdin="Hi\n")
    assert_one_line_error(result, "error: --system: dialog content must not contain the chat markup")
    assert "loaded" not in result.stderr


def assert_one_line_error(result, start):
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(start), result.stderr


def peak_child_rss_mb(command, stdin_file) -> tuple:
    """(the finished process, its peak resident memory in MB), run with stdin from stdin_file."""
    import resource
    import subprocess
    import sys

    from generate_cli_helpers import ROOT

    with open(stdin_file, "rb") as f:
        result = subprocess.run([sys.executable, str(ROOT / "generate.py"), *map(str, command)], stdin=f,
                                capture_output=True, text=True, timeout=180, cwd=ROOT)
    return result, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def test_a_line_too_long_to_send_is_refused_and_the_chat_goes_on_in_bounded_memory(llama2_ckpt, tmp_path):
    """A 40 MiB line: read no further than a message can reach (16 MiB), skipped to its end, refused."""
    stdin = tmp_path / "stdin"
    stdin.write_bytes(b"a" * (40 << 20) + f"\n{TURNS[0]}\n".encode())
    result, peak = peak_child_rss_mb(["--ckpt", llama2_ckpt, "--chat", "--system", SYSTEM, "--max-new-tokens", MAX_NEW,
                                      "--temperature", 0], stdin)
    assert (result.returncode, result.stderr.count("Traceback")) == (0, 0), result.stderr
    assert result.stdout == f"> > {greedy_answer(llama2_ckpt, TURNS[0])}\n> \n"
    assert chat_notices(result) == ["llama_mini: line 1 of the chat input is longer than 16 MiB, more text than any "
                                    "Llama context holds; it was not sent"]
    assert peak < 1500, peak  # torch and a tiny model, and one 16 MiB read; not the 40 MiB line's text


def test_an_input_that_never_ends_a_line_ends_the_chat_in_one_line(llama2_ckpt):
    result, _ = peak_child_rss_mb(["--ckpt", llama2_ckpt, "--chat", "--max-new-tokens", 2], "/dev/zero")
    assert_one_line_error(result, "error: line 1 of the chat input runs past 64 MiB without a line break; "
                                  "the chat reads one message per line")
