"""How far a model's token distributions are from a base model's on the same chunks, as
llama.cpp's llama-perplexity --kl-divergence measures it: the mean KL divergence KL(base || model)
per scored token, how often the two pick the same top token, and the ratio of their
perplexities, each with its standard error.

The base is a second model run beside this one, or the log-probabilities a first run saved
(--save-logits), as llama.cpp saves its base logits. A logits file holds, after a one-line JSON
header, one record per chunk: the chunk's tokens (int32), then each scored position's
log-probabilities as uint16 codes with a float32 minimum and step per row (llama.cpp's own
encoding; a step of at most 1/65535 of the row's range, 4e-4 nats on a range of 25).
"""

import json
import math
from pathlib import Path

import numpy as np
import torch

MAGIC = "llama_mini logits"
MAX_HEADER = 4096


class Comparison:
    """The per-token sums the figures are made of, added a chunk at a time."""

    def __init__(self):
        self.sums = dict.fromkeys(("kld", "kld2", "same", "delta", "delta2", "nll", "base_nll"), 0.0)
        self.count = 0

    def add(self, logprobs: torch.Tensor, base_logprobs: torch.Tensor, targets: torch.Tensor) -> None:
        """logprobs, base_logprobs (tokens, vocab) float32; targets (tokens,): the tokens scored."""
        kld = (base_logprobs.exp() * (base_logprobs - logprobs)).sum(-1).double()
        nll = -logprobs.gather(1, targets[:, None])[:, 0].double()
        base_nll = -base_logprobs.gather(1, targets[:, None])[:, 0].double()
        delta = nll - base_nll
        for key, values in (("kld", kld), ("kld2", kld.square()), ("delta", delta), ("delta2", delta.square()),
                            ("nll", nll), ("base_nll", base_nll),
                            ("same", (logprobs.argmax(-1) == base_logprobs.argmax(-1)).double())):
            self.sums[key] += values.sum().item()
        self.count += len(targets)

    def mean_and_error(self, key: str):
        n = self.count
        mean = self.sums[key] / n
        squares = self.sums.get(key + "2", self.sums[key])  # "same" is 0 or 1: its squares are itself
        variance = max(squares / n - mean * mean, 0.0)
        return mean, math.sqrt(variance / (n - 1)) if n > 1 else math.nan

    def report(self, base: str) -> str:
        kld, kld_error = self.mean_and_error("kld")
        same, same_error = self.mean_and_error("same")
        delta, delta_error = self.mean_and_error("delta")
        ppl, base_ppl = math.exp(self.sums["nll"] / self.count), math.exp(self.sums["base_nll"] / self.count)
        return (f"against {base} over {self.count:,} tokens: mean KL divergence {kld:.6f} +/- {kld_error:.6f}; "
                f"same top token {100 * same:.3f} +/- {100 * same_error:.3f} %; perplexity {ppl:.4f} against {base_ppl:.4f}, "
                f"ratio {math.exp(delta):.5f} +/- {math.exp(delta) * delta_error:.5f}")


class LogitsWriter:
    """--save-logits: the scored positions' log-probabilities, chunk by chunk, into an open file."""

    def __init__(self, file, vocab_size: int, ctx: int, scored: int):
        self.file, self.scored = file, scored
        header = json.dumps({"format": MAGIC, "vocab_size": vocab_size, "ctx": ctx, "scored": scored}) + "\n"
        file.write(header.encode())

    def add(self, chunk: torch.Tensor, logprobs: torch.Tensor) -> None:
        low, high = logprobs.amin(-1, keepdim=True), logprobs.amax(-1, keepdim=True)
        step = ((high - low) / 65535).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round((logprobs - low) / step).clamp(0, 65535).to(torch.int32).numpy().astype("<u2")
        self.file.write(chunk.numpy().astype("<i4").tobytes())
        self.file.write(torch.cat((low, step), -1).numpy().astype("<f4").tobytes())
        self.file.write(codes.tobytes())


class SavedLogits:
    """A logits file read back a chunk at a time, checked against the run that reads it."""

    def __init__(self, path: Path, vocab_size: int, ctx: int, scored: int):
        self.path = path
        with open(path, "rb") as f:
            line = f.readline(MAX_HEADER)
        try:
            header = json.loads(line)
            ok = isinstance(header, dict) and header.get("format") == MAGIC
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"{path} is neither a checkpoint nor a logits file --save-logits writes; pass one of those")
        if (header.get("vocab_size"), header.get("ctx"), header.get("scored")) != (vocab_size, ctx, scored):
            raise ValueError(f"{path} holds logits of {header.get('vocab_size')} tokens in chunks of {header.get('ctx')}; this "
                             f"run has {vocab_size} and chunks of {ctx}: save the base logits with this model's tokenizer "
                             "and the same --ctx")
        self.offset = len(line)
        self.record = 4 * ctx + scored * (8 + 2 * vocab_size)
        self.chunks = (path.stat().st_size - self.offset) // self.record
        if path.stat().st_size != self.offset + self.chunks * self.record:
            raise ValueError(f"{path} ends inside a chunk; it is truncated: save the base logits again")
        self.map = np.memmap(path, np.uint8, "r")
        self.vocab_size, self.ctx, self.scored = vocab_size, ctx, scored

    def chunk(self, i: int, tokens: torch.Tensor) -> torch.Tensor:
        """The base log-probabilities of chunk i, whose tokens must be `tokens`."""
        if i >= self.chunks:
            raise ValueError(f"{self.path} holds {self.chunks} chunks; this text has more: pass --chunks {self.chunks}")
        at = self.offset + i * self.record
        saved = np.frombuffer(self.map, "<i4", self.ctx, at)
        if not np.array_equal(saved, tokens.numpy()):
            raise ValueError(f"{self.path} was saved from another text or tokenizer (chunk {i + 1} differs); "
                             "pass the --data its base run read")
        rows = np.frombuffer(self.map, "<f4", 2 * self.scored, at + 4 * self.ctx).reshape(self.scored, 2)
        codes = np.frombuffer(self.map, "<u2", self.scored * self.vocab_size, at + 4 * self.ctx + 8 * self.scored)
        codes = torch.from_numpy(codes.astype(np.float32)).view(self.scored, self.vocab_size)
        rows = torch.from_numpy(rows.copy())
        return torch.log_softmax(codes * rows[:, 1:] + rows[:, :1], dim=-1)  # normalised again after the rounding
