"""bench/generate_speed.py runs end to end at its smallest setting (no figures are checked)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # the benchmark in a child process, transformers included
def test_quick_run_prints_every_llama_mini_variant_and_transformers():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "generate_speed.py"), "--quick", "--threads", "1"],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    for name in ("llama_mini fp32", "llama_mini bf16", "llama_mini int8", "llama_mini int4",
                 "transformers fp32", "transformers bf16", "prefill 64 tok/s", "first token 64", "logits error",
                 "llama_mini bf16 / transformers bf16: decode"):
        assert name in result.stdout, name
    # greedy decoding of the same fp32 weights gives the same tokens in both implementations
    assert any(line.split()[:2] == ["transformers", "fp32"] and line.endswith("8/8") for line in result.stdout.splitlines())
