"""The perplexity of a checkpoint on a text file, measured as llama.cpp's llama-perplexity measures it.

    python -m llama_mini.evaluate --ckpt Llama-3.2-1B-Instruct-Q8_0.gguf --data wiki.test.raw
    python -m llama_mini.evaluate --ckpt checkpoints/stories --data my.txt --quantize int4 --ctx 256

The text is encoded whole, BOS first, and cut into chunks of --ctx tokens. Each chunk is read
from BOS (its first token replaced), and only its second half is scored, so every scored
token sees at least ctx / 2 tokens before it. That is llama.cpp's method, so the two
programs' figures can be set side by side. It prints the perplexity with its standard error,
as llama.cpp does, and bits per byte of the text scored, which compares across tokenizers.
The file is read a piece at a time and scored a chunk at a time: memory stays that of one chunk.
"""

import argparse
import hashlib
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .support.bits_per_byte import TextBytes, bits_per_byte
from .support.cli import check_number, run_main
from .inference.loading import add_model_arguments, load_model, open_checkpoint
from .model import check_fits_context
from .tokenizers.long_text import encode_long
from .run.data import check_utf8, utf8_blocks

DEFAULT_CTX = 512  # llama-perplexity's


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m llama_mini.evaluate", description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--data", required=True, help="a UTF-8 text file")
    p.add_argument("--ctx", type=int, help=f"tokens per chunk; the second half of each is scored (default: {DEFAULT_CTX}, "
                                           "llama.cpp's, or the model's context where it is shorter)")
    p.add_argument("--chunks", type=int, help="score only the first N chunks (default: all)")
    args = p.parse_args(argv)
    check_number("--ctx", args.ctx, 4)
    check_number("--chunks", args.chunks, 1)
    return args


def text_blocks(path: Path, bar: tqdm):
    """The text of path, a block at a time (run/data.py's utf8_blocks), advancing bar by bytes read."""
    for block, text in utf8_blocks(path):
        bar.update(len(block))
        yield text


def chunks(tokenizer, blocks, ctx: int):
    """Chunks of ctx tokens of the text encoded whole with a BOS in front, each chunk's first
    token replaced by BOS; a last chunk shorter than ctx is left out, as llama.cpp does."""
    pending = [tokenizer.bos_id]
    for ids in encode_long(tokenizer, blocks):
        pending += ids
        whole = len(pending) // ctx * ctx
        for start in range(0, whole, ctx):
            yield torch.tensor([tokenizer.bos_id] + pending[start + 1:start + ctx])
        pending = pending[whole:]


class Tally:
    """The negative log-likelihoods of the tokens scored so far, and the bytes they stand for."""

    def __init__(self):
        self.nll = self.nll2 = 0.0
        self.count = self.bytes = 0

    def add(self, nll: torch.Tensor, n_bytes: int) -> None:
        nll = nll.double()
        self.nll += nll.sum().item()
        self.nll2 += nll.square().sum().item()
        self.count += nll.numel()
        self.bytes += n_bytes

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def error(self) -> float:
        """The standard error of the perplexity, llama.cpp's: that of the mean NLL, times the perplexity."""
        mean = self.nll / self.count
        variance = self.nll2 / self.count - mean * mean
        return math.sqrt(variance / (self.count - 1)) * self.perplexity if variance > 0 and self.count > 1 else math.nan


@torch.inference_mode()
def score(model, chunk: torch.Tensor, text_bytes: TextBytes) -> tuple[torch.Tensor, int]:
    """The NLL of the second half of chunk's tokens, each after all the tokens before it,
    and the bytes of text they stand for."""
    ctx, first = len(chunk), len(chunk) // 2
    logits = model(chunk[None].to(next(model.parameters()).device))[0, first:ctx - 1].float()
    targets = chunk[first + 1:]
    nll = -torch.log_softmax(logits, dim=-1).gather(1, targets[:, None].to(logits.device))[:, 0]
    return nll.cpu(), text_bytes.count(chunk[first:ctx - 1], targets)


def evaluate(args) -> Tally:
    path = Path(args.data)
    if not path.exists():
        raise FileNotFoundError(f"data not found: {path}; pass --data a UTF-8 text file")
    if not path.is_file():
        raise ValueError(f"{path} is not a file (a folder or a device); pass --data a UTF-8 text file")
    check_utf8(path, hashlib.sha256())  # the whole file before any work: a bad byte is named, not met halfway
    ckpt, fmt, tokenizer = open_checkpoint(args)
    model = load_model(args, ckpt, fmt, tokenizer)
    if args.ctx is not None:
        check_fits_context(model.args, args.ctx, f"--ctx {args.ctx}", "pass --ctx {context} or less")
    args.ctx = args.ctx or min(DEFAULT_CTX, model.args.max_seq_len)
    model.eval()
    text_bytes, tally = TextBytes(tokenizer), Tally()
    print(f"scoring {path} in chunks of {args.ctx} tokens, the second half of each (llama.cpp's method)", file=sys.stderr)
    with tqdm(total=path.stat().st_size, unit="B", unit_scale=True, dynamic_ncols=True, disable=None) as bar:
        for i, chunk in enumerate(chunks(tokenizer, text_blocks(path, bar), args.ctx)):
            tally.add(*score(model, chunk, text_bytes))
            bar.set_postfix(chunks=i + 1, ppl=f"{tally.perplexity:.4f}", refresh=False)
            if i + 1 == args.chunks:
                break
    if not tally.count:
        raise ValueError(f"{path} holds fewer than --ctx {args.ctx} tokens; pass a longer text or a smaller --ctx")
    return tally


def main(argv=None) -> None:
    args = parse_args(argv)
    tally = evaluate(args)
    nats = tally.nll / tally.count
    print(f"perplexity {tally.perplexity:.4f} +/- {tally.error:.5f} over {tally.count:,} tokens "
          f"({tally.count // (args.ctx - 1 - args.ctx // 2)} chunks of {args.ctx}); "
          f"{bits_per_byte(tally.nll, tally.bytes):.4f} bits per byte, {nats:.4f} nats per token")


if __name__ == "__main__":
    sys.exit(run_main(main))
