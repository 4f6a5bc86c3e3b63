"""The README tells the truth about the code: the line counts it gives, the tests it cites."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_read_the_code_table_gives_each_core_file_its_true_length():
    section = README.split("## Read the code", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w/.]+\.py)` \| (\d+) \|", section, flags=re.M)
    assert [name for name, _ in rows] == ["llama_mini/model.py", "llama_mini/generation.py", "llama_mini/trainer.py", "train.py"]
    for name, lines in rows:
        assert len((ROOT / name).read_text().splitlines()) == int(lines), name
        assert f"`{name}`, {lines} lines" in README or f"`{name}` ({lines}" in README, f"the first paragraph's size of {name}"


def test_every_test_the_readme_cites_exists():
    cited = re.findall(r"`(?:tests/)?((?:\w+/)?test_\w+\.py)(?:::(\w+))?`", README)
    cited += [(file, name) for file, names in re.findall(r"`(?:tests/)?((?:\w+/)?test_\w+\.py)::\w+`((?:, `\w+`)+)", README)
              for name in re.findall(r"`(\w+)`", names)]
    assert len(cited) > 20
    for file, name in cited:
        path = ROOT / "tests" / file
        assert path.is_file(), f"README cites {file}, which is not in tests/"
        if name:
            defined = {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}
            assert name in defined, f"README cites {file}::{name}, which {file} does not define"


def test_ci_runs_the_whole_suite_and_the_quick_one_leaves_out_only_the_slow_tests():
    first = re.search(r"^pip install -r requirements-dev\.txt .*$", README, flags=re.M)[0]  # the line .ci/run runs
    assert first.endswith("python -m pytest -q"), first
    assert '\npython -m pytest -q -m "not slow"\n' in README
