"""Perplexity per weight type: llama_mini's evaluate beside llama.cpp's llama-perplexity method
run on llama.cpp's own logits, on one checkpoint and one text.

The checkpoint is converted to an F32 GGUF file (convert --to gguf), quantized from that by
llama.cpp's quantizer (every matrix in one type), and each file is scored twice: by
`python -m llama_mini.evaluate` and by llama.cpp (its tokenizer, its logits, chunk by chunk,
the second half of each chunk scored, its standard error). The checkpoint itself is also
scored with llama_mini's own --quantize int8 and int4. Without llama-cpp-python the llama.cpp
column and its quantizer's types are left out (gguf writes F16, BF16, Q8_0 and Q4_0 itself).

    python bench/perplexity.py --ckpt checkpoints/shakespeare --data ../shared/fixtures/tinyshakespeare/input.txt --ctx 256
"""

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from gguf_parity import LlamaCpp, quantize_with_llama_cpp  # noqa: E402
from llama_mini import evaluate  # noqa: E402
from llama_mini.support.bits_per_byte import bits_per_byte  # noqa: E402
from llama_mini.formats.convert import convert  # noqa: E402

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")


def llama_cpp_perplexity(path: Path, text: str, ctx: int, threads: int, chunks=None) -> tuple[float, float, int]:
    """llama-perplexity's figures for the GGUF file at path: (perplexity, its standard error,
    tokens scored), from llama.cpp's tokenizer and logits."""
    peer = LlamaCpp(path, ctx, threads)
    tokens = peer.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    n_chunks = len(tokens) // ctx if chunks is None else min(chunks, len(tokens) // ctx)
    first, nll = ctx // 2, []
    for start in range(0, n_chunks * ctx, ctx):
        chunk = [peer.llm.token_bos()] + tokens[start + 1:start + ctx]
        logits = peer.logits(chunk).double().numpy()[first:ctx - 1]
        top = logits.max(-1, keepdims=True)
        log_z = (top[:, 0] + np.log(np.exp(logits - top).sum(-1)))
        nll.append(log_z - logits[np.arange(len(logits)), chunk[first + 1:]])
    nll = np.concatenate(nll)
    mean, ppl = nll.mean(), math.exp(nll.mean())
    variance = (nll * nll).mean() - mean * mean
    return ppl, math.sqrt(variance / (len(nll) - 1)) * ppl, len(nll)


def ours(ckpt, data: Path, ctx: int, chunks, *flags: str):
    args = evaluate.parse_args(["--ckpt", str(ckpt), "--data", str(data), "--ctx", str(ctx), *flags,
                                *(["--chunks", str(chunks)] if chunks else [])])
    return evaluate.evaluate(args)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a checkpoint load_checkpoint reads, with its tokenizer (e.g. a train.py run)")
    p.add_argument("--data", required=True, help="a UTF-8 text file")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, help="score only the first N chunks")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    text = Path(args.data).read_text(encoding="utf-8")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama_cpp is not importable: its column is left out", file=sys.stderr)
        llama_cpp = None
    print("| weights | llama_mini perplexity | bits per byte | llama.cpp perplexity | ratio |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="perplexity-") as folder:
        f32 = convert(args.ckpt, Path(folder) / "F32.gguf", "gguf", gguf_type="f32")
        rows = [(f"GGUF {type}", type) for type in TYPES] + [("--quantize int8", None), ("--quantize int4", None)]
        for name, type in rows:
            if type is None:
                tally = ours(args.ckpt, args.data, args.ctx, args.chunks, *name.split())
                peer = None
            else:
                path = f32 if type == "F32" else Path(folder) / f"{type}.gguf"
                if type != "F32":
                    if llama_cpp is not None and type != "BF16":
                        quantize_with_llama_cpp(f32, path, type, pure=True, threads=args.threads)
                    else:
                        convert(args.ckpt, path, "gguf", gguf_type=type.lower())
                tally = ours(path, args.data, args.ctx, args.chunks)
                peer = llama_cpp_perplexity(path, text, args.ctx, args.threads, args.chunks) if llama_cpp else None
            cells = [name, f"{tally.perplexity:.4f} ± {tally.error:.4f}", f"{bits_per_byte(tally.nll, tally.bytes):.4f}"]
            cells += [f"{peer[0]:.4f} ± {peer[1]:.4f}", f"{tally.perplexity / peer[0]:.4f}"] if peer else ["", ""]
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
