"""Quality of each GGUF type as llama.cpp measures it (llama-perplexity --kl-divergence):
perplexity, mean KL divergence from the F32 file and same top token, for llama_mini and for
llama.cpp reading the very same files.

The checkpoint (a run of train.py whose matrix rows are a multiple of 256, so that every
K-quant takes them) is converted to an F32 GGUF as a user converts it, then quantized by
llama.cpp's own quantizer to each type: a single type for every matrix (--pure), or llama.cpp's
usual mixture for a name ending in _M (Q4_K_M: Q4_K with Q6_K here and there). Each file is
read by llama_mini as generate.py and evaluate read it (the file's own precision, the CPU
kernels) and by llama.cpp (llama_cpp.Llama); each program's distributions on the same chunks
of a held-out text (evaluate's chunks, the second half of each scored) are compared with its
own on the F32 file.

    python bench/gguf_kld.py --ckpt /tmp/gguf-bench/run --chunks 20
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
from gguf_parity import LlamaCpp, file_types, quantize_with_llama_cpp  # noqa: E402
from llama_mini import load_checkpoint  # noqa: E402
from llama_mini.evaluate import chunks, score  # noqa: E402
from llama_mini.formats.convert import convert  # noqa: E402
from llama_mini.kernels import use_cpu_kernels, use_fused_rmsnorm  # noqa: E402
from llama_mini.run import corpus  # noqa: E402
from llama_mini.support.kl_divergence import Comparison  # noqa: E402
from llama_mini.tokenizers import open_tokenizer  # noqa: E402

TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K", "Q4_1", "Q4_0", "Q3_K_M", "Q2_K")


def ours(path: Path, texts: list) -> list:
    model = use_cpu_kernels(use_fused_rmsnorm(load_checkpoint(path)))
    return [score(model, chunk) for chunk in texts]


def llama_cpp(path: Path, texts: list, threads: int) -> list:
    peer, first = LlamaCpp(path, len(texts[0]), threads), len(texts[0]) // 2
    return [torch.log_softmax(peer.logits(chunk.tolist())[first:-1], -1) for chunk in texts]


def figures(logprobs: list, base: list, texts: list) -> Comparison:
    comparison, first = Comparison(), len(texts[0]) // 2
    for q, p, chunk in zip(logprobs, base, texts):
        comparison.add(q, p, chunk[first + 1:])
    return comparison


def row(kind: str, matrices: str, mine: Comparison, theirs: Comparison, digits: int = 4) -> str:
    cells = [kind, matrices]
    for c in (mine, theirs):
        kld, error = c.mean_and_error("kld")
        cells += [f"{torch.tensor(c.sums['nll'] / c.count).exp().item():.{digits}f}", f"{kld:.6f} ± {error:.6f}",
                  f"{100 * c.mean_and_error('same')[0]:.2f}%"]
    return "| " + " | ".join(cells) + " |"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a checkpoint with its tokenizer, rows a multiple of 256 (a train.py run)")
    p.add_argument("--types", nargs="+", default=list(TYPES))
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--chunks", type=int, default=20)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--digits", type=int, default=4, help="the perplexity's decimals (llama-perplexity prints 4)")
    args = p.parse_args()
    if not 0 <= args.digits <= 9:
        p.error(f"--digits {args.digits}: give 0 to 9 decimals")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="gguf-kld-") as folder:
        f32 = convert(args.ckpt, Path(folder) / "F32.gguf", "gguf", gguf_type="f32")
        tokenizer = open_tokenizer(f32)
        text = "\n\n".join(corpus.stories(20_000, seed=99))  # stories the run never saw
        texts = [chunk for _, chunk in zip(range(args.chunks), chunks(tokenizer, [text], args.ctx))]
        base_ours, base_theirs = ours(f32, texts), llama_cpp(f32, texts, args.threads)
        print(f"{len(texts)} chunks of {args.ctx} tokens, {len(texts) * (args.ctx - 1 - args.ctx // 2):,} tokens scored\n")
        print("| type | matrices | llama_mini perplexity | KLD from F32 | same top | llama.cpp perplexity | KLD from F32 | "
              "same top |\n|---|---|---|---|---|---|---|---|")
        print(row("F32", file_types(f32), figures(base_ours, base_ours, texts), figures(base_theirs, base_theirs, texts),
                  args.digits))
        for kind in args.types:
            path = quantize_with_llama_cpp(f32, Path(folder) / f"{kind}.gguf", kind.removesuffix("_M"),
                                           pure=not kind.endswith("_M"), threads=args.threads)
            print(row(kind, file_types(path), figures(ours(path, texts), base_ours, texts),
                      figures(llama_cpp(path, texts, args.threads), base_theirs, texts), args.digits), flush=True)
            path.unlink()


if __name__ == "__main__":
    main()
