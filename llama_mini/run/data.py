"""Text in, token windows out.

The pipeline a training run needs, each step cached so that it happens once:
  1. open_corpus: the user's .txt file or folder (checked: exists, UTF-8, not empty), or
     the embedded stories; its sha256 is the cache key for everything below;
  2. load_tokenizer: a BPE tokenizer trained on that text, stored under the cache folder;
  3. tokenize: every document as BOS + ids + EOS, concatenated into one flat uint16 (uint32 for
     vocabularies over 65536) file, memory-mapped on later runs;
  4. TokenSplits: the first (1 - val_fraction) of the tokens train, the rest validate;
     training reads random windows of seq_len + 1 tokens (TrainBatches), evaluation fixed ones.
"""

import array
import codecs
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from ..support.files import atomic_write
from ..tokenizers import Tokenizer, open_tokenizer
from ..tokenizers.long_text import encode_long
from ..tokenizers.spm import train_sentencepiece
from . import corpus as stories

READ_BYTES = 1 << 22  # files are read (checked, hashed, scored) 4 MB at a time


@dataclass
class Corpus:
    name: str  # short label for file names and messages
    digest: str  # sha256 of the text: caches built from it are keyed on it
    documents: Callable[[], Iterator[str]]  # one string per file (or per embedded story)


def corpus_name(data=None) -> str:
    return Path(data).resolve().stem if data else "stories"


def open_corpus(data=None) -> Corpus:
    """The text named by --data, validated up front, or the embedded stories when None."""
    if data is None:
        texts = stories.stories()
        digest = hashlib.sha256("\n\n".join(texts).encode()).hexdigest()
        return Corpus(corpus_name(), digest, lambda: iter(texts))
    root = Path(data)
    files = text_files(root)
    digest = hashlib.sha256()
    has_text = False
    for path in files:  # the names are part of the key too: renaming a file reorders the data
        digest.update(str(path.relative_to(root) if root.is_dir() else path.name).encode() + b"\0")
        has_text = check_utf8(path, digest) or has_text
    if not has_text:
        raise ValueError(f"{data} holds no text (empty or whitespace only); pass a .txt file with some text in it")
    return Corpus(corpus_name(data), digest.hexdigest(), lambda: (p.read_text(encoding="utf-8") for p in files))


def text_files(path: Path) -> list[Path]:
    if not path.exists():
        raise FileNotFoundError(
            f"data not found: {path}; pass --data a .txt file or a folder of them, "
            "or leave it out for the built-in stories"
        )
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*.txt") if p.is_file())
    if not files:
        raise ValueError(f"no .txt files in {path}; put UTF-8 .txt files there or pass --data FILE.txt")
    return files


def utf8_blocks(path) -> Iterator[tuple[bytes, str]]:
    """path's bytes READ_BYTES at a time, each block with its text (a character cut by a block's
    end is the next block's); fails naming the first byte that is not UTF-8 and its offset."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            carried = len(decoder.getstate()[0])  # the start of a character cut by the previous block
            try:
                text = decoder.decode(block)
            except UnicodeDecodeError as e:
                raise not_utf8(path, e.object[e.start], offset - carried + e.start) from None
            yield block, text
            offset += len(block)
    if pending := decoder.getstate()[0]:  # the file ends inside a character
        raise not_utf8(path, pending[0], offset - len(pending))


def check_utf8(path: Path, digest) -> bool:
    """Feed path's bytes to digest; fail naming the first byte that is not UTF-8 and its
    offset. True if the file holds anything besides whitespace."""
    has_text = False
    for block, text in utf8_blocks(path):
        digest.update(block)
        has_text = has_text or bool(text.strip())
    return has_text


def not_utf8(path, byte: int, offset: int) -> ValueError:
    return ValueError(
        f"{path} is not UTF-8 text (invalid byte 0x{byte:02x} at offset {offset}); "
        "convert it, e.g. iconv -f latin1 -t utf-8, or remove it from --data"
    )


def file_digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_tokenizer(corpus: Corpus, vocab_size: int, cache_dir) -> Tokenizer:
    """The BPE tokenizer for this text and vocabulary size, trained on first use."""
    path = Path(cache_dir) / f"{corpus.name}-{corpus.digest[:12]}-v{vocab_size}.model"
    if path.is_file():
        return open_tokenizer(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"training a {vocab_size}-token BPE tokenizer on {corpus.name} -> {path}")
    lines = (line for doc in corpus.documents() for line in doc.splitlines() if line.strip())
    try:
        return train_sentencepiece(lines, vocab_size, path)
    except RuntimeError as e:  # SentencePiece says what it needs after its source location, "...] "
        reason = str(e).split("] ")[-1]
        # "... smaller than required_chars. 300 vs 318. Increase vocab_size or decrease character_coverage
        # with --character_coverage option.": a flag train.py does not have, since every character of
        # the text must stay a token; the second number is the smallest vocabulary that holds them.
        too_small = re.search(r"required_chars\. \d+ vs (\d+)", reason)
        if too_small:
            reason = (f"a token for each of its characters, with the byte and special tokens, needs at least "
                      f"{too_small[1]}; pass --vocab-size {too_small[1]} or more")
        raise ValueError(f"cannot train a tokenizer with --vocab-size {vocab_size} on {corpus.name}: {reason}") from None


def tokenize(corpus: Corpus, tokenizer: Tokenizer, cache_dir) -> Path:
    """Write (or find) the token file of corpus under tokenizer: each document is BOS + ids + EOS,
    so a model learns where texts begin and end, and sampling can stop at EOS."""
    dtype = "uint16" if tokenizer.n_words <= 1 << 16 else "uint32"
    path = Path(cache_dir) / f"{corpus.name}-{corpus.digest[:12]}-{file_digest(tokenizer.model_path)[:12]}.{dtype}.bin"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp):
        with open(tmp, "wb") as f:
            docs = tqdm(corpus.documents(), desc=f"tokenizing {corpus.name}", unit=" docs", leave=False, delay=1, disable=None)
            for doc in docs:  # a bar on a terminal only (disable=None), if this takes more than a second
                ids = [tokenizer.bos_id, *(i for piece in encode_long(tokenizer, [doc]) for i in piece), tokenizer.eos_id]
                array.array("H" if dtype == "uint16" else "I", ids).tofile(f)

    atomic_write(path, write)
    return path


class TokenSplits:
    """The token file memory-mapped, split into train and val: nothing is read until used."""

    def __init__(self, path, val_fraction: float):
        path = Path(path)
        dtype = getattr(torch, path.suffixes[-2].lstrip("."))
        n = path.stat().st_size // dtype.itemsize
        tokens = torch.from_file(str(path), shared=False, size=n, dtype=dtype)
        n_val = int(n * val_fraction)
        self.path = path
        self.splits = {"train": tokens[: n - n_val], "val": tokens[n - n_val :]}

    def check_seq_len(self, seq_len: int, name: str) -> None:
        """Every split must hold at least one window of seq_len inputs + 1 target."""
        for split, tokens in self.splits.items():
            if len(tokens) < seq_len + 1:
                raise ValueError(
                    f"--seq-len {seq_len} is longer than the data: the {split} split of {name} has {len(tokens)} "
                    f"tokens and one window needs {seq_len + 1}; lower --seq-len to at most {max(len(tokens) - 1, 1)} "
                    "or add text (or change --val-fraction)"
                )

    def random_starts(self, split: str, n: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
        """n window offsets drawn uniformly from split (the training sampler)."""
        return torch.randint(len(self.splits[split]) - seq_len, (n,), generator=generator)

    def even_starts(self, split: str, n: int, seq_len: int) -> torch.Tensor:
        """n offsets spread evenly over split: the same every time, so every evaluation of
        a run scores the same text and its curve is comparable from point to point."""
        return torch.linspace(0, len(self.splits[split]) - seq_len - 1, n).long()

    def windows(self, split: str, starts: torch.Tensor, seq_len: int):
        """Inputs x and next-token targets y, both (len(starts), seq_len) int64."""
        idx = starts[:, None] + torch.arange(seq_len + 1)
        w = self.splits[split][idx].long()
        return w[:, :-1], w[:, 1:]


class TrainBatches:
    """The training batches: an endless iterator of this process's (inputs, targets), each
    (batch_size, seq_len), on device.

    Every process draws the same batch_size * world_size window offsets from the same seeded
    RNG and keeps its slice, so K processes see exactly the windows one process would with the
    whole batch. The RNG's state is part of a checkpoint (run/training_run.py): a resumed run
    draws the batches it would have drawn."""

    def __init__(self, tokens: TokenSplits, batch_size: int, seq_len: int, device: torch.device, seed: int,
                 rank: int = 0, world_size: int = 1):
        self.tokens, self.batch_size, self.seq_len, self.device = tokens, batch_size, seq_len, device
        self.rank, self.world_size = rank, world_size
        self.rng = torch.Generator().manual_seed(seed)

    def __iter__(self):
        return self

    def __next__(self):
        B, T = self.batch_size, self.seq_len
        starts = self.tokens.random_starts("train", B * self.world_size, T, self.rng)
        x, y = self.tokens.windows("train", starts[self.rank * B : (self.rank + 1) * B], T)
        if self.device.type == "cuda":  # from pinned memory the copy overlaps with the GPU's work
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
