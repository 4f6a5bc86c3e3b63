"""The shared fixtures (Meta's tokenizers, llama.cpp's vocabulary tests), found beside the
checkout through this one constant. A test whose fixture is absent is skipped, except under
CI (CI=true), where the absence fails it."""

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
LLAMA2_TOKENIZER = FIXTURES / "llama2-tokenizer.model"
LLAMA3_TOKENIZER = FIXTURES / "llama3-tokenizer.model"
GGUF_VOCAB = FIXTURES / "gguf-vocab"


def require(path: Path) -> Path:
    """path, a fixture: the test is skipped where it is absent, and fails under CI."""
    if not path.exists():
        message = f"fixture {path.name} is not in {path.parent}"
        if os.environ.get("CI") == "true":
            pytest.fail(message + " (under CI every fixture must be present)")
        pytest.skip(message)
    return path
