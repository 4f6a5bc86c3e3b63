"""The built-in corpus: the same bytes on every machine, from the templates in stories.json.

The digests are known answers recorded from the generator before its templates moved out of
code into llama_mini/stories.json: any change to a template, a word list or the order of the
random choices changes them, and with them every cached tokenizer and token file.
"""

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from llama_mini.run import corpus
from llama_mini.run.data import open_corpus

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS_SHA256 = "1758ac0a4add0e71744523c5950837cd397f2b94f330e8a92ec1fed053df51a2"  # 2674 stories
FIRST_200_STORIES_SHA256 = {
    0: "922bc78e5ea844572208cf3d2241ba11fcfb10e5d1c717c5fa224489d39c0132",
    1: "04851b182156323e1fcba395782d41bcae8f346e373db2c75689c7415085fdfd",
    2: "659ef6e88517d7bf4457a72f05b0eff9d92fbda050e0050c78e7f04343009413",
}
CORPUS_FILE_SHA256 = "617951f8d4ff2cfba36cdcae22ad4d74e3c7e36ef2d3397263d869845e261400"  # stories + final newline


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_default_corpus_is_the_known_text():
    texts = corpus.stories()
    assert len(texts) == 2674
    assert sha256("\n\n".join(texts)) == DEFAULT_CORPUS_SHA256


def test_training_keys_its_caches_on_the_known_digest():
    assert open_corpus().digest == DEFAULT_CORPUS_SHA256


@pytest.mark.parametrize("seed", sorted(FIRST_200_STORIES_SHA256))
def test_stories_of_each_seed_are_the_known_text(seed):
    assert sha256("\x00".join(corpus.story(seed, i) for i in range(200))) == FIRST_200_STORIES_SHA256[seed]


def test_command_writes_the_known_corpus_file_from_any_folder(tmp_path):
    out = tmp_path / "stories.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "llama_mini.run.corpus", str(out)], cwd=tmp_path, env=env, check=True, timeout=300)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == CORPUS_FILE_SHA256


def test_command_without_a_file_says_how_to_call_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "llama_mini.run.corpus"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: pass one argument, the file to write") and proc.stderr.count("\n") == 1


def test_every_template_in_stories_json_is_used_by_the_default_corpus(monkeypatch):
    templates = [
        line
        for steps in [corpus.STORY_DATA["beginning"], corpus.STORY_DATA["ending"], *corpus.PLOTS]
        for step in steps
        if isinstance(step, dict)
        for line in step.get("say", step.get("lines", []))
    ]
    used = set()
    fill = corpus.Story.fill
    monkeypatch.setattr(corpus.Story, "fill", lambda self, template: used.add(template) or fill(self, template))
    corpus.stories()
    assert len(templates) > 300  # the walk above found them all
    assert [t for t in templates if t not in used] == []


def test_an_unknown_step_is_named():
    st = corpus.Story(random.Random(0))
    with pytest.raises(ValueError, match=r"stories\.json: unknown step 'dance'"):
        st.play(["dance"])
