"""The README tells the truth about the code: its length, the line counts and sizes it gives,
the files it names, the tests it cites, and every command it shows (each parsed by the
program's own parser; the cheap ones run)."""

import ast
import importlib
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
GUARANTEES = (ROOT / "docs" / "guarantees.md").read_text()
GUIDES = ["training.md", "generate.md", "formats.md", "kernels.md", "performance.md", "guarantees.md", "dependencies.md"]
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}


def section(text, heading):
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def blocks(text, lang):
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.M | re.S)


def test_the_readme_is_at_most_250_lines():
    assert len(README.splitlines()) <= 250


def test_the_package_table_gives_each_core_file_its_true_length():
    rows = re.findall(r"^\| `([\w/.]+\.py)` \((\d+) lines\) \|", section(README, "Read the code"), flags=re.M)
    assert [name for name, _ in rows] == ["llama_mini/model.py", "llama_mini/generation.py", "llama_mini/trainer.py", "train.py"]
    for name, lines in rows:
        assert len((ROOT / name).read_text().splitlines()) == int(lines), name
        assert f"`{name}`, {lines} lines" in README or f"`{name}` ({lines}" in README, f"the first paragraph's size of {name}"


def test_the_default_run_is_the_one_the_readme_describes():
    from llama_mini.run.config import TrainConfig

    text = " ".join(section(README, "Train").split())
    said = re.search(r"trains a (\d+)-token BPE tokenizer on them, and trains a ([\d.]+)M-parameter Llama \(dim (\d+), "
                     r"(\d+) layers, (\d+) heads, context (\d+)\) for (\d+) steps of (\d+) x (\d+) tokens .* evaluates every "
                     r"(\d+) steps, saves a checkpoint every (\d+)", text)
    assert said, "the Train section's sentence about the default run"
    vocab, params, dim, layers, heads, context, steps, batch, tokens, every_eval, every_save = said.groups()
    cfg = TrainConfig()
    assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.seq_len, cfg.max_steps, cfg.batch_size, cfg.seq_len,
            cfg.eval_every, cfg.save_every) == tuple(int(n) for n in (vocab, dim, layers, heads, context, steps, batch, tokens,
                                                                     every_eval, every_save))
    assert round(parameters(cfg) / 1e6, 1) == float(params)


def parameters(cfg):
    import torch

    from llama_mini.model import Transformer
    with torch.device("meta"):
        model = Transformer(cfg.model_args(cfg.vocab_size))
    return sum(p.numel() for p in model.parameters())


def test_the_tiny_shakespeare_model_has_the_size_the_readme_gives():
    import argparse

    from llama_mini.run.config import TrainConfig, add_arguments

    line = next(line for line, words in commands(section(README, "Train")) if "--vocab-size" in words)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = TrainConfig(**vars(parser.parse_args(shlex.split(line)[2:])))
    said = re.search(r"the ([\d.]+)M-parameter model", " ".join(section(README, "Train").split()))
    assert said, "the size of the tiny Shakespeare model"
    assert round(parameters(cfg) / 1e6, 2) == float(said[1])


def cited_tests(text):
    cited = re.findall(r"`(?:tests/)?((?:\w+/)?test_\w+\.py)(?:::(\w+))?`", text)
    cited += [(file, name) for file, names in re.findall(r"`(?:tests/)?((?:\w+/)?test_\w+\.py)::\w+`((?:, `\w+`)+)", text)
              for name in re.findall(r"`(\w+)`", names)]
    return cited


@pytest.mark.parametrize("doc", ["README.md"] + [f"docs/{name}" for name in GUIDES])
def test_every_test_the_readme_cites_exists(doc):
    for file, name in cited_tests((ROOT / doc).read_text()):
        path = ROOT / "tests" / file
        assert path.is_file(), f"{doc} cites {file}, which is not in tests/"
        if name:
            defined = {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}
            assert name in defined, f"{doc} cites {file}::{name}, which {file} does not define"


def test_every_promise_in_the_guarantees_cites_a_test():
    rows = [re.split(r" \| ", line.strip("| ")) for line in GUARANTEES.splitlines() if line.startswith("| ")][1:]  # past the header
    assert len(rows) > 30
    for promise, shown_by, *_ in rows:
        assert cited_tests(shown_by), f"docs/guarantees.md promises {promise[:60]!r}... without citing a test"
    assert len(cited_tests(GUARANTEES)) > 60
    assert cited_tests(README), "the README cites the tests behind its own promises"


def test_ci_runs_the_whole_suite_and_the_quick_one_leaves_out_only_the_slow_tests():
    first = re.search(r"^pip install -r requirements-dev\.txt .*$", README, flags=re.M)[0]  # the line .ci/run runs
    assert first == "pip install -r requirements-dev.txt && python -m pytest -q", first
    assert any("\npython -m pytest -q -m \"not slow\"\n" in "\n" + block for block in blocks(README, "sh"))


def test_the_first_command_installs_and_trains_and_the_cpu_wheel_tip_comes_before_it():
    first = blocks(README, "sh")[0].splitlines()[0]
    assert first == "pip install -r requirements.txt && python train.py"  # .ci/first-run runs this line
    assert re.search(r"^pip install -r requirements\.txt.*$", README, flags=re.M)[0] == first
    tip = README.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    assert tip < README.index("```sh\n" + first)


def requirements(name):
    lines = (line.split("#")[0].strip() for line in (ROOT / name).read_text().splitlines())
    return {re.split(r"[<>=!~ ]", line)[0] for line in lines if line and not line.startswith("-r")}


def test_the_install_section_names_the_packages_the_requirements_hold():
    text = " ".join(section(README, "Install").split())
    said = re.search(r"The packages are (.*?); `requirements-dev\.txt` adds (.*?) \(", text)
    assert said, "the Install section's sentence naming the packages"
    runtime, dev = ({re.sub(r" \(.*?\)", "", name) for name in re.split(r", | and ", part)} for part in said.groups())
    assert runtime == requirements("requirements.txt")
    assert dev == requirements("requirements-dev.txt")


def step_files(text):
    """(number word, training step's files, decoding step's files) of the sentence saying which
    files a step runs Python code in."""
    said = re.search(r"a training step.*?runs Python code\s+in (\w+) files(.*?); a decoding step in (.*?) where "
                     r"`use_cpu_kernels` is applied", text, flags=re.S)
    assert said, "the sentence naming the files a training step and a decoding step run"
    named = [{f"llama_mini/{name}" for name in re.findall(r"`([\w/]+\.py)`", part)} for part in said.groups()[1:]]
    return said[1], *named


def files_asserted(test_source, prefix):
    """The package files named in the test of tests/test_package.py whose name begins with prefix."""
    tree = ast.parse(test_source)
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith(prefix))
    return {node.value for node in ast.walk(function) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and re.fullmatch(r"llama_mini/[\w/]+\.py", node.value)}


@pytest.mark.parametrize("doc", ["README.md", "docs/guarantees.md"])
def test_the_files_a_step_runs_are_the_ones_tests_test_package_asserts(doc):
    count, training, decoding = step_files((ROOT / doc).read_text())
    package_tests = (ROOT / "tests" / "test_package.py").read_text()
    assert NUMBERS[count] == len(training), f"{doc} says {count} files and names {len(training)}"
    assert training == files_asserted(package_tests, "test_a_training_step_runs")
    assert decoding == files_asserted(package_tests, "test_a_decoding_step_runs")


def test_the_package_table_names_files_that_exist_and_every_part_of_the_package():
    table = section(README, "Read the code").split("| where | what it holds |", 1)[1]
    rows = re.findall(r"^\| (.*?) \| (.*?) \|$", table, flags=re.M)
    for where, what in rows:
        places = re.findall(r"`([\w/.]+)`", where)
        base = places[0] if places[0].endswith("/") else str(Path(places[0]).parent) + "/"
        for name in places + re.findall(r"`([\w/.]+\.py)`", what) + re.findall(r"`(csrc/)`", what):
            path = ROOT / name if "/" in name.rstrip("/") or name in places[:1] else ROOT / base / name
            path = path if path.exists() or "/" in name.rstrip("/") else ROOT / name  # a bare name: the row's folder, else the root
            assert path.exists(), f"the package table's row {places[0]} names {name}, which is neither in {base} nor at the root"
    named = " ".join(f"{where} {what}" for where, what in rows)
    for part in sorted(ROOT.glob("llama_mini/*/__init__.py")):
        assert f"`llama_mini/{part.parent.name}/`" in named, f"llama_mini/{part.parent.name}/ has no row"
    for module in sorted([*ROOT.glob("llama_mini/*.py"), *ROOT.glob("*.py")]):
        if module.name != "__init__.py":
            assert f"{module.name}`" in named, f"{module.relative_to(ROOT)} has no row"
    assert README.count("| where | what it holds |") == 1, "one table of the package"


def anchors(text):
    """The anchors GitHub gives the headings of text (code blocks left out: a `# comment` is no heading)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", ["README.md", "docs/README.md"] + [f"docs/{name}" for name in GUIDES])
def test_every_link_leads_to_a_file_and_heading_that_exist(doc):
    path = ROOT / doc
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{doc} links {target}, which does not exist"
        if anchor:
            assert anchor in anchors(linked.read_text()), f"{doc} links {target}: {linked.name} has no such heading"


def test_every_guide_in_docs_is_linked_from_the_readme():
    for name in GUIDES:
        assert f"(docs/{name}" in README, f"the README does not link docs/{name}"


@pytest.mark.parametrize("doc", ["README.md", "docs/generate.md"])
def test_the_python_example_imports_names_the_package_exports(doc):
    for block in blocks((ROOT / doc).read_text(), "python"):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{doc} imports {alias.name} from {node.module}, which has none"


# Every command line in the README's ```sh blocks (and in the guides'), checked by the program's own parser.

def commands(text):
    """Each command line of text's sh blocks: continuations joined, comments dropped, `a && b` split."""
    for block in blocks(text, "sh"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                yield line, words[:cut]
                words = words[cut + 1:]


def root_program(name):
    spec = importlib.util.spec_from_file_location(f"readme_{name}", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def last_line(capsys):
    """The last line a refused parse wrote: argparse's and run_main's `error: ...`."""
    err = capsys.readouterr().err.strip()
    return err.splitlines()[-1] if err else ""


def parse_as(program, args, monkeypatch):
    """Parse args as program does, with every check it makes of its flags, doing no work."""
    if program == "train.py":
        train = root_program("train")
        monkeypatch.setattr(train, "train", lambda cfg: None)
        return train.main(args)  # run_main's exit code: 2 for a flag its checks refuse
    if program == "generate.py":
        return root_program("generate").parse_args(args)
    if program == "llama_mini.evaluate":
        from llama_mini import evaluate
        return evaluate.parse_args(args)
    if program == "llama_mini.formats.convert":
        from llama_mini.formats import convert
        monkeypatch.setattr(convert, "convert", lambda *a: a[1])
        return convert.main(args)
    if program == "llama_mini.ablate":
        from llama_mini import ablate
        monkeypatch.setattr(ablate, "ablate", lambda *a: None)
        return ablate.ablate_from_flags(args)
    raise AssertionError(f"no parser known for {program}")


def program_of(words):
    """(program, its arguments) of a command line: pip, a root script or a module run with -m."""
    if words[0] == "torchrun":  # torchrun's own flags, then the script and its flags
        words = ["python"] + [w for w in words[1:] if not w.startswith("--nproc")]
    if words[:2] == ["pip", "install"]:
        return "pip", words[2:]
    assert words[0] == "python" and len(words) > 1, f"a command the test does not know: {' '.join(words)}"
    if words[1] == "-m":
        return words[2], words[3:]
    return words[1], words[2:]


def every_command():
    found = [pytest.param(doc, line, words, id=f"{doc}:{n}:{'_'.join(words[:3])}") for doc in ["README.md"] + [f"docs/{name}" for name in GUIDES]
             for n, (line, words) in enumerate(commands((ROOT / doc).read_text()))]
    assert len(found) > 25
    return found


@pytest.mark.parametrize("doc,line,words", every_command())
def test_every_command_in_the_readme_parses(doc, line, words, monkeypatch, capsys):
    program, args = program_of(words)
    args = [a for a in args if a != "..."]  # "..." stands for the rest of a command line
    if program == "pip":
        assert args[:1] == ["torch"] or args[0] == "-r" and (ROOT / args[1]).is_file(), f"{doc}: {line}"
        return
    if program == "pytest":
        return  # the suite itself; test_ci_runs_the_whole_suite_... checks its lines
    if "--help" in args:  # cheap and self-contained: run it
        run = subprocess.run([sys.executable, *(["-m"] if not program.endswith(".py") else []), program, *args],
                             cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
        assert run.returncode == 0, f"{doc}: {line}\n{run.stderr[-2000:]}"
        for named in re.findall(r"--[\w-]+", line.partition("#")[2]):  # the flags its comment says it lists
            assert named in run.stdout, f"{doc}: {line}: --help does not list {named}"
        return
    try:
        result = parse_as(program, args, monkeypatch)
    except SystemExit as e:
        pytest.fail(f"{doc}: `{line}` is refused by its parser (exit {e.code}): {last_line(capsys)}")
    except ValueError as e:
        pytest.fail(f"{doc}: `{line}` is refused by its parser's checks: {e}")
    if isinstance(result, int):  # run_main's exit code
        assert result == 0, f"{doc}: `{line}` is refused by its parser's checks: {last_line(capsys)}"
