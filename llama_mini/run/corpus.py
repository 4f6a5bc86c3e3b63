"""The embedded default corpus: simple English stories, generated deterministically.

Training needs text, and downloading some is not allowed, so the package writes its own,
in the spirit of TinyStories: short stories with named characters who keep their names
and pronouns, places, dialogue with varied speech tags, and plots built from cause and
effect (the kite sticks in a tree *because* the wind blew; the friend helps, *so* ...).
A small model learns the grammar within minutes and then the habit of reusing a name it
has seen earlier in the story, which is the first sign of in-context learning.

Every story draws its choices from one random.Random seeded by (seed, story index), so the
corpus is identical on every machine and Python version. `python -m llama_mini.run.corpus
FILE` writes it to a file to read or to edit.

The words and the story templates are data, in stories.json beside this file; this module
casts the characters and plays the steps. A story is the "beginning" steps, one of the
"plots", then the "ending" steps. Templates name slots like {hero}, {his}, {friend}, {fhe}
(the friend's pronoun) or {adult}, {ahe}; the steps are
  {"say": [TEMPLATE, ...]}              one sentence, chosen among the templates
  {"quote": SPEAKER, "lines": [...]}    a line of dialogue, "Words," said Name; the speech
                                        tag is "tag" if given, else chosen to fit the line's
                                        last character (speech_tags)
  {"pick": [ROW, ...], "as": SLOTS}     one row of a small table, into the named slots
  {"lesson": TEMPLATE}                  the {lesson} slot the ending tells (no choice)
  "paragraph"                           a new paragraph (no choice)
  "toy"                                 a toy and its mishap: {obj} {obj_adj} {what} {fix}
  "newcomer"                            a new child {new}, with pronouns {nhe} {nhis}...
The choices are drawn in this order, so adding a template or a step changes every story
after it, and with it the corpus digest pinned in tests/run/test_corpus.py.
"""

import argparse
import json
import os
import random
import sys
from pathlib import Path

from ..support.cli import run_main
from ..support.files import atomic_write

STORIES_JSON = Path(__file__).with_name("stories.json")
STORY_DATA = json.loads(STORIES_JSON.read_text(encoding="utf-8"))
PLOTS = list(STORY_DATA["plots"].values())
HE_SHE = ("he", "she")
CHILD_KIND = {"he": "boy", "she": "girl"}


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def pronouns(he: str, prefix: str = "") -> dict:
    """The pronoun slots of one character: {he} {him} {his} {himself} {He} {His}..., or
    {fhe} {fhim}... with prefix "f"."""
    forms = {"he": ("he", "him", "his", "himself"), "she": ("she", "her", "her", "herself")}[he]
    slots = dict(zip(("he", "him", "his", "himself"), forms))
    slots.update({k.capitalize(): v.capitalize() for k, v in slots.items()})
    return {prefix + k: v for k, v in slots.items()}


class Story:
    """One story being written: the cast in self.slots, the text in self.paragraphs."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.paragraphs: list[list[str]] = [[]]
        self.slots = self.cast()

    def cast(self) -> dict:
        """The hero (a child, or an animal with an animal friend), the friend, a grown-up, the
        place and the details every plot may name."""
        rng, words = self.rng, STORY_DATA
        animal = rng.random() < 0.35
        if animal:
            kind, home = rng.choice(words["animals"])
            name = rng.choice(words["pets"])
            he = rng.choice(HE_SHE)
        else:
            he = rng.choice(HE_SHE)
            kind = CHILD_KIND[he]
            name = rng.choice(words["children"][he])
            home = rng.choice(words["child_homes"])
        fhe = rng.choice(HE_SHE)
        friend = self.other_name(words["pets"] if animal else words["children"][fhe], name)
        fkind = rng.choice(words["animals"])[0] if animal else CHILD_KIND[fhe]
        adult, ahe = rng.choice(words["adults"])
        place = rng.choice(list(words["places"]))
        at_place, sights = words["places"][place]
        sight, sight2 = rng.sample(sights, 2)
        hobby, hobby_ing = rng.choice(words["hobbies"])
        adj, fadj, parent, food, time, weather = [
            rng.choice(words[table]) for table in ("adjectives", "adjectives", "parents", "foods", "times", "weather")
        ]
        return dict(
            hero=name, kind=kind, home=home, adj=adj, a_adj=article(adj), friend=friend, fkind=fkind, fadj=fadj,
            a_fadj=article(fadj), adult=adult, parent=parent, place=place, at_place=at_place, sight=sight,
            sight2=sight2, hobby=hobby, hobby_ing=hobby_ing, food=food, time=time, weather=weather,
            **pronouns(he), **pronouns(fhe, "f"), **pronouns(ahe, "a"),
        )

    def pick(self, options):
        return self.rng.choice(options)

    def fill(self, template: str) -> str:
        return template.format_map(self.slots)

    def other_name(self, names: list[str], *taken: str) -> str:
        """A name from names that nobody in the story has yet."""
        return self.pick([n for n in names if n not in taken])

    def say(self, templates: list[str]) -> None:
        text = self.fill(self.pick(templates))
        self.paragraphs[-1].append(text[0].upper() + text[1:])

    def quote(self, speaker: str, lines: list[str], tag: str | None = None) -> None:
        """A line of dialogue: "Words," said Name. The speech tag fits the punctuation."""
        line = self.fill(self.pick(lines))
        tag = tag or self.pick(STORY_DATA["speech_tags"][line[-1]])
        if line.endswith("."):
            line = line[:-1] + ","
        self.paragraphs[-1].append(f'"{line}" {tag} {self.fill(speaker)}.')

    def pick_into(self, rows: list, names: str | list[str]) -> None:
        """One row of a table into the named slots, each filled in as it is set."""
        row = self.pick(rows)
        if isinstance(names, str):
            names, row = [names], [row]
        for name, value in zip(names, row, strict=True):
            self.slots[name] = self.fill(value)

    def toy(self) -> None:
        """A toy, one of the mishaps its kind allows, and how the friend gets it back."""
        name, adjectives, mishaps = self.pick(STORY_DATA["objects"])
        what, fix = self.pick(STORY_DATA["mishaps"][self.pick(mishaps)])
        self.slots.update(obj=name, obj_adj=self.pick(adjectives), what=what, fix=fix)

    def newcomer(self) -> None:
        """A child new to the story, named unlike the hero and the friend."""
        he = self.pick(HE_SHE)
        new = self.other_name(STORY_DATA["children"][he], self.slots["hero"], self.slots["friend"])
        self.slots.update(new=new, **pronouns(he, "n"))

    def paragraph(self) -> None:
        if self.paragraphs[-1]:
            self.paragraphs.append([])

    def play(self, steps: list) -> None:
        """Write the steps in order (their kinds are listed in the module docstring)."""
        for given in steps:
            step = {given: None} if isinstance(given, str) else given  # "toy" is {"toy": None}
            if "say" in step:
                self.say(step["say"])
            elif "quote" in step:
                self.quote(step["quote"], step["lines"], step.get("tag"))
            elif "pick" in step:
                self.pick_into(step["pick"], step["as"])
            elif "lesson" in step:
                self.slots["lesson"] = self.fill(step["lesson"])
            elif "paragraph" in step:
                self.paragraph()
            elif "toy" in step:
                self.toy()
            elif "newcomer" in step:
                self.newcomer()
            else:
                raise ValueError(f"{STORIES_JSON}: unknown step {given!r}; the step kinds are listed in {__file__}")

    def text(self) -> str:
        return "\n".join(" ".join(p) for p in self.paragraphs if p)


def story(seed: int, index: int) -> str:
    """Story number index of the corpus with this seed: the same text on every machine."""
    st = Story(random.Random(f"{seed}:{index}"))
    st.play(STORY_DATA["beginning"])
    st.play(st.pick(PLOTS))
    st.play(STORY_DATA["ending"])
    return st.text()


def stories(n_chars: int = 2_200_000, seed: int = 0) -> list[str]:
    """Stories until their total length reaches n_chars (2.2 MB by default)."""
    out, total = [], 0
    while total < n_chars:
        out.append(story(seed, len(out)))
        total += len(out[-1]) + 2
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m llama_mini.run.corpus",
                                description="Write the built-in stories (2.2 MB of UTF-8 text) to a file.")
    p.add_argument("out", nargs="?", help="the file to write: a new file, or a regular file to replace")
    out = p.parse_args(argv).out
    if out is None:
        raise ValueError("pass one argument, the file to write: python -m llama_mini.run.corpus OUT.txt")
    if out.endswith(("/", os.sep)) and not Path(out).is_dir():  # a folder named, not a file (an existing folder: below)
        raise ValueError(f"{out} is a folder; name the file to write, such as {Path(out) / 'stories.txt'}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: tmp.write_text("\n\n".join(stories()) + "\n", encoding="utf-8"))


if __name__ == "__main__":
    sys.exit(run_main(main))
