"""A trained run and its GGUF files, shared by the GGUF tests (test_gguf_cli.py, test_gguf_llama_cpp.py)."""

import pytest

from gguf_files import EVAL, ROOT, cli
from llama_mini.run import corpus


@pytest.fixture(scope="session")
def gguf_run(tmp_path_factory) -> dict:
    """A small Llama (GQA; rows of 256, so every matrix splits into K-quant blocks) trained for
    300 steps on the built-in stories, and its F32 and Q8_0 GGUF files made by convert --to gguf."""
    root = tmp_path_factory.mktemp("gguf-run")
    (root / "stories.txt").write_text("\n\n".join(corpus.stories(200_000, seed=5)), encoding="utf-8")
    data = ["--data", root / "stories.txt", "--cache-dir", root / "cache"]
    cli(ROOT / "train.py", *data, *EVAL, "--dim", 256, "--n-layers", 2, "--n-heads", 4, "--n-kv-heads", 2, "--vocab-size", 512,
        "--max-steps", 300, "--warmup-steps", 20, "--eval-every", 300, "--save-every", 300, "--out", root / "run")
    files = {}
    for type in ("f32", "q8_0"):
        files[type] = root / f"model-{type}.gguf"
        cli("-m", "llama_mini.formats.convert", root / "run", files[type], "--to", "gguf", "--type", type)
    return dict(root=root, run=root / "run", data=data, files=files)
