"""GGUF parity: a checkpoint in every GGUF tensor type, read by llama_mini, against its float32
weights and against llama.cpp reading the same file.

The checkpoint (a run of train.py, say) is converted as a user converts it (python -m
llama_mini.formats.convert CKPT f32.gguf --to gguf --type f32), then quantized from that file
by llama.cpp's own quantizer (llama_cpp.llama_model_quantize, as llama-quantize does) to each
type, every matrix in that one type (--pure) or in llama.cpp's usual mixtures (Q4_K_M ...).
Each file is loaded by llama_mini (load_checkpoint, its vocabulary from the file) and by llama.cpp:
- against float32: the largest |logit difference| over a held-out text, teacher-forced, alone
  and as a share of the logits' spread; and how many greedy tokens after a prompt are the same;
- against llama.cpp: the same, on the same file, and along llama_mini's greedy continuation
  whether llama.cpp picks the same token at every step whose top two logits differ by more than
  the two implementations do. llama.cpp rounds activations to 8 bits in its quantized matrix
  products and keeps its KV cache in F16, so the two differ by that rounding, and a greedy
  text can part at a near tie, after which the counts of equal tokens say little.

Needs llama-cpp-python for the quantized types other than gguf's own (F16, BF16, Q8_0, Q4_0)
and for the llama.cpp columns; without it those are left out.

    python bench/gguf_parity.py --ckpt checkpoints/stories            # a markdown table of every type
    python bench/gguf_parity.py --ckpt checkpoints/stories --types F32 Q8_0 Q4_K_M
"""

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from llama_mini import generate, load_checkpoint  # noqa: E402
from llama_mini.formats.convert import convert  # noqa: E402
from llama_mini.support.gguf_file import GGUFFile  # noqa: E402
from llama_mini.tokenizers import open_tokenizer  # noqa: E402
from llama_mini.run import corpus  # noqa: E402

# Every type llama_mini reads, and the types llama.cpp's quantizer mixes for its usual files.
PURE = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "Q3_K", "Q2_K")
MIXTURES = ("Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K")
LLAMA_FTYPE = {"F32": "ALL_F32", "Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}  # a K type's file type
PROMPT = "Once upon a time"


def quantize_with_llama_cpp(src: Path, dst: Path, type: str, pure: bool, threads: int) -> Path:
    """src (an F32 GGUF) quantized by llama.cpp's llama_model_quantize: every matrix in `type`
    (pure), or llama.cpp's mixture for the file type `type` (Q4_K_M: Q4_K with Q6_K here and there)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{'MOSTLY_' if type != 'F32' else ''}{LLAMA_FTYPE.get(type, type)}")
    params.nthread = threads
    if pure:
        params.pure = True
        params.output_tensor_type = params.token_embedding_type = int(GGMLQuantizationType[type])  # ggml's numbering
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {type}")
    return dst


class LlamaCpp:
    """llama.cpp on one GGUF file: logits of a token sequence, and greedy tokens."""

    def __init__(self, path: Path, n_ctx: int, threads: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, logits_all=True, verbose=False)

    def logits(self, tokens: list[int]) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(tokens)
        return torch.from_numpy(np.array(self.llm.scores[: len(tokens)], dtype=np.float32))

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(prompt)
        new = []
        for _ in range(n):
            new.append(int(np.argmax(self.llm.scores[self.llm.n_tokens - 1])))
            self.llm.eval(new[-1:])
        return new


def file_types(path: Path) -> str:
    """The types of a file's matrices, most common first: "Q4_K 24, Q6_K 5"."""
    counts = {}
    for info in GGUFFile(path).tensors.values():
        if len(info.shape) == 2:
            counts[info.type.name] = counts.get(info.type.name, 0) + 1
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items(), key=lambda item: -item[1]))


@torch.no_grad()
def compare(reference: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """(largest |difference|, as a share of the reference logits' spread at that position)."""
    difference = (logits - reference).abs().amax(-1)
    spread = reference.amax(-1) - reference.amin(-1)
    return difference.max().item(), (difference / spread).max().item()


@torch.no_grad()
def measure(ckpt, types, pure: bool, threads: int, n_greedy: int, folder: Path):
    model = load_checkpoint(ckpt)
    context = min(model.args.max_seq_len, 256)
    f32 = convert(ckpt, folder / "F32.gguf", "gguf", gguf_type="f32")
    tokenizer = open_tokenizer(f32)
    text = tokenizer.encode("\n\n".join(corpus.stories(20_000, seed=99)))[:context]  # stories the run never saw
    prompt = tokenizer.encode(PROMPT)
    reference, expected = model(torch.tensor([text]))[0], generate(model, [prompt], n_greedy, temperature=0)[0]
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama_cpp is not importable: llama.cpp's quantizer and columns are left out", file=sys.stderr)
        llama_cpp = None
    rows = []
    for type in types:
        path = folder / f"{type}.gguf"
        if type == "F32":
            path = f32
        elif llama_cpp is not None:
            quantize_with_llama_cpp(f32, path, type, pure, threads)
        elif type.lower() in ("f16", "bf16", "q8_0", "q4_0"):
            convert(ckpt, path, "gguf", gguf_type=type.lower())
        else:
            continue
        ours = load_checkpoint(path)
        logits, greedy = ours(torch.tensor([text]))[0], generate(ours, [prompt], n_greedy, temperature=0)[0]
        row = [type, file_types(path), *compare(reference, logits), sum(a == b for a, b in zip(greedy, expected))]
        if llama_cpp is not None:
            peer = LlamaCpp(path, context, threads)
            row += [*compare(peer.logits(text), logits), decided_choices(ours, peer, prompt, greedy),
                    sum(a == b for a, b in zip(greedy, peer.greedy(prompt, n_greedy)))]
        rows.append(row)
        print(format_row(row, n_greedy), flush=True)
        del ours
    return rows


@torch.no_grad()
def decided_choices(model, peer: LlamaCpp, prompt: list[int], greedy: list[int]) -> tuple[int, int]:
    """Along llama_mini's greedy continuation: (the steps where llama.cpp picks the same token,
    the steps whose top two logits differ by more than the two implementations' largest
    difference there). A nearer tie may fall either way; any other disagreement would be a bug."""
    sequence = prompt + greedy
    ours, theirs = model(torch.tensor([sequence]))[0], peer.logits(sequence)
    largest = (ours - theirs).abs().max()
    top = ours.topk(2, dim=-1).values
    steps = [i for i in range(len(prompt) - 1, len(sequence) - 1) if top[i, 0] - top[i, 1] > largest]
    return sum(theirs[i].argmax().item() == sequence[i + 1] for i in steps), len(steps)


def format_row(row, n_greedy):
    type, composition, diff, share, equal, *peer = row
    cells = [type, composition, f"{diff:.2e}", f"{share:.2%}", f"{equal}/{n_greedy}"]
    if peer:
        cells += [f"{peer[0]:.2e}", f"{peer[1]:.2%}", "{}/{}".format(*peer[2]), f"{peer[3]}/{n_greedy}"]
    return "| " + " | ".join(cells) + " |"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a checkpoint load_checkpoint reads, with its tokenizer (e.g. a train.py run)")
    p.add_argument("--types", nargs="+", help=f"default: {' '.join(PURE)} (pure), then {' '.join(MIXTURES)} (mixtures)")
    p.add_argument("--mixtures", action="store_true", help="llama.cpp's usual mixtures of --types instead of one type per file")
    p.add_argument("--greedy", type=int, default=100, help="greedy tokens compared (default: %(default)s)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    header = ("| type | matrices | max abs logit diff vs float32 | share of spread | greedy tokens equal | "
              "max abs logit diff vs llama.cpp | share of spread | llama.cpp's choice at decided steps | "
              "greedy tokens equal llama.cpp's |")
    with tempfile.TemporaryDirectory(prefix="gguf-parity-") as folder:
        runs = [(args.types, args.mixtures)] if args.types else [(PURE, False), (MIXTURES, True)]
        for types, mixtures in runs:
            print(header + "\n|" + "---|" * header.count(" | ") + "---|")
            measure(args.ckpt, types, not mixtures, args.threads, args.greedy, Path(folder))
            for gguf_file in Path(folder).glob("*.gguf"):
                gguf_file.unlink()


if __name__ == "__main__":
    main()
