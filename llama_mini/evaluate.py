"""The perplexity of a checkpoint on a text file, measured as llama.cpp's llama-perplexity measures it.

    python -m llama_mini.evaluate --ckpt Llama-3.2-1B-Instruct-Q8_0.gguf --data wiki.test.raw
    python -m llama_mini.evaluate --ckpt checkpoints/stories --data my.txt --quantize int4 --ctx 256
    python -m llama_mini.evaluate --ckpt model-Q4_K_M.gguf --data wiki.test.raw --kl-divergence model-F32.gguf

The text is encoded whole, BOS first, and cut into chunks of --ctx tokens. Each chunk is read
from BOS (its first token replaced), and only its second half is scored, so every scored
token sees at least ctx / 2 tokens before it. That is llama.cpp's method, so the two
programs' figures can be set side by side. It prints the perplexity with its standard error,
as llama.cpp does, and bits per byte of the text scored, which compares across tokenizers.
The file is read a piece at a time and scored a chunk at a time: memory stays that of one chunk.

--kl-divergence BASE also compares each scored token's distribution with a base model's, as
llama-perplexity --kl-divergence does (support/kl_divergence.py): BASE is a second checkpoint
(the F32 or F16 file a quantized one was made from, say) or the logits a base run saved with
--save-logits FILE.
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
from .support.files import atomic_write
from .support.kl_divergence import Comparison, LogitsWriter, SavedLogits
from .formats.checkpoint import detect_format, resolve_run_folder
from .inference.loading import add_model_arguments, check_shares_tokenizer, load_model, open_checkpoint
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
    p.add_argument("--kl-divergence", metavar="BASE", help="also compare with a base model's token distributions: a "
                                                           "checkpoint, or a logits file --save-logits wrote")
    p.add_argument("--save-logits", metavar="FILE", help="save the scored tokens' log-probabilities to a new FILE, the "
                                                         "base of a later --kl-divergence")
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
    """The negative log-likelihoods of the tokens scored so far, and the bytes they stand for;
    with a base model, comparison holds how far the model's distributions are from its."""

    def __init__(self, comparison=None):
        self.nll = self.nll2 = 0.0
        self.count = self.bytes = 0
        self.comparison = comparison

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
def score(model, chunk: torch.Tensor) -> torch.Tensor:
    """The log-probabilities (float32, on the CPU) of the second half of chunk's tokens, each
    after all the tokens before it."""
    ctx, first = len(chunk), len(chunk) // 2
    logits = model(chunk[None].to(next(model.parameters()).device))[0, first:ctx - 1].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def open_base(args, model, tokenizer, ctx: int):
    """--kl-divergence's base: a model (loaded at its stored precision), or a SavedLogits; None without it."""
    if args.kl_divergence is None:
        return None
    path = Path(args.kl_divergence)
    if path.is_file() and _starts_as_logits(path):
        return SavedLogits(path, model.args.vocab_size, ctx, ctx - 1 - ctx // 2)
    try:
        path = resolve_run_folder(path)
        check_shares_tokenizer(path, tokenizer, "the base")
        flags = argparse.Namespace(**{**vars(args), "dtype": None, "quantize": None})
        base = load_model(flags, path, detect_format(path), tokenizer)
    except (ValueError, OSError) as e:
        raise ValueError(f"--kl-divergence {args.kl_divergence}: {e}") from None
    if base.args.vocab_size != model.args.vocab_size:
        raise ValueError(f"--kl-divergence {args.kl_divergence}: its vocabulary has {base.args.vocab_size} tokens and the "
                         f"model's {model.args.vocab_size}: the base must share the model's tokenizer")
    return base.eval()


def evaluate(args) -> Tally:
    path = Path(args.data)
    if not path.exists():
        raise FileNotFoundError(f"data not found: {path}; pass --data a UTF-8 text file")
    if not path.is_file():
        raise ValueError(f"{path} is not a file (a folder or a device); pass --data a UTF-8 text file")
    check_utf8(path, hashlib.sha256())  # the whole file before any work: a bad byte is named, not met halfway
    if args.save_logits is not None and (Path(args.save_logits).exists() or Path(args.save_logits).is_symlink()):
        raise FileExistsError(f"{args.save_logits} already exists; --save-logits writes a new file: name another")
    if args.save_logits is not None and not Path(args.save_logits).parent.is_dir():
        raise FileNotFoundError(f"--save-logits {args.save_logits}: the folder {Path(args.save_logits).parent} does not "
                                "exist; create it first")
    ckpt, fmt, tokenizer = open_checkpoint(args)
    model = load_model(args, ckpt, fmt, tokenizer)
    if args.ctx is not None:
        check_fits_context(model.args, args.ctx, f"--ctx {args.ctx}", "pass --ctx {context} or less")
    args.ctx = args.ctx or min(DEFAULT_CTX, model.args.max_seq_len)
    model.eval()
    base = open_base(args, model, tokenizer, args.ctx)
    if args.save_logits is None:
        return score_text(args, path, model, tokenizer, base)
    scored = {}

    def write(tmp):
        with open(tmp, "wb") as f:
            writer = LogitsWriter(f, model.args.vocab_size, args.ctx, args.ctx - 1 - args.ctx // 2)
            scored["tally"] = score_text(args, path, model, tokenizer, base, writer)

    atomic_write(Path(args.save_logits), write)  # a killed run leaves no partial file
    return scored["tally"]


def _starts_as_logits(path: Path) -> bool:
    """Whether a file starts as --save-logits writes its header (a checkpoint file never does)."""
    with open(path, "rb") as f:
        return f.read(len(b'{"format"')) == b'{"format"'


def score_text(args, path: Path, model, tokenizer, base=None, writer=None):
    """Tally of the text's chunks (and its Comparison with base, where there is one, as
    tally.comparison), each chunk's log-probabilities also given to writer."""
    text_bytes, tally = TextBytes(tokenizer), Tally(Comparison() if base is not None else None)
    print(f"scoring {path} in chunks of {args.ctx} tokens, the second half of each (llama.cpp's method)", file=sys.stderr)
    with tqdm(total=path.stat().st_size, unit="B", unit_scale=True, dynamic_ncols=True, disable=None) as bar:
        for i, chunk in enumerate(chunks(tokenizer, text_blocks(path, bar), args.ctx)):
            first = args.ctx // 2
            logprobs, targets = score(model, chunk), chunk[first + 1:]
            tally.add(-logprobs.gather(1, targets[:, None])[:, 0], text_bytes.count(chunk[first:-1], targets))
            if writer is not None:
                writer.add(chunk, logprobs)
            if base is not None:
                base_logprobs = base.chunk(i, chunk) if isinstance(base, SavedLogits) else score(base, chunk)
                tally.comparison.add(logprobs, base_logprobs, targets)
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
    if tally.comparison is not None:
        print(tally.comparison.report(args.kl_divergence))


if __name__ == "__main__":
    sys.exit(run_main(main))
